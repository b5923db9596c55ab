"""Token sampler: grammar (structured outputs) and min_tokens masking, raw logprobs,
allowed_token_ids, logit bias and repetition / presence / frequency penalties, greedy / random
sampling with temperature, top-k, top-p and min-p, and per-request seeded generators.

All per-row parameters are turned into tensors and applied as batched ops; the
only per-row Python loops that touch tensors draw the random noise of
rows that own a seeded ``torch.Generator`` (so that such a row consumes exactly
the same random numbers whether it runs alone or inside any batch) and have each
grammar row's matcher fill its row of the shared bitmask (one batched apply follows).

On CUDA the only host sync is reading the sampled tokens (`_read_tokens`; logprobs, when
asked for, are read after it): parameters go up with non-blocking copies from pinned memory,
and top-p sorts the whole vocabulary instead of retrying with more candidates.
"""
from dataclasses import dataclass
from typing import TYPE_CHECKING, Collection, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from vllm.kernels.ops import argmax_rows, to_device
from vllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vllm.structured_output import GrammarBitmask, SequenceGrammar

_NEG_INF = float("-inf")


@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None          # 1-based rank in the full distribution
    decoded_token: Optional[str] = None  # filled later by the engine


@dataclass
class SamplingRow:                        # one per logits row
    params: SamplingParams
    generator: Optional[torch.Generator]  # per-request seeded generator (None -> torch default RNG)
    num_generated: int                    # output tokens produced so far (for min_tokens)
    eos_token_id: Optional[int]
    token_ids: Sequence[int] = ()         # prompt + output so far (read only for penalties)
    grammar: Optional["SequenceGrammar"] = None   # structured outputs: the tokens allowed next
    eos_token_ids: Collection[int] = ()   # the model's other EOS ids (min_tokens masks them too)


@dataclass
class SamplerOutput:
    token_ids: List[int]                               # one sampled token per row
    logprobs: List[Optional[Dict[int, Logprob]]]       # per row when params.logprobs is not None:
                                                       # sampled token + top-`logprobs` tokens


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #
def _tensor(values, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=dtype), device)


def _index(idx: List[int], device: torch.device) -> torch.Tensor:
    # Row subsets are taken with x[idx]: on CPU, Tensor.index_select(0, ...) on wide
    # rows is pathologically slow with more than one thread.
    return _tensor(idx, device, torch.long)


def _read_tokens(sampled: torch.Tensor) -> List[int]:
    """The sampled token ids on the host: on CUDA the step's one host sync."""
    return sampled.tolist()


