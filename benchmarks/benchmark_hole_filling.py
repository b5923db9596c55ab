"""Zero-copy reclamation: Naive-Evict vs vToken vs vToken with hole filling, per policy.

vtoken-fill writes each new token into a dead slot of the request's own private blocks before the
tail grows, so one-in-one-out policies (H2O, StreamingLLM, TOVA) keep the packed footprint with
few or no copies. Same prompts, model, policy and ratio in every variant.

    python benchmarks/benchmark_hole_filling.py --quick      # default model, ~10 min on 2 cores
    python benchmarks/benchmark_hole_filling.py --model tiny # tiny random model, ~1 min
"""
import common

VARIANTS = (("none", "Naive-Evict"), ("vtoken", "vToken"), ("vtoken-fill", "vToken+fill"))


def main():
    args = common.reclamation_parser(
        __doc__, ["h2o", "streamingllm", "tova", "random", "scissorhands"]).parse_args()
    common.setup(args)
    model, label = common.model_for(args)
    tok = common.tokenizer_for(model)
    n = args.num_prompts or (4 if args.quick else 8)
    caps = {"sharegpt": (192, 96), "longbench": (384, 64)} if args.quick else \
        {"sharegpt": (512, 256), "longbench": (1536, 192)}
    rows = []
    for wl in args.workloads:
        work = common.workload(wl, n, tok, *caps[wl], args, fixed_output=wl == "longbench")
        for policy in args.policies:
            res = {v: common.run_variant(model, work, policy, v, args) for v, _ in VARIANTS}
            identical = res["none"]["tokens"] == res["vtoken"]["tokens"] == \
                res["vtoken-fill"]["tokens"]
            row = {"workload": wl, "policy": policy, "identical": identical}
            for v, name in VARIANTS:
                r = res[v]
                row.update({f"{name} blocks": r["mean_blocks"], f"{name} util": r["memory_utilization"],
                            f"{name} MB moved": r["bytes_moved"] / 1e6,
                            f"{name} relocs": r["relocation_events"]})
            row["ideal blocks"] = res["vtoken"]["ideal_blocks"]
            row["holes reused"] = res["vtoken-fill"]["hole_slots_reused"]
            rows.append(row)
    cols = ["workload", "policy"] + [f"{name} {k}" for _, name in VARIANTS
                                     for k in ("blocks", "util")] + \
        ["ideal blocks", "vToken MB moved", "vToken+fill MB moved", "vToken relocs",
         "vToken+fill relocs", "holes reused", "identical"]
    title = (f"Hole filling: retained blocks per request (mean over decode steps), memory "
             f"utilization (time average), bytes moved and relocation events; ratio {args.ratio}, "
             f"block {args.block_size}, {n} requests/workload; {label}; {common.machine()}")
    text = common.table(rows, cols, title)
    pyplot = common.plt()
    fig, axes = pyplot.subplots(1, 2, figsize=(10, 3.6))
    labels = [f"{r['workload'][:5]}\n{r['policy'][:8]}" for r in rows]
    x = list(range(len(rows)))
    for ax, key, ylabel in ((axes[0], "blocks", "blocks per request"),
                            (axes[1], "MB moved", "MB moved (all requests)")):
        for off, (_, name) in zip((-0.27, 0, 0.27), VARIANTS):
            ax.bar([i + off for i in x], [r[f"{name} {key}"] for r in rows], 0.27, label=name)
        ax.set_ylabel(ylabel)
        ax.set_xticks(x, labels, fontsize=7)
        ax.legend(fontsize=7)
    fig.suptitle(f"Naive-Evict vs vToken vs vToken+fill, ratio {args.ratio}; {label}", fontsize=9)
    common.save("benchmark_hole_filling", {"args": vars(args), "model": label, "rows": rows,
                                           "table": text}, fig)


if __name__ == "__main__":
    main()
