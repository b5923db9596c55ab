"""Eviction policies against shared/design/eviction-policies.md: every worked example, the corner
cases, and a property test over random prefill + decode sequences."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.config import KVEvictionConfig
from vllm.core.eviction import (H2OPolicy, RandomPolicy, ScissorhandsPolicy, SnapKVPolicy,
                                StreamingLLMPolicy, TOVAPolicy, make_policy, token_budget)
from vllm.core.eviction.snapkv import max_pool

ALL = ["h2o", "scissorhands", "streamingllm", "sliding-window", "random", "tova", "snapkv"]


def ids(*xs):
    return np.array(xs, np.int64)


def f32(*xs):
    return np.array(xs, np.float32)


def policy(name, lh=1, req="req-0", **kw):
    kw.setdefault("min_tokens", 0)       # the paper's setups: no floor
    return make_policy(KVEvictionConfig(policy=name, **kw), req, lh)


def stats_for(p, n, rng):
    return rng.random(n).astype(np.float32) if p.needs_attention_stats else None


# ---------------------------------------------------------------- interface and budget

def test_make_policy_classes_and_none():
    assert make_policy(KVEvictionConfig(policy="none"), "r", 4) is None
    expected = {"h2o": H2OPolicy, "scissorhands": ScissorhandsPolicy,
                "streamingllm": StreamingLLMPolicy, "sliding-window": StreamingLLMPolicy,
                "random": RandomPolicy, "tova": TOVAPolicy, "snapkv": SnapKVPolicy}
    for name, cls in expected.items():
        assert type(policy(name)) is cls
    for name in ("streamingllm", "sliding-window", "random"):
        assert not policy(name).needs_attention_stats
    for name in ("h2o", "scissorhands", "tova", "snapkv"):
        assert policy(name).needs_attention_stats
    assert policy("streamingllm").sinks == 4 and policy("sliding-window").sinks == 0
    # optional finer hints for the engine
    sh = policy("scissorhands")
    assert not sh.needs_prefill_stats and sh.needs_decode_stats
    assert policy("snapkv").needs_prefill_stats and not policy("snapkv").needs_decode_stats
    assert policy("snapkv", snapkv_window=16).prefill_query_window == 16
    assert policy("tova").prefill_query_window == 1 and policy("h2o").prefill_query_window is None


def test_budget_ratio_fixed_and_minimum():
    cfg = KVEvictionConfig(policy="h2o", eviction_ratio=0.5, min_tokens=0)
    assert token_budget(cfg, 11, 1) == 5                      # floor(0.5 * 11)
    assert token_budget(cfg, 2, 3) == 3                       # never below the minimum
    # binary rounding: (1 - 0.9) * 10 = 0.9999999999999998 must still give 1
    assert token_budget(KVEvictionConfig(policy="h2o", eviction_ratio=0.9, min_tokens=0),
                        10, 0) == 1
    assert token_budget(KVEvictionConfig(policy="h2o", eviction_ratio=0.7, min_tokens=0),
                        10, 0) == 3
    fixed = KVEvictionConfig(policy="h2o", budget_tokens=7, eviction_ratio=0.9)
    assert token_budget(fixed, 1000, 1) == 7                  # fixed budget replaces the ratio
    assert policy("streamingllm", budget_tokens=2).budget(100) == 5     # 4 sinks + newest
    assert policy("scissorhands", budget_tokens=2, scissorhands_recent=10).budget(100) == 10
    assert policy("snapkv", budget_tokens=2, snapkv_window=8).budget(100) == 8


@pytest.mark.parametrize("kw, flag", [
    (dict(eviction_ratio=1.0), "--kv-eviction-ratio"),
    (dict(eviction_ratio=1.5), "--kv-eviction-ratio"),
    (dict(eviction_ratio=-0.1), "--kv-eviction-ratio"),
    (dict(budget_tokens=0), "--kv-budget-tokens"),
    (dict(budget_tokens=-3), "--kv-budget-tokens"),
    (dict(sink_tokens=-1), "--kv-sink-tokens"),
])
def test_invalid_config_names_the_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        KVEvictionConfig(**{"policy": "h2o", **kw})


def test_unknown_policy_names_the_flag():
    """Policy names are the registry's, checked where the engine side makes a config (the
    config module itself is the workers' too, which never import the policies)."""
    from vllm.core.eviction import make_policy
    from vllm.engine.arg_utils import EngineArgs
    with pytest.raises(ValueError, match="--kv-eviction-policy: must be one of"):
        EngineArgs(kv_eviction_policy="lru").eviction_config()
    with pytest.raises(ValueError, match="--kv-eviction-policy: must be one of"):
        make_policy(KVEvictionConfig(policy="lru"), "r", 1)