def _apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Mask every EOS id (eos_token_id and eos_token_ids) and stop_token_ids to -inf for rows
    that have not yet produced min_tokens tokens. Returns a (possibly new) tensor; the input is
    not modified."""
    vocab = logits.shape[-1]
    r_idx: List[int] = []
    t_idx: List[int] = []
    for i, row in enumerate(rows):
        p = row.params
        if row.num_generated >= p.min_tokens:
            continue
        toks = set(p.stop_token_ids or ()) | set(row.eos_token_ids)
        if row.eos_token_id is not None:
            toks.add(row.eos_token_id)
        for t in toks:
            if 0 <= t < vocab:
                r_idx.append(i)
                t_idx.append(t)
    if not r_idx:
        return logits
    logits = logits.clone()
    logits[_index(r_idx, logits.device), _index(t_idx, logits.device)] = _NEG_INF
    return logits


def _apply_allowed_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow],
                          idx: List[int]) -> torch.Tensor:
    """-inf on every token outside allowed_token_ids, for the rows idx that set it (one batched
    fill). Returns a new tensor; the input is not modified."""
    idx = [i for i in idx if rows[i].params.allowed_token_ids is not None]
    if not idx:
        return logits
    dev = logits.device
    allowed = [torch.as_tensor(rows[i].params.allowed_token_ids, dtype=torch.long) for i in idx]
    # row j's ids -> (j, id) pairs: [[4, 9], [7]] -> rows [0, 0, 1], tokens [4, 9, 7]
    pair_rows = torch.repeat_interleave(torch.arange(len(idx)),
                                        torch.tensor([len(a) for a in allowed]))
    keep = torch.zeros((len(idx), logits.shape[1]), dtype=torch.bool)
    keep[pair_rows, torch.cat(allowed)] = True
    idx_t = _index(idx, dev)
    sub = logits[idx_t].masked_fill_(~to_device(keep, dev), _NEG_INF)
    return logits.index_copy(0, idx_t, sub)


def _count_tokens(seqs: Sequence[Sequence[int]], vocab: int, device: torch.device,
                  dtype: torch.dtype) -> torch.Tensor:
    """[len(seqs), vocab] occurrences of each token in each row's ids, counted on `device`.

    Only the ids travel (one flat int32 list and the row lengths); the count table is made on
    the device by one scatter-add: [[5, 5], [2]] -> flat bins [5, 5, vocab + 2] -> counts[0, 5]
    = 2, counts[1, 2] = 1. Ids outside [0, vocab) count as the nearest end (as before). Counts
    are whole numbers in `dtype` (exact below 2**24 in float32), so the order of the adds does
    not matter."""
    n = len(seqs)
    lens = [len(s) for s in seqs]
    total = sum(lens)
    counts = torch.zeros(n * vocab, dtype=dtype, device=device)
    if total:
        flat = np.concatenate([np.asarray(s, dtype=np.int64).reshape(-1) for s in seqs if len(s)])
        ids = to_device(torch.from_numpy(np.clip(flat, 0, vocab - 1).astype(np.int32)), device)
        row = torch.repeat_interleave(torch.arange(n, device=device),
                                      _tensor(lens, device, torch.long), output_size=total)
        counts.scatter_add_(0, row * vocab + ids.long(),
                            torch.ones(total, dtype=dtype, device=device))
    return counts.view(n, vocab)


def _adjust_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Logit bias, then upstream vLLM's penalties, for the rows that ask for them:

        repetition  x / r where x > 0, x * r where x <= 0, on tokens seen in prompt or output
        frequency   x - f * (count of the token in the output)
        presence    x - p * (token occurs in the output)

    Token counts are made on the logits' device from the rows' ids (_count_tokens).
    Returns a new tensor when any row is adjusted; the input is not modified."""
    idx = [i for i, r in enumerate(rows) if r.params.adjusts_logits]
    if not idx:
        return logits
    vocab, dev = logits.shape[1], logits.device
    sub = logits[_index(idx, dev)]
    bias_rows, bias_toks, bias_vals = [], [], []
    for j, i in enumerate(idx):
        for tok, val in (rows[i].params.logit_bias or {}).items():
            if tok < vocab:
                bias_rows.append(j), bias_toks.append(tok), bias_vals.append(val)
    if bias_rows:
        sub[_index(bias_rows, dev), _index(bias_toks, dev)] += _tensor(bias_vals, dev)

    params = [rows[i].params for i in idx]
    # counts are made on the logits' device from the rows' token ids (a per-vocabulary count
    # table built on the host would upload rows x vocab numbers every step); a factor of 1 or
    # a penalty of 0 leaves a logit bit-identical, so a batch without one skips its counts
    if any(p.repetition_penalty != 1.0 for p in params):
        rep = _tensor([p.repetition_penalty for p in params], dev).unsqueeze(1)
        seen = _count_tokens([rows[i].token_ids for i in idx], vocab, dev, sub.dtype) > 0
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    if any(p.frequency_penalty or p.presence_penalty for p in params):
        generated = []
        for i in idx:
            toks, k = rows[i].token_ids, rows[i].num_generated
            generated.append(toks[len(toks) - k:] if k else ())
        out_counts = _count_tokens(generated, vocab, dev, sub.dtype)
        freq = _tensor([p.frequency_penalty for p in params], dev).unsqueeze(1)
        pres = _tensor([p.presence_penalty for p in params], dev).unsqueeze(1)
        sub = sub - freq * out_counts - pres * (out_counts > 0).to(sub.dtype)
    logits = logits.clone()
    logits[_index(idx, dev)] = sub
    return logits


