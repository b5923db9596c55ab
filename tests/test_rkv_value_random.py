"""R-KV and value-aware random (docs/eviction-policies.md): the worked examples, ties, scope
generated and the eviction interval by hand; a property test against a plain reference; the
runner's key statistics (value_norm included) against float64 over float32 and fp8 caches; and
end to end on the tiny model, per request and engine-wide, under every reclamation mode."""
import math
import zlib
from collections import deque

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import random_prompts
from tests.kernel_refs import key_statistic_reference
from tests.test_kv_manager import key_statistic_steps
from vllm import KVEvictionParams, LLM, SamplingParams
from vllm.attention import kv_quant
from vllm.config import KVEvictionConfig
from vllm.core.eviction import RandomPolicy, RKVPolicy, ValueRandomPolicy, make_policy
from vllm.worker.model_runner import ModelRunner

LN = math.log


def ids(*xs):
    return np.array(xs, np.int64)


def f32(*xs):
    return np.array(xs, np.float32)


def policy(name, req="req-0", prompt_len=0, **kw):
    kw.setdefault("min_tokens", 0)
    return make_policy(KVEvictionConfig(policy=name, **kw), req, 1, prompt_len)


def draw(candidates, over, n, req="req-0", seed=0):
    """What `random`'s generator takes from `candidates` at a step of length n."""
    rng = np.random.default_rng([seed, zlib.crc32(req.encode()), n])
    return np.sort(rng.choice(np.asarray(candidates, np.int64), size=over, replace=False))


def test_classes_and_what_they_ask_for():
    rkv, vr = policy("rkv", rkv_window=5), policy("value-random")
    assert type(rkv) is RKVPolicy and type(vr) is ValueRandomPolicy
    assert isinstance(vr, RandomPolicy)
    assert rkv.needs_attention_stats and rkv.needs_prefill_stats and rkv.needs_decode_stats
    assert rkv.key_statistic == "similarity" and rkv.prefill_query_window == 5
    assert rkv.recent_minimum == 5 and policy("rkv", budget_tokens=2, rkv_window=5).budget(99) == 5
    assert not vr.needs_attention_stats and vr.key_statistic == "value_norm"
    with pytest.raises(ValueError, match="--kv-eviction-policy rkv"):
        KVEvictionConfig(policy="rkv", rkv_lambda=1.5)
    with pytest.raises(ValueError, match="--kv-eviction-policy value-random"):
        KVEvictionConfig(policy="value-random", value_protect_fraction=-0.1)


# ---------------------------------------------------------------- R-KV

def test_rkv_worked_example():
    """Budget 4, w = 2 (the 2 newest kept, importance over the last 2 decode steps), lambda 0.5,
    score = .5 * (I - R). Similarities are logs so that the softmax is a ratio by hand."""
    p = policy("rkv", budget_tokens=4, rkv_window=2, rkv_lambda=0.5)
    # prompt 0..5, column sums of the last 2 queries [1, .25, .25, .25, .125, .125] (sum 2):
    # I = [.5, .125, .125, .125, ...]; exp(sim) [1, 1, 1, 3, 2, 2] / 10: R = [.1, .1, .1, .3, ..]
    # I - R over 0..3 = [.4, .025, .025, -.175]: 3 goes, then 1 and 2 tie and the older goes
    live = np.arange(6)
    p.observe_key_statistic(live, f32(0, 0, 0, LN(3), LN(2), LN(2)))
    assert p.on_prefill(live, f32(1, .25, .25, .25, .125, .125), 6).tolist() == [1, 3]
    # token 6: a = [.5, 0, 0, .25, .25] over [0, 2, 4, 5, 6] (the ring holds this step only);
    # R = [.1, .1, .3, .1, .4]: over the evictable 0, 2, 4, I - R = [.4, -.1, -.3] -> 4
    # (importance alone would tie 2 and 4 and take 2)
    live = ids(0, 2, 4, 5, 6)
    p.observe_key_statistic(live, f32(0, 0, LN(3), 0, LN(4)))
    assert p.on_decode(live, f32(.5, 0, 0, .25, .25), 7).tolist() == [4]
    # token 7: ring sums 0: 1, 2: .25, 5: .25, 6: .375, 7: .125 (of 2): I = [.5, .125, .125, ..]
    # R = [.1, .1, .2, .1, .5]: I - R over 0, 2, 5 = [.4, .025, -.075] -> 5
    live = ids(0, 2, 5, 6, 7)
    p.observe_key_statistic(live, f32(0, 0, LN(2), 0, LN(5)))
    assert p.on_decode(live, f32(.5, .25, 0, .125, .125), 8).tolist() == [5]
    # token 8: token 6's step has left the ring (w = 2): 0, 2 and 6 all sum to .625 (0 would
    # hold 1.125 with it); equal similarities: a three-way tie, the oldest goes
    live = ids(0, 2, 6, 7, 8)
    p.observe_key_statistic(live, np.zeros(5, np.float32))
    assert p.on_decode(live, f32(.125, .375, .5, 0, 0), 9).tolist() == [0]


