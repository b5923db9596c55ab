"""Overhead of vToken: indirection-only vs Native, reclamation cost breakdown, force-sync ablation.

  indirection-only  vToken hooks installed and run every step (eviction driver, reclamation
                    backend's eligibility/planner, KV monitor) with eviction ratio 0, so no token
                    is ever evicted; StreamingLLM needs no attention statistics, so the model
                    path is Native's. (Attention always reads through the token table in this
                    engine, so `--kv-eviction-policy none` with vToken is Native by construction.)
  breakdown         H2O at ratio 0.5 with vToken: planner (eligibility + planning, every step),
                    copy, and token-table rewrite time per relocation event.
  force-sync        --kv-reclaim-force-sync vs the default; on CPU the copy is synchronous
                    either way, so the two should match (the GPU path is where they differ).

--intervals N ...: instead, Native against H2O with vToken at a fixed budget of half the prompt
under scope generated (a request holds its prompt plus that many generated tokens) and
--kv-evict-interval N for each N: how much of Native's tok/s batching the evictions buys back.

All variants run in one process, one engine each, stepped in turn (A B C, B C A, C A B, ...) over the
same requests, so load drift on a shared host hits every variant alike; a second Native engine
is the control (its ratio to Native is the noise floor); `hook_share_%` (time
inside the vToken hooks / the engine's own step time) does not depend on the load at all.

    python benchmarks/benchmark_overhead.py --quick
    python benchmarks/benchmark_overhead.py --intervals 1 16 64 128 --concurrency 16
"""
import time

import numpy as np

import common
from vllm import LLM

INDIRECTION = dict(kv_eviction_policy="streamingllm", kv_eviction_ratio=0.0, kv_reclamation="vtoken")
VARIANTS = {
    "Native": dict(kv_eviction_policy="none"),
    "indirection-only": INDIRECTION,
    "Naive-Evict (H2O)": dict(kv_eviction_policy="h2o", kv_reclamation="none"),
    "vToken (H2O)": dict(kv_eviction_policy="h2o", kv_reclamation="vtoken"),
    "vToken force-sync (H2O)": dict(kv_eviction_policy="h2o", kv_reclamation="vtoken",
                                    kv_reclaim_force_sync=True),
    "Native (control)": dict(kv_eviction_policy="none"),   # same as Native: shows the noise floor
}


def timed(obj, name, acc):
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[name] = acc.get(name, 0.0) + time.perf_counter() - t0
    setattr(obj, name, wrapper)