# ---------------------------------------------------------------- H2O

def test_h2o_worked_example():
    p = policy("h2o", budget_tokens=4, recent_fraction=0.5)          # hh=2, recent=2
    colsum = f32(3.0, .2, 1.5, .1, .9, .4, .3, .1)
    assert p.on_prefill(np.arange(8), colsum, 8).tolist() == [1, 3, 4, 5]
    np.testing.assert_allclose(p.scores[[0, 2, 6, 7]], [3.0, 1.5, .3, .1], rtol=1e-6)
    # token 8 over (0, 2, 6, 7, 8): scores {0: 3.5, 2: 1.6, 6: .4, 7: .2, 8: .2}; 7, 8 are recent
    assert p.on_decode(ids(0, 2, 6, 7, 8), f32(.5, .1, .1, .1, .2), 9).tolist() == [6]
    np.testing.assert_allclose(p.scores[[0, 2, 7, 8]], [3.5, 1.6, .2, .2], rtol=1e-6)
    assert p.scores[6] == 0                                            # dropped with the token
    assert p.on_decode(ids(0, 2, 7, 8, 9), f32(.2, .1, .1, .5, .1), 10).tolist() == [7]
    assert p.scores.dtype == np.float32


def test_h2o_ties_evict_older():
    p = policy("h2o", budget_tokens=4, recent_fraction=0.5)
    # 0..3 tie at .5; keep 2 heavy hitters -> evict the two older ones, 0 and 1
    assert p.on_prefill(np.arange(6), f32(.5, .5, .5, .5, 9, 9), 6).tolist() == [0, 1]


def test_h2o_ratio_budget_one_in_one_out():
    p = policy("h2o", eviction_ratio=0.5)
    victims = p.on_prefill(np.arange(10), np.ones(10, np.float32), 10)   # budget 5, recent 2
    assert victims.tolist() == [0, 1, 2, 3, 4]                          # all tie: oldest go
    live = np.append(np.setdiff1d(np.arange(10), victims), 10)
    assert p.on_decode(live, np.ones(6, np.float32), 11).tolist() == [5]  # floor(5.5) = 5
    live = np.append(np.setdiff1d(live, [5]), 11)
    assert len(p.on_decode(live, np.ones(6, np.float32), 12)) == 0      # floor(6) = 6


# ---------------------------------------------------------------- Scissorhands

# a(j) per decode step (L*H = 1) crafted so that the counts become the spec's
# {0: 0, 1: 5, 2: 4, 3: 4, 4: 3, 5: 2, 6: 1}: token 0 takes all the mass; at the step of token 2,
# tokens 0 and 2 share it (a * n = 1.5 >= 1: not low), token 1 gets 0 (low).
def scissorhands_run(p):
    assert p.on_prefill(ids(0, 1), None, 2).tolist() == []
    out = [p.on_decode(ids(0, 1, 2), f32(.5, 0, .5), 3)]
    for new in range(3, 7):
        out.append(p.on_decode(np.arange(new + 1), f32(1, *[0] * new), new + 1))
    return out


def test_scissorhands_counts_example():
    roomy = policy("scissorhands", budget_tokens=100, scissorhands_recent=2)
    assert all(len(v) == 0 for v in scissorhands_run(roomy))
    assert roomy.counts[:7].tolist() == [0, 5, 4, 4, 3, 2, 1]


def test_scissorhands_worked_example_b6_r2_m3():
    p = policy("scissorhands", budget_tokens=6, scissorhands_recent=2, scissorhands_drop=3)
    victims = scissorhands_run(p)
    assert [v.tolist() for v in victims[:-1]] == [[]] * 4
    assert victims[-1].tolist() == [1, 2, 3]                # |K| = 7 > 6: drop m = 3 at once
    assert p.counts[[0, 4, 5, 6]].tolist() == [0, 3, 2, 1]
    default_m = policy("scissorhands", budget_tokens=6, scissorhands_recent=2)  # m = 6 // 2
    assert scissorhands_run(default_m)[-1].tolist() == [1, 2, 3]
    # m = 2: 2 and 3 tie at count 4 -> the older one, 2, goes
    m2 = policy("scissorhands", budget_tokens=6, scissorhands_recent=2, scissorhands_drop=2)
    assert scissorhands_run(m2)[-1].tolist() == [1, 2]