def test_rkv_lambda_weighs_importance_against_redundancy():
    live, colsum = np.arange(6), f32(1, .25, .25, .25, .125, .125)
    sims = f32(0, 0, 0, LN(3), LN(2), LN(2))
    evicted = {}
    for lam in (0.0, 0.1, 1.0):
        p = policy("rkv", budget_tokens=4, rkv_window=2, rkv_lambda=lam)
        p.observe_key_statistic(live, sims)
        evicted[lam] = p.on_prefill(live, colsum, 6).tolist()
    assert evicted[1.0] == [1, 2]        # importance alone: 1, 2, 3 tie, the older go
    assert evicted[0.1] == [1, 3]        # the default leans on redundancy: 3 goes
    assert evicted[0.0] == [0, 3]        # redundancy alone: 3, then 0, 1, 2 tie


def test_rkv_scope_generated_normalises_over_the_generated_tokens():
    """Prompt 0..3 (never evicted, outside both distributions), budget 3 generated tokens,
    w = 1. Over the generated 4..7: a = [0, .0625, .03125, .03125] (of .125): I = [0, .5, .25,
    .25]; exp(sim) [1, 3, 2, 4]: R = [.1, .3, .2, .4]; I - R over 4, 5, 6 = [-.1, .2, .05] -> 4.
    (Were the prompt's mass and similarities in the sums, 5 would go.)"""
    p = policy("rkv", prompt_len=4, scope="generated", budget_tokens=3, rkv_window=1,
               rkv_lambda=0.5)
    live = np.arange(8)
    p.observe_key_statistic(live, f32(-1, -1, -1, -1, 0, LN(3), LN(2), LN(4)))
    mass = f32(.25, .25, .25, .125, 0, .0625, .03125, .03125)
    assert p.on_decode(live, mass, 8).tolist() == [4]


def test_rkv_interval_waits_then_goes_back_to_the_budget():
    """Budget 4, interval 3, w = 2, equal similarities: nothing goes until 7 tokens are live,
    then 3 at once by the last 2 steps' mass (ties: the older)."""
    p = policy("rkv", budget_tokens=4, interval=3, rkv_window=2, rkv_lambda=0.5)
    assert p.on_prefill(np.arange(4), f32(1, 1, 1, 1), 4).size == 0     # no statistic needed
    assert p.on_decode(np.arange(5), f32(.5, 0, 0, 0, .5), 5).size == 0
    assert p.on_decode(np.arange(6), f32(0, .5, .125, .125, .125, .125), 6).size == 0
    live = np.arange(7)
    p.observe_key_statistic(live, np.zeros(7, np.float32))
    # ring: 0: 0 (its .5 left with token 4's step), 1: .75, 2, 3, 4: .25 -> 0, then 2 and 3
    assert p.on_decode(live, f32(0, .25, .125, .125, .125, .25, .125), 7).tolist() == [0, 2, 3]
    assert p.on_decode(ids(1, 4, 5, 6, 7), f32(.2, .2, .2, .2, .2), 8).size == 0


