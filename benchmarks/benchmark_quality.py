"""Generation quality: paired greedy outputs Naive-Evict vs vToken (expected token-identical:
vToken only changes where KV bytes live), and ROUGE-L F1 of each policy's output against Native
(full KV), on the default model with ShareGPT prompts. The vToken runs check invariants I1 (each
relocated token's K/V bytes equal at the destination) and I2 (unique, owned slots) every step
(--kv-check-invariants); a violation fails the run.

    python benchmarks/benchmark_quality.py --quick
"""
import numpy as np

import common
from vllm import LLM


def lcs(a, b) -> int:
    """Longest common subsequence length, O(len(a) * len(b)) time, O(len(b)) memory."""
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 over lower-cased whitespace tokens."""
    c, r = candidate.lower().split(), reference.lower().split()
    if not c or not r:
        return float(c == r)
    m = lcs(c, r)
    if m == 0:
        return 0.0
    prec, rec = m / len(c), m / len(r)
    return 2 * prec * rec / (prec + rec)


def texts(model, work, args, **kw):
    """-> (each request's completion, the engine's KV statistics)."""
    llm = LLM(model, max_num_seqs=len(work), seed=args.seed,
              num_gpu_blocks_override=common.roomy_blocks(work), **kw)
    outs, _ = common.generate(llm, work)
    return [o.outputs[0] for o in outs], llm.get_kv_stats()


def main():
    p = common.base_parser(__doc__)
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--policies", nargs="+", default=list(common.POLICIES))
    p.add_argument("--ratio", type=float, default=0.5)
    args = p.parse_args()
    common.setup(args)
    model, label = common.model_for(args)
    tok = common.tokenizer_for(model)
    n = args.num_prompts or (8 if args.quick else 24)
    work = common.workload("sharegpt", n, tok, 256, 96 if args.quick else 160, args,
                           fixed_output=True)
    native, _ = texts(model, work, args)
    rows = []
    for policy in args.policies:
        kw = dict(kv_eviction_policy=policy, kv_eviction_ratio=args.ratio, kv_min_tokens=0)
        naive, _ = texts(model, work, args, kv_reclamation="none", **kw)
        vt, kv = texts(model, work, args, kv_reclamation="vtoken", kv_check_invariants=True, **kw)
        r_naive = [rouge_l(a.text, b.text) for a, b in zip(naive, native)]
        r_vt = [rouge_l(a.text, b.text) for a, b in zip(vt, native)]
        diff = np.array(r_vt) - np.array(r_naive)
        rows.append({"policy": policy,
                     "identical_pairs": f"{sum(a.token_ids == b.token_ids for a, b in zip(naive, vt))}/{n}",
                     "rougeL_naive_vs_native": float(np.mean(r_naive)),
                     "rougeL_vtoken_vs_native": float(np.mean(r_vt)),
                     "mean_paired_diff": float(diff.mean()),
                     "pairs_within_0.01": float(np.mean(np.abs(diff) <= 0.01)),
                     "relocation_events": kv["relocation_events"],
                     "relocated_tokens": kv["relocated_tokens"],
                     "len_ratio_median": float(np.median([len(a.token_ids) / max(len(b.token_ids), 1)
                                                          for a, b in zip(vt, naive)]))})
    title = (f"Quality on ShareGPT ({n} prompts, greedy, eviction ratio {args.ratio}): Naive-Evict "
             f"vs vToken pairs, ROUGE-L F1 vs Native; vToken runs with I1/I2 checked every step "
             f"(relocation events: all passed); {label}; {common.machine()}")
    text = common.table(rows, ["policy", "identical_pairs", "rougeL_naive_vs_native",
                               "rougeL_vtoken_vs_native", "mean_paired_diff",
                               "pairs_within_0.01", "relocation_events"], title)
    pyplot = common.plt()
    fig, ax = pyplot.subplots(figsize=(5.5, 3.2))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["rougeL_naive_vs_native"] for r in rows], 0.4, label="Naive-Evict")
    ax.bar(x + 0.2, [r["rougeL_vtoken_vs_native"] for r in rows], 0.4, label="vToken")
    ax.set_xticks(x, [r["policy"] for r in rows])
    ax.set_ylim(0, 1)
    ax.set_ylabel("ROUGE-L F1 vs Native")
    ax.set_title(f"Greedy outputs under eviction (ratio {args.ratio}); {label}", fontsize=8)
    ax.legend(fontsize=7)
    common.save("benchmark_quality", {"args": vars(args), "model": label, "rows": rows,
                                      "table": text}, fig)


if __name__ == "__main__":
    main()
