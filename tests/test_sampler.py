"""Sampler: greedy, min_tokens, top-k / top-p / min-p, seeded batch invariance,
logprobs and prompt logprobs, temperature distribution."""

import pytest
import torch

from vllm.model_executor.sampler import (Logprob, Sampler, SamplerOutput, SamplingRow,
                                         _apply_top_p, compute_prompt_logprobs)
from vllm.sampling_params import SamplingParams

NEG_INF = float("-inf")


def row(generator=None, num_generated=0, eos=None, **kw) -> SamplingRow:
    return SamplingRow(params=SamplingParams(**kw), generator=generator,
                       num_generated=num_generated, eos_token_id=eos)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def log_probs(probs) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


def sample_many(logits_row: torch.Tensor, n: int, seed: int = 0, **kw):
    """n independent draws for one logits row: a batch of n copies sharing one
    seeded generator (so the result is deterministic)."""
    g = gen(seed)
    logits = logits_row.unsqueeze(0).expand(n, -1).contiguous()
    out = Sampler()(logits, [row(generator=g, **kw) for _ in range(n)])
    return torch.tensor(out.token_ids)


# --------------------------------------------------------------------------- #
# greedy
# --------------------------------------------------------------------------- #
def test_greedy_equals_argmax():
    torch.manual_seed(0)
    logits = torch.randn(16, 1000)
    before = logits.clone()
    out = Sampler()(logits, [row(temperature=0.0) for _ in range(16)])
    assert isinstance(out, SamplerOutput)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 16
    assert torch.equal(logits, before)  # input untouched


def test_greedy_ties_pick_lowest_index():
    logits = torch.zeros(3, 50)
    logits[0, [7, 3, 40]] = 5.0
    logits[2, [49, 11]] = 1.0
    out = Sampler()(logits, [row(temperature=0.0) for _ in range(3)])
    assert out.token_ids == logits.argmax(dim=-1).tolist() == [3, 0, 11]


def test_greedy_rows_in_mixed_batch_and_tiny_temperature():
    torch.manual_seed(1)
    logits = torch.randn(8, 300)
    rows = [row(temperature=0.0) if i % 2 == 0 else row(generator=gen(i), temperature=1.0)
            for i in range(8)]
    rows[1] = row(temperature=1e-6)         # below the greedy epsilon
    rows[3] = row(temperature=0.0, logprobs=2)
    out = Sampler()(logits, rows)
    am = logits.argmax(dim=-1).tolist()
    for i in (0, 1, 2, 3, 4, 6):
        assert out.token_ids[i] == am[i]


def test_empty_batch_and_low_precision_logits():
    out = Sampler()(torch.empty(0, 10), [])
    assert out.token_ids == [] and out.logprobs == []
    logits = torch.randn(4, 64).to(torch.bfloat16)
    out = Sampler()(logits, [row(temperature=0.0) for _ in range(4)])
    assert out.token_ids == logits.float().argmax(-1).tolist()


def test_top_k_1_equals_greedy():
    torch.manual_seed(2)
    logits = torch.randn(64, 500) * 0.1      # flat: plain sampling would rarely hit argmax
    rows = [row(generator=gen(i), temperature=1.5, top_k=1) for i in range(32)]
    rows += [row(temperature=0.9, top_k=1) for _ in range(32)]
    out = Sampler()(logits, rows)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


# --------------------------------------------------------------------------- #
# min_tokens
# --------------------------------------------------------------------------- #
def _eos_favoured_logits(b, v=20, eos=5, stops=(7, 9)):
    logits = torch.zeros(b, v)
    logits[:, eos] = 10.0
    for j, s in enumerate(stops):
        logits[:, s] = 9.0 - j
    logits[:, 12] = 8.0                      # best non-stop token
    return logits


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_ids_until_reached(ignore_eos):
    logits = _eos_favoured_logits(6)
    kw = dict(temperature=0.0, min_tokens=3, stop_token_ids=[7, 9], ignore_eos=ignore_eos)
    rows = [row(num_generated=n, eos=5, **kw) for n in range(6)]
    out = Sampler()(logits, rows)
    # under min_tokens: eos and stop ids masked -> 12; from 3 on: eos wins again
    assert out.token_ids == [12, 12, 12, 5, 5, 5]


