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

--shape NAME runs a paper model shape (common.SIM_SHAPES) with random weights (--load-format
dummy) on fixed-length synthetic prompts instead of the default model, --layers N of its layers:
with --device cuda that is the GPU form of the paper's Fig. 11 (b, c), where the relocation copies
run asynchronously beside decode and --kv-reclaim-force-sync blocks on each (on a CPU the copy is
synchronous either way). gpu_check.sh runs it with --policy random: random weights attend almost
uniformly, so H2O drops the newest prompt tokens in one run, whole blocks go free and nothing is
ever relocated; random's holes are scattered, as trained attention's are.

    python benchmarks/benchmark_overhead.py --quick
    python benchmarks/benchmark_overhead.py --concurrency 16 48           # the paper's C
    python benchmarks/benchmark_overhead.py --intervals 1 16 64 128 --concurrency 16
    python benchmarks/benchmark_overhead.py --device cuda --shape llama-3.1-8b --layers 8 \
        --policy random --concurrency 16 48 --variants naive vtoken force-sync \
        --out benchmark_overhead_gpu
"""
import json
import os
import time

import numpy as np

import common
from vllm import LLM

INDIRECTION = dict(kv_eviction_policy="streamingllm", kv_eviction_ratio=0.0, kv_reclamation="vtoken")


def eviction_variants(policy: str = "h2o", keys=None) -> dict:
    """Variant name -> engine keywords, the evicting ones with `policy`; keys: a subset by
    --variants key (Native, the reference, always)."""
    tag = {"h2o": "H2O"}.get(policy, policy)
    ev = dict(kv_eviction_policy=policy)
    table = {"native": ("Native", dict(kv_eviction_policy="none")),
             "indirection": ("indirection-only", INDIRECTION),
             "naive": (f"Naive-Evict ({tag})", dict(ev, kv_reclamation="none")),
             "vtoken": (f"vToken ({tag})", dict(ev, kv_reclamation="vtoken")),
             "force-sync": (f"vToken force-sync ({tag})",
                            dict(ev, kv_reclamation="vtoken", kv_reclaim_force_sync=True)),
             # the same as Native: shows the noise floor
             "control": ("Native (control)", dict(kv_eviction_policy="none"))}
    return {name: kw for key, (name, kw) in table.items()
            if keys is None or key in keys or key == "native"}


VARIANTS = eviction_variants()
VARIANT_KEYS = ["native", "indirection", "naive", "vtoken", "force-sync", "control"]


def timed(obj, name, acc):
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[name] = acc.get(name, 0.0) + time.perf_counter() - t0
    setattr(obj, name, wrapper)


def interleaved(model, variants, work, args, extra=None):
    """One engine per variant, all loaded with the same requests, stepped in turn (A B C A B C
    ...), so load drift on a shared host hits every variant alike. -> per-variant results.
    extra: engine keywords every variant gets (device, load format)."""
    from vllm import SamplingParams
    blocks = common.roomy_blocks(work)
    engines, hooks, steps = {}, {}, {}
    for name, kw in variants.items():
        llm = LLM(model, max_num_seqs=len(work), seed=args.seed, num_gpu_blocks_override=blocks,
                  kv_min_tokens=0, **(extra or {}), **kw)
        eng = engines[name] = llm.llm_engine
        hooks[name], steps[name] = {}, []
    # Warm every engine once all exist (engines built earlier still step slower on this host,
    # up to ~1.4x for the first one: main() alternates the build order to cancel it), on the
    # prompts' first 64 tokens: the code paths, not the prefill's cost.
    for eng in engines.values():
        for _ in range(2):
            for i, (prompt, n) in enumerate(work[:4]):
                eng.add_request(f"w{i}", {"prompt_token_ids": prompt[:64]},
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
            # copy launch + accounting; blocked: waits on a copy (force-sync: every one)
            "copy_ms_per_event": 1e3 * kv.get("copy_time_s", 0.0) / events,
            "blocked_ms_per_event": 1e3 * kv.get("copy_blocked_s", 0.0) / events,
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


def shape_model(shape: str, layers: int) -> str:
    """A config.json of a paper shape with `layers` of its layers (random weights: dummy)."""
    path = common.sim_config_dir(shape=shape)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = layers or cfg["num_hidden_layers"]
    cfg.pop("layer_types", None)              # sized by the full depth
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def main():
    p = common.base_parser(__doc__)
    p.add_argument("--concurrency", type=int, nargs="+", default=None)
    p.add_argument("--intervals", type=int, nargs="+", default=None,
                   help="compare --kv-evict-interval values instead (H2O, scope generated)")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs, building the engines in forward then reverse order (on this "
                        "host an engine built earlier steps slower; alternating cancels that)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--shape", default=None, choices=list(common.SIM_SHAPES),
                   help="a paper model shape with random weights instead of --model")
    p.add_argument("--layers", type=int, default=None, help="--shape: layers kept (default all)")
    p.add_argument("--variants", nargs="+", default=None, choices=VARIANT_KEYS,
                   help="a subset of the variants (Native is always run: the reference)")
    p.add_argument("--policy", default="h2o", help="the evicting variants' policy")
    p.add_argument("--out", default=None, help="result name (default benchmark_overhead)")
    args = p.parse_args()
    common.setup(args)
    extra = {} if args.device == "auto" else {"device": args.device}
    if args.shape:
        model, tok = shape_model(args.shape, args.layers), None
        label = f"{args.shape} shape, {args.layers or 'all'} layers, random weights"
        extra["load_format"] = "dummy"
    else:
        model, label = common.model_for(args)
        tok = common.tokenizer_for(model)
    conc = args.concurrency or ([8] if args.quick else [8, 16])
    # --quick: 128-token prompts (the prefill, C x plen tokens a variant, is not what Fig. 11
    # measures: the decode steps after it)
    plen, olen = (128, 64) if args.quick else (512, 128)
    if args.intervals:              # generated tokens past the budget, many times
        plen, olen = (256, 256) if args.quick else (512, 512)
    variants = interval_variants(args.intervals, plen // 2) if args.intervals else \
        eviction_variants(args.policy, args.variants)
    rows = []
    for c in conc:
        work = (common.workload("longbench", c, tok, plen, olen, args, fixed_output=True) if tok
                else common.synthetic(c, plen, olen, 32000, args.seed, sigma=1e-9))
        runs = []
        for rep in range(args.repeats):     # build order forward, then reversed, ...
            names = list(variants) if rep % 2 == 0 else list(variants)[::-1]
            runs.append(interleaved(model, {n: variants[n] for n in names}, work, args, extra))
        res = {name: {k: float(np.mean([r[name][k] for r in runs])) for k in runs[0][name]}
               for name in variants}
        native = res["Native"]
        for name, r in res.items():
            rows.append({"C": c, "variant": name, **r,
                         "step_vs_native": r["step_ms_median"] / native["step_ms_median"],
                         "tok_s_vs_native": r["tok_s"] / native["tok_s"]})
    prompts = "LongBench-style" if tok else "synthetic"
    title = (f"Step time and vToken hook cost, {prompts} {plen}-token prompts + {olen} "
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
                                        "rewrite_ms_per_event", "blocked_ms_per_event"],
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
    common.save(args.out or "benchmark_overhead", {"args": vars(args), "model": label,
                                                   "rows": rows, "table": text}, fig)


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