def test_scissorhands_window_forgets_and_uses_layer_heads():
    p = policy("scissorhands", lh=2, budget_tokens=100, scissorhands_window=2)
    p.on_prefill(ids(0, 1), None, 2)
    # L*H=2, n=3: low iff a < 2/3
    p.on_decode(ids(0, 1, 2), f32(1.0, .5, .5), 3)            # 1, 2 low
    assert p.counts[:3].tolist() == [0, 1, 1]
    p.on_decode(ids(0, 1, 2, 3), f32(.1, 1.0, .4, .5), 4)     # n=4: low iff a < .5 -> 0, 2
    assert p.counts[:4].tolist() == [1, 1, 2, 0]
    p.on_decode(np.arange(5), f32(0, 1, 1, 0, 0), 5)          # step 1 leaves the window
    assert p.counts[:5].tolist() == [2, 0, 1, 1, 1]


def test_scissorhands_prefill_evicts_only_down_to_budget():
    p = policy("scissorhands", budget_tokens=6, scissorhands_recent=2)
    assert p.on_prefill(np.arange(7), None, 7).tolist() == [0]   # counts all 0: oldest goes


# ---------------------------------------------------------------- StreamingLLM / sliding window

def test_streamingllm_worked_example():
    p = policy("streamingllm", budget_tokens=8)                       # 4 sinks + 4 recent
    assert p.on_prefill(np.arange(10), None, 10).tolist() == [4, 5]
    live = ids(0, 1, 2, 3, 6, 7, 8, 9, 10)
    assert p.on_decode(live, None, 11).tolist() == [6]
    short = policy("streamingllm", budget_tokens=8)
    assert short.on_prefill(np.arange(3), None, 3).tolist() == []


def test_sliding_window_is_zero_sinks():
    p = policy("sliding-window", budget_tokens=8)
    assert p.on_prefill(np.arange(10), None, 10).tolist() == [0, 1]
    assert p.on_decode(np.arange(2, 11), None, 11).tolist() == [2]


# ---------------------------------------------------------------- TOVA

def test_tova_worked_example():
    p = policy("tova", budget_tokens=3)
    assert p.on_prefill(np.arange(3), f32(1, 1, 1), 3).tolist() == []
    # the new token 3 has the lowest weight (.05) but is protected: evict 2
    assert p.on_decode(ids(0, 1, 2, 3), f32(.5, .3, .15, .05), 4).tolist() == [2]
    # no accumulation: only this step's weights count; ties -> older
    assert p.on_decode(ids(0, 1, 3, 4), f32(.1, .1, .5, .3), 5).tolist() == [0]


# ---------------------------------------------------------------- SnapKV

def test_max_pool():
    assert max_pool(f32(1, 5, 2, 0), 3).tolist() == [5, 5, 5, 2]
    assert max_pool(f32(1, 5, 2, 0), 1).tolist() == [1, 5, 2, 0]
    assert max_pool(f32(3, 1, 0, 0, 0, 0, 2), 5).tolist() == [3, 3, 3, 1, 2, 2, 2]


# 10-token prompt, window w=2 (tokens 8, 9), kernel 3. Votes of the prefix 0..7 and their pooling
# (the window's votes stay out of the pool):
#   votes  [.1, .9, .1, .1, .2, .1, .1, .6]
#   pooled [.9, .9, .9, .2, .2, .2, .6, .6]
SNAP_VOTES = f32(.1, .9, .1, .1, .2, .1, .1, .6, 5, 5)


@pytest.mark.parametrize("budget, evicted", [
    (5, [3, 4, 5, 6, 7]),     # keep top 3 by pooled: {0, 1, 2}
    (6, [3, 4, 5, 6]),        # pooled tie 6 vs 7 (.6): unpooled .1 < .6 -> evict 6
    (8, [3, 5]),              # pooled tie 3, 4, 5 (.2): unpooled 4 (.2) survives
    (9, [3]),                 # 3 vs 5: pooled .2 and unpooled .1 both equal -> the older, 3
    (10, []),
])
def test_snapkv_pooling_and_tie_rule(budget, evicted):
    p = policy("snapkv", budget_tokens=budget, snapkv_window=2, snapkv_kernel=3)
    assert p.prefill_query_window == 2
    assert p.on_prefill(np.arange(10), SNAP_VOTES, 10).tolist() == evicted
    live = np.setdiff1d(np.arange(11), evicted)
    assert p.on_decode(live, None, 11).tolist() == []        # nothing evicted during decode


