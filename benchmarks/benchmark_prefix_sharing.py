"""Prefix sharing: shared prefix + private suffix, sharing degree 1/2/4/8, prefix caching on.

Requests come in groups of `degree` that share one prefix (a group's prefix is cached by a warm-up
request first, so every member hits it; degree 1 has no reuse). By default the paper's policy,
H2O, under --kv-evict-scope generated, where the prompt is never evicted or scored, so every
policy takes every prefix-cache hit on it (docs/eviction-policies.md), with a fixed budget of a
quarter of the output in generated tokens. Under scope all (--kv-evict-scope all) the budget is prefix +
suffix/8 tokens of the whole request, and the policy must be one whose prompt scores do not need
the cached prefix's queries (TOVA scores with the last prompt query; H2O with every one, so H2O
takes no hits there). Blocks that are shared (ref count > 1, or prefix-cache hits) are never
relocated: the planner only sees private blocks, and cached ones only give tokens away. The
output is long, so one-in-one-out decode evictions leave holes in the private blocks (the output's
under scope generated, the suffix's too under all), which vToken repacks. Invariant checks
(--kv-check-invariants: I1 per relocation, I2 and block accounting every step) are on for both
variants.

    python benchmarks/benchmark_prefix_sharing.py --quick
    python benchmarks/benchmark_prefix_sharing.py --policy tova --kv-evict-scope all
"""
import numpy as np

import common
import vllm.core.reclaim.backend as backend_mod
from vllm import LLM

_orig_candidates = backend_mod.candidate_blocks
_orig_plan = backend_mod.plan


def instrument(llm, counters):
    """Count shared blocks kept out of plans; assert no plan ever touches one."""
    bm = llm.llm_engine.kv.bm

    def candidates(req, bm_, busy):      # req: the sequence's KV state (RequestKV)
        blocks = np.asarray(req.block_ids, np.int64)
        shared = blocks[bm_.shared_mask(req, blocks)].tolist()
        counters["skipped"].update((req.seq_id, b) for b in shared)
        counters["shared_now"] = set(shared)
        return _orig_candidates(req, bm_, busy)

    def plan(snap):
        touched = set(snap.blocks.tolist()) & counters["shared_now"]
        assert not touched, f"plan for {snap.seq_id} touches shared blocks {sorted(touched)}"
        p = _orig_plan(snap)
        counters["plans"] += p is not None
        return p
    backend_mod.candidate_blocks, backend_mod.plan = candidates, plan
    return bm


