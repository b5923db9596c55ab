"""Capacity frontier: under a fixed KV block budget, the highest concurrency C whose C requests
are all resident at once and finish without preemption. Native vs Naive-Evict vs vToken (H2O,
ratio 0.5) vs the ideal packed footprint floor(budget / ceil(live / block_size)).

Relocation never allocates, so vToken reserves no headroom: every variant gets the same blocks.

    python benchmarks/benchmark_capacity.py --quick               # real engine, default model
    python benchmarks/benchmark_capacity.py --simulate --quick    # paper setup at 1/8 scale
    python benchmarks/benchmark_capacity.py --simulate --scale 1  # paper scale (hours on 2 cores)

--simulate runs the paper's experiment (Llama-3.1-8B shape, block 16, 5,427 and 11,519 usable
blocks, 4,032-token prompts, output_len 12,288) through the real scheduler, block manager, token
tables, policy and planner, with synthetic attention statistics (--load-format simulate). --scale s
multiplies prompt, output and budgets by s, so blocks per request and the pool shrink together
and the concurrency frontier stays comparable with the paper's.
"""
import time

import numpy as np

import common
from vllm import LLM, SamplingParams


def trial(model, kw, work, c, budget, extra):
    """Run C requests at once under `budget` blocks; stop at the first sign of infeasibility."""
    llm = LLM(model, num_gpu_blocks_override=budget, max_num_seqs=c, seed=0, kv_min_tokens=0,
              **extra, **kw)
    eng = llm.llm_engine
    for i, (prompt, out_len) in enumerate(work[:c]):
        eng.add_request(str(i), {"prompt_token_ids": prompt},
                        SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    max_running, done, t0 = 0, [], time.perf_counter()
    while eng.has_unfinished_requests():
        outs = eng.step()
        max_running = max(max_running, len(eng.scheduler.running))
        done += [o for o in outs if o.finished]
        if eng.scheduler.num_preemptions or (done and max_running < c):
            break
    secs = time.perf_counter() - t0
    eng.abort_request([str(i) for i in range(c)])
    ok = (not eng.scheduler.num_preemptions and max_running == c and len(done) == c and
          all(len(o.outputs[0].token_ids) == n for o, (_, n) in zip(
              sorted(done, key=lambda o: int(o.request_id)), work)))
    per_req = float(np.mean([o.kv_stats["peak_blocks"] for o in done])) if done else None
    live = float(np.mean([o.kv_stats["live_tokens"] for o in done])) if done else None
    return {"c": c, "feasible": bool(ok), "pool_peak": eng.kv.bm.peak_used,
            "request_peak_blocks": per_req, "live_tokens": live, "seconds": secs,
            "tok_s": sum(n for _, n in work[:c]) / secs if ok else None}


def frontier(model, name, kw, work, budget, guess, extra, log):
    """Walk from the guess: up while feasible, down while not. -> (C_max, trials)."""
    tried = {}

    def feasible(c):
        if c not in tried:
            tried[c] = trial(model, kw, work, c, budget, extra)
            t = tried[c]
            log(f"  budget {budget} {name} C={c}: {'feasible' if t['feasible'] else 'infeasible'} "
                f"(pool peak {t['pool_peak']}, {t['seconds']:.0f}s)")
        return tried[c]["feasible"]

    c = max(1, min(guess, len(work)))
    if feasible(c):
        while c < len(work) and feasible(c + 1):
            c += 1
    else:
        while c > 1 and not feasible(c - 1):
            c -= 1
        c -= 1
    return c, [tried[k] for k in sorted(tried)]


def main():
    p = common.base_parser(__doc__)
    p.add_argument("--simulate", action="store_true", help="paper scale via --load-format simulate")
    p.add_argument("--scale", type=float, default=None, help="--simulate: length/budget scale")
    p.add_argument("--budgets", type=int, nargs="+", default=None)
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--out", default=None, help="result name (default benchmark_capacity[_sim])")
    p.add_argument("--frag-thresholds", type=float, nargs="+", default=[0.25, 0.05],
                   help="vToken variants (0.25 is the engine default)")
    args = p.parse_args()
    common.setup(args)
    bs = 16
    scale = 1.0
    if args.simulate:
        scale = args.scale or (0.125 if args.quick else 0.25)
        prompt_len = args.prompt_len or round(4032 * scale)
        output_len = args.output_len or round(12288 * scale)
        budgets = args.budgets or [round(5427 * scale), round(11519 * scale)]
        model, label = common.sim_config_dir(), f"simulated Llama-3.1-8B shape, scale {scale:g}"
        extra = dict(load_format="simulate", max_model_len=prompt_len + output_len + bs)
        max_c = 32
        work = common.synthetic(max_c, prompt_len, output_len, 32000, args.seed, sigma=1e-9)
        work = [(w[:prompt_len], output_len) for w, _ in work]
    else:
        model, label = common.model_for(args)
        prompt_len = args.prompt_len or 192
        output_len = args.output_len or 256
        budgets = args.budgets or ([120] if args.quick else [120, 240])
        extra = {}
        max_c = 24
        tok = common.tokenizer_for(model)
        work = common.workload("longbench", max_c, tok, prompt_len, output_len, args,
                               fixed_output=True)
        work = [(w[:prompt_len], output_len) for w, _ in work]
    total = prompt_len + output_len
    full_blocks = -(-total // bs)
    ideal_blocks = -(-int((1 - args.ratio) * total) // bs)
    variants = [("Native", dict(kv_eviction_policy="none"), full_blocks),
                ("Naive-Evict", dict(kv_eviction_policy="h2o", kv_eviction_ratio=args.ratio,
                                     kv_reclamation="none"), full_blocks)]
    for thr in args.frag_thresholds:
        variants.append((f"vToken (frag {thr:g})",
                         dict(kv_eviction_policy="h2o", kv_eviction_ratio=args.ratio,
                              kv_reclamation="vtoken", kv_frag_threshold=thr),
                         int(ideal_blocks / (1 - thr / 2))))
    rows, trials = [], {}
    for budget in budgets:
        row = {"budget": budget, "ideal": budget // ideal_blocks}
        for name, kw, per_req in variants:
            c, tr = frontier(model, name, kw, work, budget, budget // per_req, extra, print)
            row[name] = c
            trials[f"{budget}/{name}"] = tr
            at = [t for t in tr if t["c"] == c]
            if at:
                row[f"{name} blocks/req"] = at[0]["request_peak_blocks"]
                row[f"{name} tok/s"] = at[0]["tok_s"]
        rows.append(row)
    names = [v[0] for v in variants]
    title = (f"Capacity frontier (max feasible concurrency), H2O ratio {args.ratio}, block {bs}, "
             f"prompt {prompt_len} + output {output_len} tokens: full retention {full_blocks} "
             f"blocks/request, ideal packed {ideal_blocks}; {label}; {common.machine()}")
    text = common.table(rows, ["budget"] + names + ["ideal"], title)
    text += "\n" + common.table(rows, ["budget"] + [f"{n} blocks/req" for n in names],
                                "Peak blocks per request at each variant's frontier")
    if not args.simulate:
        text += "\n" + common.table(rows, ["budget"] + [f"{n} tok/s" for n in names],
                                    "Output tokens/s at each variant's frontier")
    pyplot = common.plt()
    fig, ax = pyplot.subplots(figsize=(6, 3.4))
    series = names + ["ideal"]
    width = 0.8 / len(series)
    for k, name in enumerate(series):
        ax.bar([i + (k - len(series) / 2 + 0.5) * width for i in range(len(rows))],
               [r[name] for r in rows], width, label=name)
    ax.set_xticks(range(len(rows)), [f"{r['budget']} blocks" + (
        f"\n(paper: {r['budget'] / scale:,.0f})" if args.simulate else "") for r in rows])
    ax.set_ylabel("max feasible concurrency")
    ax.set_title(f"Capacity frontier, H2O 0.5; {label}", fontsize=9)
    ax.legend(fontsize=7)
    name = args.out or ("benchmark_capacity_sim" if args.simulate else "benchmark_capacity")
    common.save(name, {"args": vars(args), "model": label, "rows": rows, "trials": trials,
                       "full_blocks": full_blocks, "ideal_blocks": ideal_blocks, "table": text},
                fig)


if __name__ == "__main__":
    main()
