"""Memory utilization and retained blocks per request: Naive-Evict vs vToken, per policy.

Same prompts, model, policy and eviction ratio; the only difference is --kv-reclamation. Retained
blocks per request = its mean block count over its decode steps; ideal = ceil(live / block_size)
at finish. Memory utilization = live tokens / (used blocks * block size), averaged over steps.

    python benchmarks/benchmark_reclamation.py --quick     # default model, 6 short requests, ~8 min
    python benchmarks/benchmark_reclamation.py             # 8 requests, longer inputs
    python benchmarks/benchmark_reclamation.py --model tiny   # tiny random model: fast, but its
                                   # flat attention makes H2O/Scissorhands evict contiguous runs
"""
import common


def main():
    args = common.reclamation_parser(__doc__, common.POLICIES).parse_args()
    common.setup(args)
    model, label = common.model_for(args)
    tok = common.tokenizer_for(model)
    n = args.num_prompts or (6 if args.quick else 8)
    caps = {"sharegpt": (192, 128), "longbench": (384, 96)} if args.quick else \
        {"sharegpt": (512, 384), "longbench": (1536, 256)}
    rows = []
    for wl in args.workloads:
        work = common.workload(wl, n, tok, *caps[wl], args, fixed_output=wl == "longbench")
        for policy in args.policies:
            res = {v: common.run_variant(model, work, policy, v, args) for v in ("none", "vtoken")}
            naive, vt = res["none"], res["vtoken"]
            rows.append({
                "workload": wl, "policy": policy,
                "naive_blocks": naive["mean_blocks"], "vtoken_blocks": vt["mean_blocks"],
                "naive_final": naive["blocks_at_finish"], "vtoken_final": vt["blocks_at_finish"],
                "ideal_final": vt["ideal_blocks"],
                "block_reduction_%": 100 * (1 - vt["mean_blocks"] / naive["mean_blocks"]),
                "naive_util": naive["memory_utilization"], "vtoken_util": vt["memory_utilization"],
                "util_gain_pp": 100 * (vt["memory_utilization"] - naive["memory_utilization"]),
                "naive_peak": naive["peak_blocks"], "vtoken_peak": vt["peak_blocks"],
                "relocations": vt["relocation_events"],
                "detail": {v: {k: x for k, x in r.items() if k != "tokens"} for v, r in res.items()}})
    cols = ["workload", "policy", "naive_blocks", "vtoken_blocks", "block_reduction_%",
            "naive_final", "vtoken_final", "ideal_final", "naive_util", "vtoken_util",
            "util_gain_pp"]
    title = (f"Retained blocks per request (mean over its decode steps; final = at finish, ideal = "
             f"ceil(live/block) at finish) and memory utilization (time average), eviction "
             f"ratio {args.ratio}, block {args.block_size}, {n} requests/workload; {label}; "
             f"{common.machine()}")
    text = common.table(rows, cols, title)
    pyplot = common.plt()
    fig, axes = pyplot.subplots(1, 2, figsize=(10, 3.6))
    labels = [f"{r['workload'][:5]}\n{r['policy'][:8]}" for r in rows]
    x = list(range(len(rows)))
    ax = axes[0]
    for off, key, name in ((-0.27, "naive_final", "Naive-Evict"), (0, "vtoken_final", "vToken"),
                           (0.27, "ideal_final", "ideal packed")):
        ax.bar([i + off for i in x], [r[key] for r in rows], 0.27, label=name)
    ax.set_ylabel("blocks per request")
    ax.set_title("Blocks per request at finish", fontsize=9)
    ax.set_xticks(x, labels, fontsize=7)
    ax.legend(fontsize=7)
    ax = axes[1]
    ax.bar([i - 0.2 for i in x], [r["naive_util"] for r in rows], 0.4, label="Naive-Evict")
    ax.bar([i + 0.2 for i in x], [r["vtoken_util"] for r in rows], 0.4, label="vToken")
    ax.set_ylim(0, 1)
    ax.set_ylabel("live tokens / allocated slots")
    ax.set_title("Memory utilization (time average)", fontsize=9)
    ax.set_xticks(x, labels, fontsize=7)
    ax.legend(fontsize=7)
    fig.suptitle(f"Naive-Evict vs vToken, ratio {args.ratio}; {label}", fontsize=9)
    common.save("benchmark_reclamation", {"args": vars(args), "model": label, "rows": rows,
                                          "table": text}, fig)


if __name__ == "__main__":
    main()