def test_min_tokens_masked_tokens_never_sampled_and_logprob_is_neg_inf():
    logits = _eos_favoured_logits(1)[0]
    toks = sample_many(logits, 2000, seed=3, temperature=1.0, min_tokens=4, num_generated=1,
                       eos=5, stop_token_ids=[7, 9])
    assert not set(toks.tolist()) & {5, 7, 9}
    toks_after = sample_many(logits, 2000, seed=3, temperature=1.0, min_tokens=4,
                             num_generated=4, eos=5, stop_token_ids=[7, 9])
    assert (toks_after == 5).float().mean() > 0.5

    # logprobs are taken after the min_tokens mask: masked ids get -inf / are not top tokens
    logits = logits + torch.linspace(0.0, 0.1, logits.numel())   # break ties
    out = Sampler()(logits.unsqueeze(0), [row(temperature=0.0, min_tokens=2, eos=5,
                                              stop_token_ids=[7], logprobs=3)])
    lp = out.logprobs[0]
    masked = logits.clone().index_fill_(0, torch.tensor([5, 7]), NEG_INF)
    assert out.token_ids == [12]                # 12 (8.06) beats 9 (8.05)
    assert set(lp) == {12, 9, 19}               # top-3 of the masked row
    _check_logprob_dict(lp, masked, 12, 3)


def test_min_tokens_does_not_modify_caller_logits():
    logits = _eos_favoured_logits(2)
    before = logits.clone()
    Sampler()(logits, [row(temperature=0.0, min_tokens=5, eos=5, stop_token_ids=[7, 9]),
                       row(temperature=1.0, min_tokens=5, eos=5, generator=gen(0))])
    assert torch.equal(logits, before)


# --------------------------------------------------------------------------- #
# top-k / top-p / min-p exclusion
# --------------------------------------------------------------------------- #
def test_top_k_never_samples_excluded_tokens():
    v = 64
    perm = torch.randperm(v, generator=gen(4))
    logits = torch.empty(v)
    logits[perm] = torch.linspace(2.0, 0.0, v)  # perm[0] is best, perm[1] next, ...
    for k in (1, 3, 10):
        toks = sample_many(logits, 3000, seed=k, temperature=1.0, top_k=k)
        allowed = set(perm[:k].tolist())
        assert set(toks.tolist()) == allowed          # never outside, every allowed one seen


def test_top_p_never_samples_excluded_tokens():
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = log_probs(probs)
    for top_p, allowed in ((0.45, {0}), (0.75, {0, 1}), (0.9, {0, 1, 2}), (1.0, {0, 1, 2, 3})):
        toks = sample_many(logits, 4000, seed=5, temperature=1.0, top_p=top_p)
        assert set(toks.tolist()) == allowed, top_p


def test_min_p_never_samples_excluded_tokens():
    logits = log_probs([0.5, 0.3, 0.15, 0.05])
    for min_p, allowed in ((0.0, {0, 1, 2, 3}), (0.2, {0, 1, 2}), (0.5, {0, 1}), (0.9, {0})):
        toks = sample_many(logits, 4000, seed=6, temperature=1.0, min_p=min_p)
        assert set(toks.tolist()) == allowed, min_p


def test_top_p_min_p_apply_after_temperature():
    logits = log_probs([0.5, 0.3, 0.15, 0.05])
    # T=0.5 squares then renormalizes probs: [.685, .247, .062, .007]
    toks = sample_many(logits, 4000, seed=7, temperature=0.5, top_p=0.9)
    assert set(toks.tolist()) == {0, 1}
    toks = sample_many(logits, 4000, seed=7, temperature=0.5, min_p=0.05)
    assert set(toks.tolist()) == {0, 1, 2}