def test_snapkv_pooling_spreads_to_neighbours():
    # unpooled, 4 (0), 6 (.01) and 7 (.02) would go; the spike at 5 keeps its neighbours 4 and 6:
    # votes [.3, .2, .25, .05, 0, 1.0, .01, .02] -> pooled [.3, .3, .25, .25, 1, 1, 1, .02]
    # evict 3 of the prefix: 7 (.02), then the pooled tie 2, 3 (.25) by unpooled: 3 (.05), 2 (.25)
    votes = f32(.3, .2, .25, .05, 0, 1.0, .01, .02, 1, 1)
    p = policy("snapkv", budget_tokens=7, snapkv_window=2, snapkv_kernel=3)
    assert p.on_prefill(np.arange(10), votes, 10).tolist() == [2, 3, 7]


# ---------------------------------------------------------------- Random

def random_log(req, seed=0, steps=5, others=()):
    p = policy("random", req=req, seed=seed, budget_tokens=20, recent_fraction=0.25)
    live, log = np.arange(100), []
    for step in range(steps + 1):
        for q in others:                       # other requests of the batch run in between
            q.on_decode(np.arange(50), None, 50 + step)
        v = p.on_prefill(live, None, 100) if step == 0 else p.on_decode(live, None, 100 + step)
        log.append(v.tolist())
        live = np.append(np.setdiff1d(live, v), 100 + step)
    return log


def test_random_reproducible_and_independent():
    log = random_log("a")
    assert log == random_log("a")
    batch = [policy("random", req=f"o{i}", budget_tokens=10) for i in range(3)]
    assert log == random_log("a", others=batch)                   # batch composition irrelevant
    assert log != random_log("b")                                 # request id matters
    assert log != random_log("a", seed=1)                         # seed matters
    assert len(log[0]) == 80 and all(len(v) == 1 for v in log[1:])
    p = policy("random", req="a", budget_tokens=20)
    live = np.arange(30)
    assert p.on_decode(live, None, 30).tolist() == p.on_decode(live, None, 30).tolist()
    assert p.on_decode(live, None, 30).tolist() != p.on_decode(live, None, 31).tolist()


def test_random_respects_recent_window_and_sinks():
    p = policy("random", budget_tokens=12, sink_tokens=2, recent_fraction=0.5)  # recent = 5
    for n in range(13, 40):
        v = p.on_decode(np.arange(n), None, n)
        assert len(v) == n - 12 and v.min() >= 2 and v.max() < n - 5


# ---------------------------------------------------------------- corner cases, all policies

@pytest.mark.parametrize("name", ALL)
def test_prompt_shorter_than_budget(name):
    p = policy(name, budget_tokens=10, snapkv_window=2, scissorhands_recent=2)
    colsum = f32(1, 2, 3, 4, 5)
    assert p.on_prefill(np.arange(5), colsum if p.needs_attention_stats else None, 5).size == 0
    if name == "h2o":                                  # scores still accumulate
        p.on_decode(np.arange(6), np.ones(6, np.float32), 6)
        np.testing.assert_allclose(p.scores[:6], [2, 3, 4, 5, 6, 1])


@pytest.mark.parametrize("name", ALL)
def test_prompt_one_over_evicts_exactly_one(name):
    p = policy(name, budget_tokens=10, sink_tokens=0, snapkv_window=2, scissorhands_recent=2)
    v = p.on_prefill(np.arange(11), stats_for(p, 11, np.random.default_rng(0)), 11)
    assert len(v) == 1 and v[0] < 9


@pytest.mark.parametrize("name", ALL)
def test_sinks_at_least_prompt_length(name):
    p = policy(name, budget_tokens=2, sink_tokens=6, snapkv_window=1, scissorhands_recent=1)
    rng = np.random.default_rng(0)
    assert p.on_prefill(np.arange(4), stats_for(p, 4, rng), 4).size == 0
    live = np.arange(4)
    for n in range(5, 30):
        live = np.append(live, n - 1)
        v = p.on_decode(live, stats_for(p, len(live), rng), n)
        assert np.all(v >= 6) and n - 1 not in v
        live = np.setdiff1d(live, v)
    assert set(range(4)) <= set(live.tolist())


