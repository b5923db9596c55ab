"""Sensitivity of vToken (H2O) to block size, eviction ratio and fragmentation threshold.

One factor at a time around the default (block 16, ratio 0.5, threshold 0.25), fixed concurrency.
Retained KV capacity = mean retained blocks per request x block size (token slots held),
normalised to the default; throughput and p95 decode-step latency likewise.

    python benchmarks/benchmark_sensitivity.py --quick      # LongBench-style and ShareGPT
    python benchmarks/benchmark_sensitivity.py --workloads longbench
"""
import common
from vllm import LLM

DEFAULT = {"block_size": 16, "kv_eviction_ratio": 0.5, "kv_frag_threshold": 0.25}
SWEEPS = {"block_size": [16, 32, 48], "kv_eviction_ratio": [0.3, 0.5, 0.7],
          "kv_frag_threshold": [0.1, 0.25, 0.5]}


def run(model, work, cfg, args):
    llm = LLM(model, kv_eviction_policy="h2o", kv_reclamation="vtoken", kv_min_tokens=0,
              max_num_seqs=len(work), seed=args.seed,
              num_gpu_blocks_override=common.roomy_blocks(work, cfg["block_size"]), **cfg)
    m = common.measure(llm, work)
    blocks = common.block_summary(m["outs"], cfg["block_size"])["mean_blocks"]
    return {"retained_slots": blocks * cfg["block_size"], "tok_s": m["tok_s"],
            "p95_ms": m["step_ms_p95"], "relocations": llm.get_kv_stats()["relocation_events"]}


def main():
    p = common.base_parser(__doc__)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--workloads", nargs="+", default=["longbench", "sharegpt"],
                   choices=["longbench", "sharegpt"])
    args = p.parse_args()
    common.setup(args)
    model, label = common.model_for(args)
    tok = common.tokenizer_for(model)
    wls = args.workloads
    # (prompt cap, output tokens); --quick: shorter outputs, so both workloads fit its budget
    caps = {"longbench": (384, 64), "sharegpt": (256, 96)} if args.quick else \
        {"longbench": (384, 96), "sharegpt": (256, 192)}
    rows = []
    for wl in wls:
        work = common.workload(wl, args.concurrency, tok, *caps[wl], args,
                               fixed_output=wl == "longbench")
        base = run(model, work, DEFAULT, args)
        for factor, values in SWEEPS.items():
            for v in values:
                cfg = {**DEFAULT, factor: v}
                r = base if cfg == DEFAULT else run(model, work, cfg, args)
                rows.append({"workload": wl, "factor": factor, "value": v, **r,
                             "capacity_norm": r["retained_slots"] / base["retained_slots"],
                             "tok_s_norm": r["tok_s"] / base["tok_s"],
                             "p95_norm": r["p95_ms"] / base["p95_ms"]})
    lengths = ", ".join(f"{w} {caps[w][0]} + {caps[w][1]}" for w in wls)
    title = (f"vToken + H2O sensitivity, C={args.concurrency}, normalised to block 16 / ratio "
             f"0.5 / threshold 0.25 per workload ({lengths} tokens); {label}; {common.machine()}")
    text = common.table(rows, ["workload", "factor", "value", "retained_slots", "capacity_norm",
                               "tok_s", "tok_s_norm", "p95_ms", "p95_norm", "relocations"], title)
    pyplot = common.plt()
    fig, axes = pyplot.subplots(1, 3, figsize=(11, 3.2))
    for ax, factor in zip(axes, SWEEPS):
        for wl in wls:
            sub = [r for r in rows if r["factor"] == factor and r["workload"] == wl]
            for key, style in (("capacity_norm", "o-"), ("tok_s_norm", "s--"),
                               ("p95_norm", "^:")):
                ax.plot([r["value"] for r in sub], [r[key] for r in sub], style,
                        label=f"{wl} {key.replace('_norm', '')}")
        ax.axhline(1.0, color="gray", lw=0.6)
        ax.set_xlabel(factor.replace("kv_", "--kv-").replace("_", "-"))
        ax.set_title(factor, fontsize=9)
    axes[0].set_ylabel("normalised to default")
    axes[-1].legend(fontsize=6)
    fig.suptitle(f"vToken + H2O sensitivity; {label}", fontsize=9)
    common.save("benchmark_sensitivity", {"args": vars(args), "model": label, "rows": rows,
                                          "caps": caps, "table": text}, fig)


if __name__ == "__main__":
    main()