def test_top_k_top_p_min_p_combined_in_batch():
    v = 1000
    g = gen(8)
    logits = torch.randn(v, generator=g)
    order = logits.argsort(descending=True)
    logits[order[:6]] = torch.tensor([6.0, 5.5, 5.0, 4.0, 3.0, 2.0])
    # top_k=5 -> probs [.463, .281, .170, .063, .023]; top_p=0.95 keeps 4
    # (mass before the 4th is .914); min_p=0.2 (x .463 = .093) then drops the 4th
    rows = [row(generator=g, temperature=1.0, top_k=5, top_p=0.95, min_p=0.2)
            for _ in range(1500)]
    rows += [row(temperature=1.0, top_k=5) for _ in range(500)]   # unseeded, other params
    out = Sampler()(logits.expand(len(rows), -1).contiguous(), rows)
    assert set(out.token_ids[:1500]) == set(order[:3].tolist())
    assert set(out.token_ids[1500:]) <= set(order[:5].tolist())


@pytest.mark.parametrize("scale", [0.05, 0.5, 3.0, 12.0])
def test_top_p_mask_matches_full_sort_reference(scale):
    """The partial-top-k candidate search (with fallbacks) equals a full sort."""
    g = gen(9)
    logits = torch.randn(24, 5000, generator=g) * scale
    probs = torch.softmax(logits, dim=-1)
    p = torch.rand(24, 1, generator=g) * 0.98 + 0.01
    p[0] = 0.999
    got = probs.clone()
    _apply_top_p(got, p, cand=64)
    s_probs, s_idx = probs.sort(dim=-1, descending=True)
    cum = s_probs.cumsum(-1)
    keep_sorted = (cum - s_probs) < p
    keep_sorted[:, 0] = True
    keep = torch.zeros_like(keep_sorted).scatter_(1, s_idx, keep_sorted)
    assert torch.equal(got > 0, keep)
    assert torch.equal(got[keep], probs[keep])
    # nucleus definition: kept mass >= p, and without its smallest member < p
    kept_mass = (probs * keep).sum(-1)
    assert torch.all(kept_mass >= p.squeeze(1) - 1e-5)


# --------------------------------------------------------------------------- #
# seeded generators
# --------------------------------------------------------------------------- #
def _run_steps(logits_steps, rows_fn):
    sampler = Sampler()
    return [sampler(l, rows_fn()).token_ids for l in logits_steps]


def test_seeded_row_same_alone_and_in_any_batch():
    v, steps = 2000, 5
    g0 = gen(123)
    target_logits = [torch.randn(v, generator=g0) for _ in range(steps)]
    kw = dict(temperature=0.9, top_p=0.95, top_k=200)

    g = gen(42)
    alone = [Sampler()(l.unsqueeze(0), [row(generator=g, **kw)]).token_ids[0]
             for l in target_logits]

    for layout in range(3):
        torch.manual_seed(1000 + layout)        # global RNG state must not matter
        g = gen(42)
        got = []
        for s, l in enumerate(target_logits):
            others = torch.randn(6, v)
            rows = [row(temperature=1.0),                                   # unseeded
                    row(generator=gen(7 + s), temperature=0.7, min_p=0.1),  # other seed
                    row(temperature=0.0),                                   # greedy
                    row(temperature=1.3, top_k=5, logprobs=2),
                    row(generator=gen(99), temperature=1.0, top_p=0.5),
                    row(temperature=0.5)]
            pos = [0, 3, 6][layout]
            batch = torch.cat([others[:pos], l.unsqueeze(0), others[pos:]])
            rows.insert(pos, row(generator=g, **kw))
            got.append(Sampler()(batch, rows).token_ids[pos])
        assert got == alone, layout
    assert len(set(alone)) > 1                  # really sampling, not degenerate