def interleaved(model, variants, work, args):
    """One engine per variant, all loaded with the same requests, stepped in turn (A B C A B C
    ...), so load drift on a shared host hits every variant alike. -> per-variant results."""
    from vllm import SamplingParams
    blocks = len(work) * -(-(max(len(p) + n for p, n in work) + 16) // 16) + 8
    engines, hooks, steps = {}, {}, {}
    for name, kw in variants.items():
        llm = LLM(model, max_num_seqs=len(work), seed=args.seed, num_gpu_blocks_override=blocks,
                  kv_min_tokens=0,
                  **kw)
        eng = engines[name] = llm.llm_engine
        hooks[name], steps[name] = {}, []
    # Warm every engine once all exist (engines built earlier still step slower on this host,
    # up to ~1.4x for the first one: main() alternates the build order to cancel it).
    for eng in engines.values():
        for _ in range(2):
            for i, (prompt, n) in enumerate(work[:4]):
                eng.add_request(f"w{i}", {"prompt_token_ids": prompt},
                                SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
            while eng.has_unfinished_requests():
                eng.step()
    for name, eng in engines.items():
        hooked = [(eng.kv, "after_step"), (eng.kv, "copies_done")]
        if eng.worker.relocation is not None:       # the copies' fence, submit and poll
            hooked.append((eng.worker.relocation, "execute"))
        for obj, fn in hooked:
            timed(obj, fn, hooks[name])
        for i, (prompt, n) in enumerate(work):
            eng.add_request(f"x{i}", {"prompt_token_ids": prompt},
                            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    busy = {name: 0.0 for name in engines}
    order, rnd = list(engines), 0
    while any(e.has_unfinished_requests() for e in engines.values()):
        rnd += 1      # rotate who goes first, so no variant always follows the same neighbour
        for name in order[rnd % len(order):] + order[:rnd % len(order)]:
            eng = engines[name]
            if not eng.has_unfinished_requests():
                continue
            decode = not eng.scheduler.waiting and all(
                s.num_computed_tokens >= s.num_tokens - 1 for s in eng.scheduler.running)
            t0 = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t0
            busy[name] += dt
            if decode:
                steps[name].append(dt)
    out = {}
    for name, eng in engines.items():
        kv = eng.get_kv_stats()
        st = np.array(steps[name])
        events = max(kv["relocation_events"], 1)
        out[name] = {
            "tok_s": sum(n for _, n in work) / busy[name],
            "step_ms_median": 1e3 * float(np.median(st)),
            "step_ms_p95": 1e3 * float(np.percentile(st, 95)), "decode_steps": len(st),
            "hook_ms_per_step": 1e3 * sum(hooks[name].values()) / max(len(st), 1),
            "hook_share_%": 100 * sum(hooks[name].values()) / busy[name],
            "relocation_events": kv["relocation_events"],
            "planner_ms_per_event": 1e3 * kv["planner_time_s"] / events,
            "copy_ms_per_event": 1e3 * kv["copy_time_s"] / events,
            "rewrite_ms_per_event": 1e3 * kv["table_rewrite_time_s"] / events,
            "translation_rebuilds": kv["translation_rebuilds"], "seconds": busy[name]}
    return out


def interval_variants(intervals, budget: int, scope: str = "generated") -> dict:
    """Native, its control, and H2O + vToken at `budget` per eviction interval."""
    out = {"Native": VARIANTS["Native"]}
    for n in intervals:
        out[f"H2O interval {n}"] = dict(kv_eviction_policy="h2o", kv_reclamation="vtoken",
                                        kv_budget_tokens=budget, kv_evict_scope=scope,
                                        kv_evict_interval=n)
    out["Native (control)"] = VARIANTS["Native (control)"]
    return out


def main():
    p = common.base_parser(__doc__)
    p.add_argument("--concurrency", type=int, nargs="+", default=None)
    p.add_argument("--intervals", type=int, nargs="+", default=None,
                   help="compare --kv-evict-interval values instead (H2O, scope generated)")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs, building the engines in forward then reverse order (on this "
                        "host an engine built earlier steps slower; alternating cancels that)")
    args = p.parse_args()
    common.setup(args)
    model, label = common.model_for(args)
    tok = common.tokenizer_for(model)
    conc = args.concurrency or ([8] if args.quick else [8, 16])
    plen, olen = (256, 64) if args.quick else (512, 128)
    if args.intervals:
        olen = 256 if args.quick else 512          # generated tokens past the budget, many times
    variants = interval_variants(args.intervals, plen // 2) if args.intervals else VARIANTS
    rows = []
    for c in conc:
        work = common.workload("longbench", c, tok, plen, olen, args, fixed_output=True)
        runs = []
        for rep in range(args.repeats):     # build order forward, then reversed, ...
            names = list(variants) if rep % 2 == 0 else list(variants)[::-1]
            runs.append(interleaved(model, {n: variants[n] for n in names}, work, args))
        res = {name: {k: float(np.mean([r[name][k] for r in runs])) for k in runs[0][name]}
               for name in variants}
        native = res["Native"]
        for name, r in res.items():
            rows.append({"C": c, "variant": name, **r,
                         "step_vs_native": r["step_ms_median"] / native["step_ms_median"],
                         "tok_s_vs_native": r["tok_s"] / native["tok_s"]})
    title = (f"Step time and vToken hook cost, LongBench-style {plen}-token prompts + {olen} "
             f"tokens; {label}; {common.machine()}")
    if args.intervals:
        title = (f"tok/s against --kv-evict-interval: H2O + vToken, scope generated, budget "
                 f"{plen // 2} generated tokens; {plen}-token prompts + {olen} tokens; {label}; "
                 f"{common.machine()}")
        text = common.table(rows, ["C", "variant", "tok_s", "tok_s_vs_native", "step_ms_median",
                                   "hook_ms_per_step", "relocation_events"], title)
        common.save("benchmark_overhead_interval", {"args": vars(args), "model": label,
                                                    "rows": rows, "table": text},
                    interval_plot(rows, conc))
        return
    text = common.table(rows, ["C", "variant", "tok_s", "step_ms_median", "step_ms_p95",
                               "step_vs_native", "hook_ms_per_step", "hook_share_%"], title)
    reloc = [r for r in rows if r["relocation_events"]]
    text += "\n" + common.table(reloc, ["C", "variant", "relocation_events",
                                        "planner_ms_per_event", "copy_ms_per_event",
                                        "rewrite_ms_per_event"],
                                "Reclamation cost per relocation event (planner includes "
                                "per-step eligibility checks)")
    pyplot = common.plt()
    fig, axes = pyplot.subplots(1, 2, figsize=(10, 3.4))
    ax = axes[0]
    for c in conc:
        sub = [r for r in rows if r["C"] == c]
        ax.plot([r["variant"] for r in sub], [r["step_vs_native"] for r in sub], "o-",
                label=f"C={c}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("decode step time / Native")
    ax.tick_params(axis="x", labelsize=6, rotation=20)
    ax.legend(fontsize=7)
    ax.set_title("Step time relative to Native (median)", fontsize=9)
    ax = axes[1]
    parts = ("planner_ms_per_event", "copy_ms_per_event", "rewrite_ms_per_event")
    bottom = np.zeros(len(reloc))
    for part in parts:
        vals = np.array([r[part] for r in reloc])
        ax.bar(range(len(reloc)), vals, bottom=bottom, label=part.replace("_ms_per_event", ""))
        bottom += vals
    ax.set_xticks(range(len(reloc)), [f"{r['variant']}\nC={r['C']}" for r in reloc], fontsize=6)
    ax.set_ylabel("ms per relocation event")
    ax.set_title("Reclamation cost breakdown", fontsize=9)
    ax.legend(fontsize=7)
    common.save("benchmark_overhead", {"args": vars(args), "model": label, "rows": rows,
                                       "table": text}, fig)


def interval_plot(rows, conc):
    fig, ax = common.plt().subplots(figsize=(6, 3.4))
    for c in conc:
        sub = [r for r in rows if r["C"] == c and r["variant"].startswith("H2O interval")]
        ax.plot([int(r["variant"].split()[-1]) for r in sub],
                [r["tok_s_vs_native"] for r in sub], "o-", label=f"C={c}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axhline(0.95, color="gray", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("--kv-evict-interval N")
    ax.set_ylabel("tok/s / Native")
    ax.legend(fontsize=7)
    ax.set_title("H2O + vToken, scope generated: tok/s against the eviction interval",
                 fontsize=9)
    return fig


if __name__ == "__main__":
    main()