@pytest.mark.parametrize("name", ALL)
def test_ratio_zero_never_evicts(name):
    p = policy(name, eviction_ratio=0.0)
    rng = np.random.default_rng(1)
    assert p.on_prefill(np.arange(50), stats_for(p, 50, rng), 50).size == 0
    for n in range(51, 120):
        assert p.on_decode(np.arange(n), stats_for(p, n, rng), n).size == 0


@pytest.mark.parametrize("name", ALL)
def test_new_token_and_sinks_never_evicted(name):
    p = policy(name, budget_tokens=6, sink_tokens=2, snapkv_window=1, scissorhands_recent=1)
    rng = np.random.default_rng(2)
    live = np.arange(20)
    stats = stats_for(p, 20, rng)
    if stats is not None:
        stats[-1] = 0.0                        # the newest prompt token looks worthless
    live = np.setdiff1d(live, p.on_prefill(live, stats, 20))
    for n in range(21, 60):
        live = np.append(live, n - 1)
        stats = stats_for(p, len(live), rng)
        if stats is not None:
            stats[-1] = 0.0                    # the new token gets no attention at all
        v = p.on_decode(live, stats, n)
        assert n - 1 not in v and np.all(v >= 2)
        live = np.setdiff1d(live, v)
    assert live[:2].tolist() == [0, 1]


@pytest.mark.parametrize("name", ALL)
def test_reprefill_after_preemption_rebuilds_state(name):
    # recompute gives a fresh instance; its ids need not be contiguous (ids 2, 4, 6 were evicted)
    live = ids(0, 1, 3, 5, 7, 8, 9, 10, 11, 12)
    p = policy(name, budget_tokens=6, snapkv_window=2, scissorhands_recent=2)
    stats = np.arange(10, 0, -1).astype(np.float32) if p.needs_attention_stats else None
    v = p.on_prefill(live, stats, 13)
    assert len(v) == 4 and np.isin(v, live[:-1]).all()
    if name == "h2o":                          # scores rebuilt from the re-prefill's column sums
        kept = np.setdiff1d(live, v)
        np.testing.assert_allclose(p.scores[kept], stats[np.isin(live, kept)])


# ---------------------------------------------------------------- property test

def recent_minimum(cfg):
    return {"scissorhands": max(1, cfg.scissorhands_recent),
            "snapkv": cfg.snapkv_window}.get(cfg.policy, 1)


def expected_budget(cfg, n):
    raw = cfg.budget_tokens if cfg.budget_tokens is not None else \
        math.floor((1 - cfg.eviction_ratio) * n + 1e-6)
    return max(cfg.sinks + recent_minimum(cfg), raw)


def check_step(p, cfg, live, victims, n, decode):
    over = len(live) - expected_budget(cfg, n)
    assert victims.dtype == np.int64 and np.all(np.diff(victims) > 0)   # unique, ascending
    assert np.isin(victims, live).all() and np.all(victims >= cfg.sinks)
    assert live[-1] not in victims                       # the new (or newest prompt) token
    kept = len(live) - len(victims)
    if cfg.policy == "snapkv" and decode:
        assert len(victims) == 0
    elif cfg.policy == "scissorhands" and decode and over > 0:
        m = expected_budget(cfg, n) // 2 if cfg.scissorhands_drop is None else cfg.scissorhands_drop
        assert len(victims) >= over and len(victims) <= max(over, m)
    else:                                                # evict exactly down to the budget
        assert len(victims) == max(0, over)
    if not (cfg.policy == "snapkv" and decode):
        assert kept <= expected_budget(cfg, n)


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(ALL), prompt=st.integers(1, 40), steps=st.integers(0, 30),
       budget=st.one_of(st.none(), st.integers(1, 30)), ratio=st.floats(0, 0.95),
       sinks=st.one_of(st.none(), st.integers(0, 6)), frac=st.floats(0, 1),
       sh=st.tuples(st.integers(1, 8), st.integers(0, 5), st.one_of(st.none(), st.integers(0, 8))),
       snap=st.tuples(st.integers(1, 6), st.sampled_from([1, 3, 5])),
       lh=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_property_budget_and_protection(name, prompt, steps, budget, ratio, sinks, frac, sh, snap,
                                        lh, seed):
    cfg = KVEvictionConfig(policy=name, budget_tokens=budget, eviction_ratio=ratio,
                           sink_tokens=sinks, recent_fraction=frac, scissorhands_window=sh[0],
                           scissorhands_recent=sh[1], scissorhands_drop=sh[2],
                           snapkv_window=snap[0], snapkv_kernel=snap[1], seed=seed % 7,
                           min_tokens=0)
    p, rng = make_policy(cfg, f"req-{seed}", lh), np.random.default_rng(seed)
    live = np.arange(prompt, dtype=np.int64)
    colsum = rng.random(prompt).astype(np.float32) * lh if p.needs_attention_stats else None
    victims = p.on_prefill(live, colsum, prompt)
    check_step(p, cfg, live, victims, prompt, decode=False)
    live = np.setdiff1d(live, victims)
    for n in range(prompt + 1, prompt + steps + 1):
        live = np.append(live, n - 1)
        mass = None
        if p.needs_decode_stats:         # a(j): sum over L*H heads of probabilities over live keys
            mass = rng.dirichlet(np.full(len(live), 0.3), size=lh).sum(0).astype(np.float32)
        victims = p.on_decode(live, mass, n)
        check_step(p, cfg, live, victims, n, decode=True)
        live = np.setdiff1d(live, victims)