def test_same_seed_same_tokens_different_seed_differs():
    logits = torch.randn(1, 5000, generator=gen(10))
    a = [Sampler()(logits, [row(generator=gen(1), temperature=1.0)]).token_ids[0]
         for _ in range(3)]
    b = [Sampler()(logits, [row(generator=gen(s), temperature=1.0)]).token_ids[0]
         for s in range(2, 8)]
    assert len(set(a)) == 1
    assert len(set(b + a[:1])) > 1


def test_unseeded_rows_use_global_rng():
    logits = torch.randn(8, 3000, generator=gen(11))
    rows = [row(temperature=1.0) for _ in range(8)]
    torch.manual_seed(5)
    a = Sampler()(logits, rows).token_ids
    torch.manual_seed(5)
    b = Sampler()(logits, rows).token_ids
    torch.manual_seed(6)
    c = Sampler()(logits, rows).token_ids
    assert a == b and a != c


# --------------------------------------------------------------------------- #
# logprobs
# --------------------------------------------------------------------------- #
def _check_logprob_dict(d, logits_row, token, k):
    """d holds the token and k top tokens (any of equally likely ones), each with
    its log_softmax value and rank = 1 + #tokens with strictly greater logprob."""
    ref = torch.log_softmax(logits_row.double(), -1)
    assert token in d
    for t, lp in d.items():
        assert isinstance(lp, Logprob)
        assert lp.logprob == pytest.approx(ref[t].item(), rel=1e-5, abs=1e-5)
        assert lp.rank == 1 + int((ref > ref[t]).sum())
        assert lp.decoded_token is None
    top_vals = ref.topk(k).values.tolist() if k else []
    vals = sorted((ref[t].item() for t in d), reverse=True)
    assert vals[:k] == pytest.approx(top_vals, rel=1e-6, abs=1e-6)
    if len(d) == k + 1:                        # token itself is not one of the top-k
        assert ref[token].item() <= top_vals[-1] if k else True
    else:
        assert len(d) == k and k > 0


def test_logprobs_values_and_ranks():
    torch.manual_seed(12)
    logits = torch.randn(6, 400) * 2
    logits[2, :] = 0.0
    logits[2, [10, 20, 30]] = 1.0               # ties: all three share rank 1
    rows = [row(temperature=0.0, logprobs=3),
            row(generator=gen(1), temperature=2.0, logprobs=5),   # raw, not temperature-scaled
            row(temperature=0.0, logprobs=2),
            row(temperature=0.7, logprobs=None),
            row(generator=gen(2), temperature=5.0, logprobs=0),   # only the sampled token
            row(generator=gen(3), temperature=5.0, top_p=0.9, logprobs=1)]
    out = Sampler()(logits, rows)
    for i, r in enumerate(rows):
        k = r.params.logprobs
        if k is None:
            assert out.logprobs[i] is None
        else:
            _check_logprob_dict(out.logprobs[i], logits[i], out.token_ids[i], k)
    assert len(out.logprobs[4]) == 1
    assert all(lp.rank == 1 for lp in out.logprobs[2].values())  # tied top tokens
    # high-temperature samples are usually far from the top: rank > k path exercised
    assert out.logprobs[4][out.token_ids[4]].rank > 1


def test_logprobs_sampled_token_far_outside_top_k():
    logits = torch.linspace(5.0, 0.0, 300).unsqueeze(0).repeat(200, 1)
    rows = [row(generator=gen(i), temperature=50.0, logprobs=2) for i in range(200)]
    out = Sampler()(logits, rows)
    ranks = [out.logprobs[i][t].rank for i, t in enumerate(out.token_ids)]
    assert ranks == [t + 1 for t in out.token_ids]  # strictly decreasing logits
    assert max(ranks) > 50
    for i in range(0, 200, 37):
        _check_logprob_dict(out.logprobs[i], logits[i], out.token_ids[i], 2)