def test_rkv_needs_both_statistics_of_this_step():
    p = policy("rkv", budget_tokens=2, rkv_window=1)
    p.observe_key_statistic(ids(0, 1, 2), f32(.1, .2, .3))
    with pytest.raises(AssertionError, match="this step's key statistic"):
        p.on_decode(ids(0, 1, 2, 3), f32(.25, .25, .25, .25), 4)
    with pytest.raises(AssertionError, match="decode attention"):
        p.on_decode(ids(0, 1, 2, 3), None, 4)
    with pytest.raises(AssertionError, match="prefill colsum"):
        p.on_prefill(ids(0, 1, 2), None, 3)


# ---------------------------------------------------------------- value-aware random

def test_value_random_worked_example():
    """Budget 6, recent window 3, fraction .5: ceil(.5 * 6) = 3 of the eligible 0..5 are spared
    (|eligible| - over = 3 leaves room for all three): norm 8 (4), then 2 and 5 tie with 0 at 4
    and the newer are spared, so the draw has exactly the 3 it must take: 0, 1, 3."""
    p = policy("value-random", budget_tokens=6, recent_fraction=0.5, value_protect_fraction=0.5)
    live = np.arange(9)
    p.observe_key_statistic(live, f32(4, 1, 4, 2, 8, 4, 99, 99, 99))
    assert p.on_prefill(live, None, 9).tolist() == [0, 1, 3]
    # budget 10, recent 5, fraction .2: spared ceil(2) = 2: 5 (norm 9), then of 1 and 3 (norm 5)
    # the newer, 3; the excess 2 is drawn uniformly from 0, 1, 2, 4, 6 by random's generator
    q = policy("value-random", budget_tokens=10, recent_fraction=0.5,
               value_protect_fraction=0.2)
    live = np.arange(12)
    q.observe_key_statistic(live, f32(1, 5, 2, 5, 3, 9, 1, 0, 0, 0, 0, 0))
    assert q.on_decode(live, None, 12).tolist() == draw([0, 1, 2, 4, 6], 2, 12).tolist()


def test_value_random_spares_only_what_leaves_room():
    """recent_fraction 1: the recent window is the whole non-sink budget, so every eligible
    token must go and none can be spared, whatever the fraction."""
    p = policy("value-random", budget_tokens=4, recent_fraction=1.0, value_protect_fraction=1.0)
    live = np.arange(7)
    p.observe_key_statistic(live, f32(9, 9, 9, 1, 1, 1, 1))
    assert p.on_decode(live, None, 7).tolist() == [0, 1, 2]


def test_value_random_fraction_rounds_by_the_rule():
    """0.07 * 100 is 7.000000000000001 in binary: 7 spared, not 8."""
    p = policy("value-random", budget_tokens=100, recent_fraction=0.0,
               value_protect_fraction=0.07)
    live = np.arange(120)
    norms = np.zeros(120, np.float32)
    norms[:9] = 10.0                  # 9 tokens with large values: the 7 newest are spared
    p.observe_key_statistic(live, norms)
    victims = p.on_decode(live, None, 120)
    assert len(victims) == 20
    pool = np.setdiff1d(np.arange(119), np.arange(2, 9))
    assert victims.tolist() == draw(pool, 20, 120).tolist()


def test_value_random_with_fraction_zero_is_random():
    a = policy("value-random", req="x", budget_tokens=20, value_protect_fraction=0.0, seed=3)
    b = policy("random", req="x", budget_tokens=20, seed=3)
    live = np.arange(40)
    for n in range(40, 60):          # no statistic is observed: none is needed
        va, vb = a.on_decode(live, None, n), b.on_decode(live, None, n)
        assert va.tolist() == vb.tolist() and len(va) == len(live) - 20
        live = np.append(np.setdiff1d(live, va), n)