# ---------------------------------------------------------------- K-norm and KeyDiff (score-free)

def test_knorm_worked_example():
    """Budget 3 of 5 live tokens: the two largest key norms go, the newest token never does."""
    p = policy("knorm", budget_tokens=3)
    assert not p.needs_attention_stats and p.key_statistic == "norm"
    live = ids(0, 1, 2, 3, 4)
    p.observe_key_statistic(live, f32(0.5, 3.0, 1.0, 2.0, 9.0))
    assert p.on_prefill(live, None, 5).tolist() == [1, 3]
    # one decode step later: token 5 arrives, one over budget -> the 9.0 of token 4 goes
    live = ids(0, 2, 4, 5)
    p.observe_key_statistic(live, f32(0.5, 1.0, 9.0, 0.1))
    assert p.on_decode(live, None, 6).tolist() == [4]
    # ties fall to the older token; sinks are protected
    q = policy("knorm", budget_tokens=3, sink_tokens=1)
    q.observe_key_statistic(live := ids(0, 1, 2, 3, 4), f32(7, 2, 2, 1, 1))
    assert q.on_prefill(live, None, 5).tolist() == [1, 2]


def test_keydiff_worked_example():
    """Budget 3 of 5 live tokens: the two keys most similar to the mean key go, the newest never."""
    p = policy("keydiff", budget_tokens=3)
    assert not p.needs_attention_stats and p.key_statistic == "similarity"
    live = ids(0, 1, 2, 3, 4)
    p.observe_key_statistic(live, f32(0.2, 0.9, 0.1, 0.8, 0.95))
    assert p.on_prefill(live, None, 5).tolist() == [1, 3]
    # one decode step later the anchor moved: new similarities for the new view
    live = ids(0, 2, 4, 5)
    p.observe_key_statistic(live, f32(0.3, 0.7, 0.6, 0.99))
    assert p.on_decode(live, None, 6).tolist() == [2]
    # ties fall to the older token; sinks are protected
    q = policy("keydiff", budget_tokens=3, sink_tokens=1)
    q.observe_key_statistic(live := ids(0, 1, 2, 3, 4), f32(0.9, 0.5, 0.5, 0.1, 0.1))
    assert q.on_prefill(live, None, 5).tolist() == [1, 2]


@pytest.mark.parametrize("name", ["knorm", "keydiff"])
def test_key_score_policies_refuse_a_stale_statistic(name):
    p = policy(name, budget_tokens=2)
    p.observe_key_statistic(ids(0, 1, 2), f32(0.1, 0.2, 0.3))
    with pytest.raises(AssertionError, match="this step's key statistic"):
        p.on_decode(ids(0, 1, 2, 3), None, 4)
    assert p.on_decode(ids(0, 3), None, 4).size == 0           # under budget: nothing needed


def test_snapkv_compresses_each_streamed_chunk_but_not_single_decodes():
    """A streamed prompt chunk brings the votes of its last w queries (on_decode with scores);
    a plain decode step brings none and evicts nothing."""
    p = policy("snapkv", budget_tokens=4, snapkv_window=2, snapkv_kernel=1)
    live = ids(0, 1, 2, 3, 4, 5, 6, 7)
    votes = f32(5, 0, 4, 1, 3, 0, 9, 9)
    # over 4, the window (6, 7) kept, lowest votes first: 1 (0), 5 (0), 3 (1), 4 (3)
    assert p.on_decode(live, votes, 8).tolist() == [1, 3, 4, 5]
    assert p.on_decode(live, None, 8).size == 0