def test_compute_prompt_logprobs_matches_direct():
    torch.manual_seed(13)
    logits = torch.randn(10, 256)
    logits[4, :5] = 10.0                       # ties
    targets = torch.randint(0, 256, (10,)).tolist()
    targets[4] = 2
    for k in (0, 1, 4):
        res = compute_prompt_logprobs(logits, targets, k)
        assert len(res) == 10
        for i, d in enumerate(res):
            _check_logprob_dict(d, logits[i], targets[i], k)
    res = compute_prompt_logprobs(logits, targets, 4)
    assert res[4][2].rank == 1 and all(lp.rank == 1 for lp in res[4].values())
    assert compute_prompt_logprobs(torch.empty(0, 256), [], 3) == []


# --------------------------------------------------------------------------- #
# distribution
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("temperature", [0.6, 1.0, 2.5])
def test_temperature_sampling_distribution(temperature):
    logits = torch.tensor([1.0, 0.5, 0.0, -1.0])
    n = 20000
    toks = sample_many(logits, n, seed=14, temperature=temperature)
    counts = torch.bincount(toks, minlength=4).double()
    expected = torch.softmax(logits.double() / temperature, -1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 25.0, (chi2, counts.tolist(), expected.tolist())  # df=3: p ~ 1.5e-5


def test_unseeded_temperature_sampling_distribution():
    logits = torch.tensor([0.3, -0.2, 1.1, 0.0])
    n = 20000
    with torch.random.fork_rng():
        torch.manual_seed(15)
        out = Sampler()(logits.expand(n, -1).contiguous(), [row(temperature=0.8)] * n)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4).double()
    expected = torch.softmax(logits.double() / 0.8, -1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 25.0, (chi2, counts.tolist(), expected.tolist())


def test_large_batch_shape_smoke():
    b, v = 64, 49152
    logits = torch.randn(b, v, generator=gen(16)) * 3
    rows = [row(generator=gen(i) if i % 3 else None, temperature=[0.0, 0.7, 1.0, 1.3][i % 4],
                top_p=[1.0, 0.9][i % 2], top_k=[-1, 50, -1][i % 3], min_p=[0.0, 0.05][i % 2],
                logprobs=[None, 1][i % 2])
            for i in range(b)]
    out = Sampler()(logits, rows)
    assert len(out.token_ids) == b and all(0 <= t < v for t in out.token_ids)
    assert all((lp is None) == (r.params.logprobs is None) for lp, r in zip(out.logprobs, rows))
    for i, r in enumerate(rows):
        if r.params.greedy:
            assert out.token_ids[i] == int(logits[i].argmax())
        if r.params.top_k == 50:
            assert out.token_ids[i] in set(logits[i].topk(50).indices.tolist())


# --------------------------------------------------------------------------- #
# logit bias and penalties
# --------------------------------------------------------------------------- #
def _penalized_reference(logits_row, tokens, num_generated, p: SamplingParams):
    """One row, one token at a time: upstream vLLM's formulas written out plainly."""
    x = logits_row.clone().double()
    for tok, val in (p.logit_bias or {}).items():
        x[tok] += val
    generated = tokens[len(tokens) - num_generated:] if num_generated else []
    for tok in set(tokens):
        x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
    for tok in set(generated):
        x[tok] -= p.frequency_penalty * generated.count(tok) + p.presence_penalty
    return x


def test_penalties_and_bias_match_the_formulas():
    torch.manual_seed(3)
    vocab = 12
    logits = torch.randn(4, vocab)
    setups = [  # (params, prompt + output tokens, how many of them are output)
        (dict(repetition_penalty=1.5), [1, 2, 2, 7], 2),
        (dict(frequency_penalty=0.7, presence_penalty=-0.4), [3, 5, 5, 5, 9], 4),
        (dict(), [4, 4], 1),                                        # untouched row
        (dict(logit_bias={0: 3.0, 11: -2.5}, repetition_penalty=0.8, presence_penalty=1.0),
         [0, 6, 11], 1),
    ]
    rows = [SamplingRow(SamplingParams(temperature=0, logprobs=2, **kw), None, n_gen, None, toks)
            for kw, toks, n_gen in setups]
    out = Sampler()(logits, rows)
    for i, (kw, toks, n_gen) in enumerate(setups):
        ref = _penalized_reference(logits[i], toks, n_gen, SamplingParams(**kw))
        assert out.token_ids[i] == int(ref.argmax())
        # logprobs stay the model's (before bias and penalties), as upstream's raw logprobs
        raw = torch.log_softmax(logits[i].double(), 0)
        assert abs(out.logprobs[i][out.token_ids[i]].logprob - raw[out.token_ids[i]]) < 1e-5


def test_logit_bias_forces_a_token_and_penalties_validate():
    logits = torch.zeros(1, 8)
    out = Sampler()(logits, [SamplingRow(SamplingParams(temperature=0, logit_bias={5: 100.0}),
                                         None, 0, None, [1, 2])])
    assert out.token_ids == [5]
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3.0),
                dict(repetition_penalty=0.0), dict(logit_bias={-1: 1.0})):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