def test_value_random_scope_generated_and_interval():
    """Prompt 0..4 never goes nor counts; budget 4 generated, interval 3, recent window 2,
    fraction .5: nothing until 7 generated tokens are live, then 3 of the eligible 5..9: spared
    ceil(2) = 2, norm 7 (7), then 8 and 9 tie and 9 is spared: the draw must take 5, 6, 8."""
    p = policy("value-random", prompt_len=5, scope="generated", budget_tokens=4, interval=3,
               recent_fraction=0.5, value_protect_fraction=0.5)
    for n in range(5, 12):
        assert p.on_decode(np.arange(n), None, n).size == 0
    live = np.arange(12)
    p.observe_key_statistic(live, f32(50, 50, 50, 50, 50, 1, 2, 7, 3, 3, 0, 0))
    assert p.on_decode(live, None, 12).tolist() == [5, 6, 8]


def test_value_random_draw_is_reproducible_and_batch_independent():
    def run(req, seed=0, others=()):
        p = policy("value-random", req=req, seed=seed, budget_tokens=20)
        live, log = np.arange(40), []
        for n in range(40, 50):
            for q in others:
                q.observe_key_statistic(np.arange(30), np.ones(30, np.float32))
                q.on_decode(np.arange(30), None, 30 + n)
            p.observe_key_statistic(live, (live % 7).astype(np.float32))
            v = p.on_decode(live, None, n)
            log.append(v.tolist())
            live = np.append(np.setdiff1d(live, v), n)
        return log
    log = run("a")
    assert log == run("a", others=[policy("value-random", req="o", budget_tokens=10)])
    assert log != run("b") and log != run("a", seed=1)


# ---------------------------------------------------------------- property test

def reference_rkv(cfg, prompt_len, steps, rng):
    """A plain re-statement of the rule (dicts and a deque): yields (live, mass, sims, n,
    expected victims) per step."""
    scope = prompt_len if cfg.scope == "generated" else 0
    first = max(cfg.sinks, scope)
    ring = deque(maxlen=cfg.rkv_window)
    p = make_policy(cfg, "ref", 1, prompt_len)
    live = list(range(prompt_len))
    for n in range(prompt_len, prompt_len + steps + 1):
        decode = n > prompt_len
        if decode:
            live.append(n - 1)
        mass = rng.dirichlet(np.full(len(live), 0.5)).astype(np.float32)
        sims = rng.uniform(-1, 1, len(live)).astype(np.float32)
        if rng.random() < 0.3:                        # ties
            mass[:] = mass[0]
            sims[:] = sims[0]
        imp = dict(zip(live, mass.astype(np.float64)))
        if decode:
            ring.append(imp)
            imp = {j: sum(r.get(j, 0.0) for r in ring) for j in live}
        counted = [j for j in live if j >= scope]
        budget = p.budget(n)
        over = len(counted) - budget
        over = over if over >= cfg.interval else 0
        total = sum(imp[j] for j in counted)
        s = dict(zip(live, sims.astype(np.float64)))
        top = max(s[j] for j in counted) if counted else 0.0
        z = sum(math.exp(s[j] - top) for j in counted)
        evictable = [j for j in live[:max(len(live) - cfg.rkv_window, 0)] if j >= first]
        score = {j: cfg.rkv_lambda * (imp[j] / total if total > 0 else 0.0)
                 - (1 - cfg.rkv_lambda) * math.exp(s[j] - top) / z for j in evictable}
        expect = sorted(sorted(evictable, key=lambda j: (score[j], j))[:max(over, 0)])
        yield np.array(live, np.int64), mass, sims, n, expect, decode
        live = [j for j in live if j not in set(expect)]