def _logprob_dicts(logprobs: torch.Tensor, token_ids: torch.Tensor,
                   ks: Sequence[int]) -> List[Dict[int, Logprob]]:
    """logprobs [N, V] (log_softmax), token_ids [N]; per row a dict with the
    given token (logprob + rank) and that row's top-ks[i] tokens.

    rank = 1 + number of tokens with a strictly greater logprob."""
    n, vocab = logprobs.shape
    if n == 0:
        return []
    token_ids = token_ids.to(device=logprobs.device, dtype=torch.long)
    tok_lp = logprobs.gather(1, token_ids.unsqueeze(1))            # [N, 1]

    # Top-K with K >= 1 (and a few extra so that the token's rank can usually be
    # read off the top-K instead of a full-vocabulary comparison).
    max_k = min(max(ks), vocab)
    kk = min(max(max_k, 8), vocab)
    top_vals, top_ids = torch.topk(logprobs, kk, dim=1)            # sorted, descending
    # Every value strictly greater than a top-K value is itself in the top-K,
    # so full-distribution ranks of top-K entries can be computed within the top-K.
    top_rank = (top_vals.unsqueeze(1) > top_vals.unsqueeze(2)).sum(dim=2) + 1
    # Same argument for the token when its logprob is >= the K-th largest value.
    tok_rank = (top_vals > tok_lp).sum(dim=1) + 1
    outside = (tok_lp.squeeze(1) < top_vals[:, -1]).nonzero().squeeze(1)
    if outside.numel():
        lp_out = logprobs[outside]
        cnt = (lp_out > tok_lp[outside]).sum(dim=1, dtype=torch.int32)
        tok_rank.index_copy_(0, outside, cnt.to(tok_rank.dtype) + 1)

    top_vals_l = top_vals[:, :max_k].tolist()
    top_ids_l = top_ids[:, :max_k].tolist()
    top_rank_l = top_rank[:, :max_k].tolist()
    tok_lp_l = tok_lp.squeeze(1).tolist()
    tok_rank_l = tok_rank.tolist()
    tok_l = token_ids.tolist()

    out: List[Dict[int, Logprob]] = []
    for i in range(n):
        d = {tok_l[i]: Logprob(tok_lp_l[i], tok_rank_l[i])}
        k = min(ks[i], vocab)
        if k > 0:
            vals, ids, rks = top_vals_l[i], top_ids_l[i], top_rank_l[i]
            for j in range(k):
                if ids[j] not in d:
                    d[ids[j]] = Logprob(vals[j], rks[j])
        out.append(d)
    return out


def compute_prompt_logprobs(logits: torch.Tensor, next_token_ids: List[int],
                            k: int) -> List[Dict[int, Logprob]]:
    """logits[i] predicts next_token_ids[i]; each dict holds that token's logprob (+rank) and the top-k."""
    n = logits.shape[0]
    if n == 0:
        return []
    if len(next_token_ids) != n:
        raise ValueError(f"got {n} logits rows but {len(next_token_ids)} next tokens")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.as_tensor(next_token_ids, dtype=torch.long, device=logits.device)
    return _logprob_dicts(logprobs, ids, [k] * n)


# Candidate set size for top-p without top-k: a partial top-K is much cheaper
# than a full-vocabulary sort; rows whose nucleus is not inside it fall back to
# a full sort.
_TOP_P_CANDIDATES = 256