def _penalized_batch_reference(logits, rows):
    """Row by row, token by token, in float32 with the sampler's order of operations."""
    out = logits.clone()
    for i, r in enumerate(rows):
        p, toks, x = r.params, list(r.token_ids), out[i]
        for tok, val in (p.logit_bias or {}).items():
            x[tok] += val
        gen_toks = toks[len(toks) - r.num_generated:] if r.num_generated else []
        for tok in set(toks):
            if p.repetition_penalty != 1.0:
                x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 \
                    else x[tok] * p.repetition_penalty
        for tok in set(gen_toks):
            c = torch.tensor(float(gen_toks.count(tok)))
            x[tok] = x[tok] - torch.tensor(p.frequency_penalty) * c \
                - torch.tensor(p.presence_penalty)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_penalties_on_random_rows_match_reference(seed, monkeypatch):
    """Random rows, some without any penalty, mixed in one batch: the penalized logits equal a
    plain per-token reference, and the counts are made on the logits' device from id lists only
    (nothing of the vocabulary's width is uploaded)."""
    import random

    from vllm.model_executor import sampler as sampler_mod
    rng = random.Random(seed)
    torch.manual_seed(seed)
    b, vocab = 9, 3000
    logits = torch.randn(b, vocab) * 3
    rows = []
    for i in range(b):
        kw = {}
        if i % 3:     # every third row has no penalty at all
            kw = dict(repetition_penalty=rng.choice([1.0, 0.6, 1.7]),
                      frequency_penalty=rng.choice([0.0, 0.4, -1.1]),
                      presence_penalty=rng.choice([0.0, 1.2, -0.5]))
            if rng.random() < 0.3:
                kw["logit_bias"] = {rng.randrange(vocab): 2.0}
        n = rng.randint(0, 40)
        toks = [rng.randrange(50) for _ in range(n)]    # a small range: repeated tokens
        rows.append(SamplingRow(SamplingParams(temperature=0, **kw), None, rng.randint(0, n),
                                None, toks))
    uploads, count_calls = [], []
    real_upload, real_count = sampler_mod.to_device, sampler_mod._count_tokens
    monkeypatch.setattr(sampler_mod, "to_device",
                        lambda t, dev: uploads.append(tuple(t.shape)) or real_upload(t, dev))

    def spy_count(seqs, v, dev, dtype):
        assert all(isinstance(t, int) for s in seqs for t in s)    # id lists, not tables
        counts = real_count(seqs, v, dev, dtype)
        count_calls.append(counts.device)
        return counts
    monkeypatch.setattr(sampler_mod, "_count_tokens", spy_count)
    got = sampler_mod._adjust_logits(logits, rows)
    torch.testing.assert_close(got, _penalized_batch_reference(logits, rows))
    assert count_calls and all(d == logits.device for d in count_calls)
    assert all(len(s) == 1 and s[0] < vocab for s in uploads), uploads
    # the untouched rows are exactly the model's
    for i in range(0, b, 3):
        assert torch.equal(got[i], logits[i])