def build(tok, n, degree, prefix_len, suffix_len, out_len, seed):
    rng = np.random.default_rng(seed)
    try:
        corpus = tok.encode("\n\n".join(common._essays()), add_special_tokens=False)
    except FileNotFoundError as e:
        print(f"{e}; using random token ids instead")
        corpus = rng.integers(10, len(tok), 1 << 16).tolist()
    def cut(k):
        s = int(rng.integers(0, len(corpus) - k))
        return corpus[s:s + k]
    prefixes = [cut(prefix_len) for _ in range(n // degree)]
    work = [(prefixes[i // degree] + cut(suffix_len), out_len) for i in range(n)]
    return prefixes, work


def run(model, prefixes, work, reclamation, warm, budget, args):
    cached = sum(map(len, prefixes))       # the prefixes' blocks stay cached beside the work
    llm = LLM(model, kv_eviction_policy=args.policy, kv_budget_tokens=budget, kv_min_tokens=0,
              kv_reclamation=reclamation, kv_evict_scope=args.kv_evict_scope,
              enable_prefix_caching=True, kv_check_invariants=True, max_num_seqs=len(work),
              num_gpu_blocks_override=common.roomy_blocks(work, extra_tokens=cached),
              seed=args.seed)
    counters = {"skipped": set(), "plans": 0, "shared_now": set()}
    instrument(llm, counters)
    if warm:    # cache each group's prefix (its blocks stay cached after the warm-up finishes)
        common.generate(llm, [(p, 1) for p in prefixes])
    try:
        m = common.measure(llm, work)
        ok = "pass"
    except AssertionError as e:
        m, ok = None, f"FAIL: {e}"
    finally:
        backend_mod.candidate_blocks, backend_mod.plan = _orig_candidates, _orig_plan
    kv = llm.get_kv_stats()
    return {"invariants": ok, "pool_blocks_mean": m and m["pool_blocks_mean"],
            "pool_blocks_peak": m and m["pool_blocks_peak"],
            "shared_skipped": len(counters["skipped"]), "plans": counters["plans"],
            "relocations": kv["relocation_events"], "hit_blocks": kv["prefix_cache_hit_blocks"],
            "outs": m and m["outs"]}


def main():
    p = common.base_parser(__doc__)
    p.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--policy", default="h2o")
    p.add_argument("--kv-evict-scope", default="generated", choices=["generated", "all"],
                   help="generated: the prompt is kept and takes every cache hit (any policy); "
                        "all: use a policy that can share prefixes, e.g. tova")
    p.add_argument("--budget", type=int, default=None,
                   help="kv_budget_tokens (default: scope generated output/4; all prefix + "
                        "suffix/8)")
    args = p.parse_args()
    common.setup(args)
    model, label = common.model_for(args)
    tok = common.tokenizer_for(model)
    prefix_len, suffix_len, out_len = (128, 128, 192) if args.quick else (384, 384, 384)
    budget = args.budget or (out_len // 4 if args.kv_evict_scope == "generated" else
                             prefix_len + suffix_len // 8)
    rows = []
    for d in args.degrees:
        prefixes, work = build(tok, args.num_requests, d, prefix_len, suffix_len, out_len,
                               args.seed)
        naive = run(model, prefixes, work, "none", d > 1, budget, args)
        vt = run(model, prefixes, work, "vtoken", d > 1, budget, args)
        same = naive["outs"] is not None and vt["outs"] is not None and all(
            a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(naive["outs"], vt["outs"]))
        rows.append({"degree": d, "naive_blocks": naive["pool_blocks_mean"],
                     "vtoken_blocks": vt["pool_blocks_mean"],
                     "reduction_%": 100 * (1 - vt["pool_blocks_mean"] / naive["pool_blocks_mean"]),
                     "naive_peak": naive["pool_blocks_peak"], "vtoken_peak": vt["pool_blocks_peak"],
                     "shared_skipped": vt["shared_skipped"], "plans": vt["plans"],
                     "relocations": vt["relocations"], "hit_blocks": vt["hit_blocks"],
                     "invariants": f"{naive['invariants']}/{vt['invariants']}",
                     "identical_outputs": same})
    kept = "generated " if args.kv_evict_scope == "generated" else ""
    title = (f"Prefix sharing (prefix caching on, {args.policy}, scope {args.kv_evict_scope}, "
             f"budget {budget} {kept}tokens), {args.num_requests} requests of "
             f"{prefix_len} shared + {suffix_len} private tokens + {out_len} output; pool blocks "
             f"in use (time average); {label}; {common.machine()}")
    text = common.table(rows, ["degree", "naive_blocks", "vtoken_blocks", "reduction_%",
                               "naive_peak", "vtoken_peak", "hit_blocks", "shared_skipped", "relocations",
                               "invariants", "identical_outputs"], title)
    pyplot = common.plt()
    fig, ax = pyplot.subplots(figsize=(5.5, 3.3))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["naive_blocks"] for r in rows], 0.4, label="Naive-Evict + prefix cache")
    ax.bar(x + 0.2, [r["vtoken_blocks"] for r in rows], 0.4, label="vToken + prefix cache")
    for i, r in enumerate(rows):
        ax.text(i + 0.2, r["vtoken_blocks"], f"-{r['reduction_%']:.0f}%", ha="center",
                va="bottom", fontsize=7)
    ax.set_xticks(x, [f"degree {r['degree']}" for r in rows])
    ax.set_ylabel("KV blocks in use (time avg)")
    ax.set_title(f"Shared prefix + private suffix, {args.policy}, scope {args.kv_evict_scope}; "
                 f"{label}", fontsize=9)
    ax.legend(fontsize=7)
    common.save("benchmark_prefix_sharing", {"args": vars(args), "model": label, "budget": budget,
                                             "rows": rows, "table": text}, fig)


if __name__ == "__main__":
    main()