def _top_p_threshold(s_probs: torch.Tensor, p: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """s_probs [R, K]: normalized probs sorted descending (the K largest of
    each row); p [R, 1]. The nucleus is the smallest prefix whose cumulative
    prob >= p (at least one token). Returns (thresh [R, 1], covered [R]):
    tokens with prob < thresh are outside the nucleus; covered says whether the
    nucleus ends inside the K candidates (otherwise thresh is meaningless)."""
    cum = torch.cumsum(s_probs, dim=1)
    # position j is kept iff the mass strictly before it is < p; always keep j=0
    n_keep = ((cum - s_probs) < p).sum(dim=1, keepdim=True).clamp_(min=1)
    thresh = s_probs.gather(1, n_keep - 1)
    covered = cum[:, -1:] >= p
    return thresh, covered.squeeze(1)


def _apply_top_p(probs: torch.Tensor, p: torch.Tensor, cand: int) -> None:
    """In-place top-p on normalized probs [R, V]: zero the tokens outside the nucleus.

    The nucleus is searched among each row's `cand` largest probs (partial
    top-k, much cheaper than a sort); rows whose nucleus reaches further retry
    with 16x the candidates, and finally with a full sort."""
    vocab = probs.shape[1]
    thresh = torch.empty((probs.shape[0], 1), dtype=probs.dtype, device=probs.device)
    todo: Optional[torch.Tensor] = None           # None = all rows
    while True:
        sub = probs if todo is None else probs[todo]
        sub_p = p if todo is None else p[todo]
        if cand < vocab:
            s_probs = torch.topk(sub, cand, dim=1).values
        else:
            s_probs = torch.sort(sub, dim=1, descending=True).values
        t, covered = _top_p_threshold(s_probs, sub_p)
        if todo is None:
            thresh.copy_(t)
        else:
            thresh.index_copy_(0, todo, t)
        if cand >= vocab:
            break
        left = (~covered).nonzero().squeeze(1)
        if left.numel() == 0:
            break
        todo = left if todo is None else todo[left]
        cand *= 16
    probs.masked_fill_(probs < thresh, 0.0)


def _apply_top_k(x: torch.Tensor, top_k: List[int]) -> None:
    """In-place top-k on logits x [R, V]: -inf below each row's k-th largest
    value (ties with the k-th value are kept). top_k[i] <= 0 or >= V: off."""
    n, vocab = x.shape
    kr = [i for i in range(n) if 0 < top_k[i] < vocab]
    if not kr:
        return
    all_rows = len(kr) == n
    kr_t = None if all_rows else _index(kr, x.device)
    xs = x if all_rows else x[kr_t]
    vals = torch.topk(xs, max(top_k[i] for i in kr), dim=1).values   # descending
    thresh = vals.gather(1, _index([top_k[i] - 1 for i in kr], x.device).unsqueeze(1))
    xs.masked_fill_(xs < thresh, _NEG_INF)
    if not all_rows:
        x.index_copy_(0, kr_t, xs)


def _random_probs(x: torch.Tensor, params: List[SamplingParams]) -> torch.Tensor:
    """x [R, V]: temperature-scaled logits (owned, modified in place).
    Applies top-k, top-p, min-p and returns (possibly unnormalized) probs with
    excluded tokens at exactly 0."""
    n, vocab = x.shape
    dev = x.device
    top_k = [p.top_k for p in params]
    _apply_top_k(x, top_k)
    probs = torch.softmax(x, dim=1)

    pr = [i for i in range(n) if params[i].top_p < 1.0]
    if pr:
        all_rows = len(pr) == n
        pr_t = None if all_rows else _index(pr, dev)
        ps = probs if all_rows else probs[pr_t]
        ks = [top_k[i] for i in pr if 0 < top_k[i] < vocab]
        # rows restricted to top-k only need their k largest probs as candidates
        cand = max(ks) if len(ks) == len(pr) else max([_TOP_P_CANDIDATES] + ks)
        if dev.type != "cpu":      # retrying with more candidates reads a count: a host sync
            cand = vocab
        p_t = _tensor([params[i].top_p for i in pr], dev, probs.dtype).unsqueeze(1)
        _apply_top_p(ps, p_t, min(cand, vocab))
        if not all_rows:
            probs.index_copy_(0, pr_t, ps)

    # min-p: drop tokens whose prob < min_p * max prob (renormalization-invariant)
    if any(p.min_p > 0.0 for p in params):
        mp = _tensor([p.min_p for p in params], dev, probs.dtype).unsqueeze(1)
        probs.masked_fill_(probs < mp * probs.amax(dim=1, keepdim=True), 0.0)
    return probs


def _draw(probs: torch.Tensor, gens: List[Optional[torch.Generator]]) -> torch.Tensor:
    """Sample one token per row of probs [R, V] (nonnegative, need not be
    normalized) via the exponential race argmax(probs / q), q ~ Exp(1) drawn as
    -log(u), u ~ U[0, 1). Rows with a generator draw only from it (exactly V
    uniforms per step), so they are batch-invariant. Modifies probs."""
    u = torch.empty_like(probs)
    seeded = [i for i, g in enumerate(gens) if g is not None]
    if not seeded:
        u.uniform_()
    else:
        for i in seeded:
            u[i].uniform_(generator=gens[i])
        if len(seeded) != len(gens):
            unseeded = _index([i for i, g in enumerate(gens) if g is None], probs.device)
            u.index_copy_(0, unseeded,
                          torch.empty((unseeded.numel(), probs.shape[1]),
                                      dtype=probs.dtype, device=probs.device).uniform_())
    # u in [tiny, 1) -> log(u) in [-88, 0): finite and < 0, so no NaN/inf below.
    # argmax(probs / -log u) == argmin(probs / log u); excluded tokens score 0.
    log_u = u.clamp_min_(torch.finfo(u.dtype).tiny).log_()
    return probs.div_(log_u).min(dim=1).indices


# --------------------------------------------------------------------------- #
# Sampler
# --------------------------------------------------------------------------- #
class Sampler:
    """Samples one token per logits row according to that row's SamplingParams.

    Rows with a grammar are masked in place in `logits` (the caller's logits are scratch)."""

    def __init__(self):
        self.bitmask: Optional["GrammarBitmask"] = None   # allocated at the first grammar row

    def __call__(self, logits: torch.Tensor, rows: List[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2:
            raise ValueError(f"logits must be 2-D [B, V], got shape {tuple(logits.shape)}")
        b = logits.shape[0]
        if b != len(rows):
            raise ValueError(f"got {b} logits rows but {len(rows)} sampling rows")
        if b == 0:
            return SamplerOutput(token_ids=[], logprobs=[])
        if logits.dtype != torch.float32:
            logits = logits.float()
        dev = logits.device

        # one flag scan: without grammar / allowed_token_ids rows no masking code runs
        masked = [i for i, r in enumerate(rows)
                  if r.grammar is not None or r.params.allowed_token_ids is not None]
        if masked:
            self._apply_grammars(logits, rows, masked)

        # (1) min_tokens; logprobs are taken here, before allowed_token_ids, bias and penalties
        # (upstream's raw logprobs: its runner applies the grammar bitmask before its sampler,
        # which then reads raw logprobs before allowed_token_ids and penalties)
        raw = logits = _apply_min_tokens(logits, rows)
        if masked:
            logits = _apply_allowed_tokens(logits, rows, masked)
        logits = _adjust_logits(logits, rows)

        greedy = [r.params.greedy for r in rows]
        want_lp = [r.params.logprobs is not None for r in rows]

        # fast path: all greedy, no logprobs
        if all(greedy) and not any(want_lp):
            return SamplerOutput(token_ids=_read_tokens(argmax_rows(logits)), logprobs=[None] * b)

        # (3)/(4) sampling
        rand = [i for i in range(b) if not greedy[i]]
        if not rand:
            sampled = argmax_rows(logits)
        else:
            all_rand = len(rand) == b
            rand_t = None if all_rand else _index(rand, dev)
            x = logits if all_rand else logits[rand_t]
            temps = _tensor([rows[i].params.temperature for i in rand], dev,
                            torch.float32).unsqueeze(1)
            x = x / temps                                          # new tensor; logits untouched
            probs = _random_probs(x, [rows[i].params for i in rand])
            rand_tok = _draw(probs, [rows[i].generator for i in rand])
            if all_rand:
                sampled = rand_tok
            else:
                sampled = argmax_rows(logits)  # greedy rows; random rows overwritten below
                sampled.index_copy_(0, rand_t, rand_tok)

        token_ids = _read_tokens(sampled)

        # (2) raw logprobs (after min_tokens, before temperature / top-k / top-p / min-p)
        out_lp: List[Optional[Dict[int, Logprob]]] = [None] * b
        lp_rows = [i for i in range(b) if want_lp[i]]
        if lp_rows:
            if len(lp_rows) == b:
                lp_logits, lp_tok = raw, sampled
            else:
                lp_t = _index(lp_rows, dev)
                lp_logits, lp_tok = raw[lp_t], sampled[lp_t]
            lps = torch.log_softmax(lp_logits, dim=1)
            dicts = _logprob_dicts(lps, lp_tok, [rows[i].params.logprobs for i in lp_rows])
            for i, d in zip(lp_rows, dicts):
                out_lp[i] = d
        return SamplerOutput(token_ids=token_ids, logprobs=out_lp)

    def _apply_grammars(self, logits: torch.Tensor, rows: List[SamplingRow],
                        idx: List[int]) -> None:
        idx = [i for i in idx if rows[i].grammar is not None]
        if not idx:
            return
        if self.bitmask is None:
            from vllm.structured_output import GrammarBitmask
            self.bitmask = GrammarBitmask()
        self.bitmask.apply(logits, idx, [rows[i].grammar for i in idx])


__all__ = ["Logprob", "SamplingRow", "SamplerOutput", "Sampler", "compute_prompt_logprobs"]