@settings(max_examples=120, deadline=None)
@given(prompt=st.integers(1, 30), steps=st.integers(0, 25), budget=st.integers(1, 20),
       sinks=st.integers(0, 4), window=st.integers(1, 5), lam=st.sampled_from([0.0, 0.1, 0.5, 1]),
       scope=st.sampled_from(["all", "generated"]), interval=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_property_rkv_matches_the_rule(prompt, steps, budget, sinks, window, lam, scope,
                                       interval, seed):
    cfg = KVEvictionConfig(policy="rkv", budget_tokens=budget, sink_tokens=sinks, min_tokens=0,
                           rkv_window=window, rkv_lambda=lam, scope=scope, interval=interval)
    p = make_policy(cfg, "ref", 1, prompt)
    for live, mass, sims, n, expect, decode in reference_rkv(cfg, prompt, steps,
                                                             np.random.default_rng(seed)):
        if not decode and scope == "generated":
            continue                       # the driver never runs a prompt it may not evict
        p.observe_key_statistic(live, sims)
        got = p.on_decode(live, mass, n) if decode else p.on_prefill(live, mass, n)
        assert got.dtype == np.int64 and got.tolist() == expect


@settings(max_examples=120, deadline=None)
@given(prompt=st.integers(1, 30), steps=st.integers(0, 25), budget=st.integers(1, 20),
       sinks=st.integers(0, 4), frac=st.floats(0, 1), recent=st.floats(0, 1),
       scope=st.sampled_from(["all", "generated"]), interval=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_property_value_random_spares_the_largest_values(prompt, steps, budget, sinks, frac,
                                                         recent, scope, interval, seed):
    cfg = KVEvictionConfig(policy="value-random", budget_tokens=budget, sink_tokens=sinks,
                           min_tokens=0, value_protect_fraction=frac, recent_fraction=recent,
                           scope=scope, interval=interval, seed=seed % 5)
    p, rng = make_policy(cfg, f"r{seed}", 1, prompt), np.random.default_rng(seed)
    start = prompt if scope == "generated" else 0
    live = np.arange(prompt, dtype=np.int64)
    for n in range(prompt, prompt + steps + 1):
        if n > prompt:
            live = np.append(live, n - 1)
        norms = rng.integers(0, 4, len(live)).astype(np.float32)     # many ties
        p.observe_key_statistic(live, norms)
        b = p.budget(n)
        counted = int((live >= start).sum())
        over = counted - b if counted - b >= interval else 0
        eligible = [i for i, j in enumerate(live) if j >= max(sinks, start)]
        eligible = [i for i in eligible if i < len(live) - p.recent_window(b)]
        k = min(math.ceil(frac * b - 1e-9), len(eligible) - over) if over else 0
        spared = sorted(eligible, key=lambda i: (-norms[i], -live[i]))[:max(k, 0)]
        pool = [live[i] for i in eligible if i not in spared]
        got = p.on_decode(live, None, n) if n > prompt else p.on_prefill(live, None, n)
        if over == 0:
            assert got.size == 0
        else:
            assert got.tolist() == draw(pool, over, n, f"r{seed}", seed % 5).tolist()
        live = np.setdiff1d(live, got)


# ---------------------------------------------------------------- the runner's key statistics

@pytest.mark.parametrize("kind", ["norm", "similarity", "value_norm"])
@pytest.mark.parametrize("dtype", ["float32", "fp8_e4m3", "fp8_e5m2"])
def test_runner_key_statistics_equal_a_float64_reference(kind, dtype):
    """Mean over layers and KV heads of ||k||, cos(k, mean unit key) or ||v|| over the view's
    slots; an fp8 cache is read dequantized, K and V each with its layer's own scale."""
    g = torch.Generator().manual_seed(4)
    layers, slots_n, kvh, d = 3, 48, 2, 16
    x = torch.randn(layers, slots_n, 2, kvh, d, generator=g)
    x[:, :, 1] *= torch.rand(slots_n, 1, 1, generator=g) * 4      # values of varied norms
    if dtype == "float32":
        cache, cache64 = x.clone(), x.double()
    else:
        fp8 = kv_quant.cache_dtype(dtype, torch.float32)
        ks, vs = [0.5, 0.25, 2.0], [3.0, 0.125, 1.5]
        cache = torch.zeros(x.shape, dtype=fp8)
        kv_quant.register(cache)
        kv_quant.set_scales(cache, ks, vs)
        scale = torch.tensor([ks, vs], dtype=torch.float64).t().reshape(layers, 1, 2, 1, 1)
        cache.view(torch.uint8).copy_((x / scale).to(fp8).view(torch.uint8))
        cache64 = cache.to(torch.float64) * scale
    runner = ModelRunner(torch.nn.Identity(), cache, 8, 2, 64)
    view = np.array([5, 40, 3, 17, 22, 9, 30], np.int64)
    got = runner._key_statistic(view, kind)
    want = key_statistic_reference(cache64, torch.from_numpy(view), kind)
    assert got.dtype == np.float32 and got.shape == (len(view),)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_value_random_reads_the_cached_value_norms(tiny_llama, kv_cache_dtype):
    """Through the engine: on an evicting step the policy holds ||v|| of its view's tokens as
    the cache holds them (float64 reference), and no attention statistics are asked for."""
    llm = LLM(tiny_llama, kv_eviction_policy="value-random", kv_budget_tokens=24,
              kv_min_tokens=0, kv_reclamation="none", kv_cache_dtype=kv_cache_dtype,
              num_gpu_blocks_override=64, block_size=8)
    eng = llm.llm_engine
    eng.add_request("v", {"prompt_token_ids": random_prompts(1, seed=62, lo=40, hi=41)[0]},
                    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    seq = eng.requests["v"].seqs[0]
    state = eng.kv.requests[seq.seq_id]
    eng.step()
    assert len(state.policy.score_ids) == 40 and state.kv_stats["evicted_tokens"] == 16
    for _, slots in key_statistic_steps(eng, seq, 3):
        kv = eng.kv_caches
        cache64 = kv.to(torch.float64)
        if kv_quant.is_fp8(kv):
            cache64 *= kv_quant.scales_of(kv).double().view(-1, 1, 2, 1, 1)
        want = key_statistic_reference(cache64, slots, "value_norm")
        np.testing.assert_allclose(state.policy.score, want, rtol=1e-5)


# ---------------------------------------------------------------- end to end

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SETTINGS = [
    KVEvictionParams(policy="rkv", budget_tokens=24, min_tokens=0),
    KVEvictionParams(policy="value-random", budget_tokens=24, min_tokens=0),
    KVEvictionParams(policy="rkv", budget_tokens=8, min_tokens=0, scope="generated", interval=3),
    KVEvictionParams(policy="value-random", eviction_ratio=0.5, min_tokens=0, scope="generated",
                     interval=4),
    None,
]


def run_engine(model, prompts, settings, **kw):
    """-> per request (tokens, eviction log, prompt length); invariants checked every step."""
    llm = LLM(model, num_gpu_blocks_override=128, block_size=8, kv_check_invariants=True,
              kv_eviction_log=True, kv_frag_threshold=0.0, **kw)
    eng = llm.llm_engine
    seqs = []
    for i, (p, ev) in enumerate(zip(prompts, settings)):
        eng.add_request(f"q{i}", {"prompt_token_ids": p}, GREEDY, kv_eviction=ev)
        seq = eng.requests[f"q{i}"].seqs[0]
        seqs.append((seq, eng.kv.requests[seq.seq_id]))
    while eng.has_unfinished_requests():
        eng.step()
    eng.check_invariants()
    assert eng.kv.bm.num_free_blocks == eng.kv.bm.num_blocks
    return [(tuple(s.output_token_ids), [a.tolist() for a in kv.eviction_log or []], len(p))
            for (s, kv), p in zip(seqs, prompts)], llm.get_kv_stats()


@pytest.fixture(scope="module")
def e2e_prompts():
    return random_prompts(len(SETTINGS), seed=83, lo=40, hi=70)


def test_per_request_under_every_reclamation_mode(tiny_llama, e2e_prompts):
    """Both policies per request in one batch: Naive-Evict, vToken and vToken with hole filling
    give the same tokens and evictions, and each request those of its settings alone."""
    runs = {mode: run_engine(tiny_llama, e2e_prompts, SETTINGS, kv_reclamation=mode)
            for mode in ("none", "vtoken", "vtoken-fill")}
    naive = runs["none"][0]
    assert runs["vtoken"][0] == naive and runs["vtoken-fill"][0] == naive
    assert runs["vtoken"][1]["relocation_events"] + runs["vtoken-fill"][1]["hole_slots_reused"] > 0
    for (_, log, plen), ev in zip(naive, SETTINGS):
        assert bool(log) == (ev is not None)
        if ev is not None and ev.scope == "generated":   # the prompt stays; N at a time
            assert min(min(b) for b in log) >= plen
            assert all(len(b) == ev.interval for b in log)
    alone = run_engine(tiny_llama, e2e_prompts[:2], SETTINGS[:2], kv_reclamation="vtoken")[0]
    assert alone == naive[:2]


@pytest.mark.parametrize("policy", ["rkv", "value-random"])
def test_engine_wide_naive_equals_vtoken(tiny_llama, e2e_prompts, policy):
    runs = [run_engine(tiny_llama, e2e_prompts, [None] * len(e2e_prompts),
                       kv_eviction_policy=policy, kv_budget_tokens=24, kv_min_tokens=0,
                       kv_reclamation=mode)[0] for mode in ("none", "vtoken", "vtoken-fill")]
    assert runs[0] == runs[1] == runs[2]
    assert all(log for _, log, _ in runs[0])


def test_simulated_model_gives_seeded_value_norms(tmp_path):
    """--load-format simulate: ||v|| is a seeded function of the position the cache holds
    (relocation carries it); value-random runs on it, Naive-Evict equal to vToken."""
    import transformers
    from vllm.model_executor.models.simulated import SimulatedModel
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=4096)
    model = SimulatedModel(cfg, seed=2)
    cache = torch.zeros(1, 64, 2, 1, 1)
    cache[0, :, 0, 0, 0] = torch.rand(64) + 0.1
    cache[0, :, 1, 0, 0] = torch.arange(64).flip(0).float()     # slot s holds position 63 - s
    slots = torch.tensor([0, 10, 63])
    v = model.synthetic_key_statistic(cache, slots, "value_norm")
    moved = cache.clone()                                        # as a relocation copies them
    moved[0, torch.tensor([5, 6, 7])] = cache[0, slots]
    assert np.array_equal(v, model.synthetic_key_statistic(moved, torch.tensor([5, 6, 7]),
                                                           "value_norm"))
    assert len(set(v.tolist())) == 3
    assert np.array_equal(v, SimulatedModel(cfg, seed=2).synthetic_key_statistic(
        cache, slots, "value_norm"))
    assert np.array_equal(model.synthetic_key_statistic(cache, slots, "norm"),
                          cache[0, slots, 0, 0, 0].numpy())
    assert (model.synthetic_key_statistic(cache, slots, "similarity") == 1).all()
    cfg.save_pretrained(tmp_path)
    toks = {}
    for mode in ("none", "vtoken"):
        llm = LLM(str(tmp_path), load_format="simulate", kv_eviction_policy="value-random",
                  kv_budget_tokens=32, kv_min_tokens=0, kv_reclamation=mode,
                  num_gpu_blocks_override=64, kv_check_invariants=True, kv_eviction_log=True)
        outs = llm.generate([{"prompt_token_ids": list(range(3, 3 + n))} for n in (50, 70)],
                            SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                            use_tqdm=False)
        toks[mode] = [(o.outputs[0].token_ids, o.kv_stats["evicted_tokens"]) for o in outs]
    assert toks["none"] == toks["vtoken"] and all(e > 0 for _, e in toks["none"])
