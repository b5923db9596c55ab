"""Scope, interval and whose budget counts (docs/eviction-policies.md):

- --kv-evict-scope generated: no prompt token is ever evicted, budgets count generated tokens, and
  every policy (H2O included) takes prefix-cache hits on the prompt;
- --kv-evict-interval N: a request evicts once its counted live tokens reach budget + N, back down
  to the budget;
- a budget the user names is not raised by the default floor; a floor the operator names is.
"""
import argparse

import httpx
import numpy as np
import pytest

from tests.conftest import random_prompts
from tests.server_utils import chat_model_dir, serve, wait_until_clean
from vllm import KVEvictionParams, LLM, SamplingParams
from vllm.config import KVEvictionConfig
from vllm.core.eviction import policy_names
from vllm.core.eviction import make_policy
from vllm.engine.arg_utils import EngineArgs

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
GENERATED = [p for p in policy_names() if p not in ("none", "snapkv")]   # snapkv: refused


def ids(*xs):
    return np.array(xs, np.int64)


def policy(name, prompt_len=0, **kw):
    kw.setdefault("min_tokens", 0)
    return make_policy(KVEvictionConfig(policy=name, **kw), "req-0", 1, prompt_len)


# ---- worked examples: scope -------------------------------------------------------------------
def test_streamingllm_under_scope_generated_keeps_the_prompt_and_the_newest_budget():
    """Prompt 0..3 (it holds the 4 sinks), generated 4..9, budget 3: the prompt and the 3 newest
    generated tokens stay. Under scope all the same budget counts the sinks: 4 + 3 newest."""
    gen = policy("streamingllm", prompt_len=4, scope="generated", budget_tokens=3)
    assert gen.budget(10) == 3 and gen.sinks == 0 and gen.first_evictable == 4
    assert gen.on_decode(ids(*range(10)), None, 10).tolist() == [4, 5, 6]
    every = policy("streamingllm", prompt_len=4, budget_tokens=7)
    assert every.on_decode(ids(*range(10)), None, 10).tolist() == [4, 5, 6]
    assert policy("streamingllm", budget_tokens=3).on_decode(ids(*range(10)), None, 10).tolist() \
        == [4, 5, 6, 7, 8]                          # 4 sinks + newest, the budget's minimum


def test_h2o_under_scope_generated_scores_only_generated_tokens():
    """Prompt 0..2, generated 3..5, budget 2 (recent window 1): the new token 5 stays, 3 and 4
    compete on their scores (.2 > .05): 4 goes. Under scope all with budget 2 the prompt goes
    too, whatever its mass."""
    mass = np.array([.5, .1, .1, .2, .05, .05], np.float32)
    gen = policy("h2o", prompt_len=3, scope="generated", budget_tokens=2)
    assert gen.on_decode(ids(*range(6)), mass, 6).tolist() == [4]
    every = policy("h2o", prompt_len=3, budget_tokens=2)
    assert every.on_decode(ids(*range(6)), mass, 6).tolist() == [1, 2, 3, 4]


def test_ratio_under_scope_generated_counts_generated_tokens():
    """Ratio 0.5 with a 100-token prompt and 20 generated: 10 generated tokens may stay."""
    gen = policy("random", prompt_len=100, scope="generated", eviction_ratio=0.5)
    assert gen.budget(120) == 10
    victims = gen.on_decode(ids(*range(120)), None, 120)
    assert len(victims) == 10 and victims.min() >= 100


@pytest.mark.parametrize("name", ["h2o", "tova", "scissorhands", "random", "streamingllm"])
def test_scope_generated_never_names_a_prompt_token(name):
    rng = np.random.default_rng(0)
    p = policy(name, prompt_len=12, scope="generated", budget_tokens=4, scissorhands_recent=1)
    live = ids(*range(13))
    for n in range(13, 60):
        victims = p.on_decode(live, rng.random(len(live)).astype(np.float32), n)
        assert victims.size == 0 or victims.min() >= 12
        live = np.append(np.setdiff1d(live, victims), n)
        assert len(live) - 12 <= 4 + 1                 # the budget plus the new token


def test_snapkv_under_scope_generated_is_refused():
    with pytest.raises(ValueError, match="--kv-evict-scope: snapkv"):
        KVEvictionConfig(policy="snapkv", scope="generated")
    with pytest.raises(ValueError, match="kv_evict_scope"):
        KVEvictionParams(scope="generated").apply(KVEvictionConfig(policy="snapkv"))
    with pytest.raises(ValueError, match="--kv-evict-scope"):
        KVEvictionConfig(scope="prompt")
    with pytest.raises(ValueError, match="kv_evict_interval"):
        KVEvictionParams(interval=0)


# ---- worked examples: interval ----------------------------------------------------------------
def test_interval_evicts_at_budget_plus_n_back_to_the_budget():
    """Budget 4, interval 3, one token a step: nothing while 5 or 6 live, 3 at 7 (back to 4)."""
    p = policy("streamingllm", sink_tokens=0, budget_tokens=4, interval=3)
    assert p.on_decode(ids(0, 1, 2, 3, 4), None, 5).size == 0
    assert p.on_decode(ids(0, 1, 2, 3, 4, 5), None, 6).size == 0
    assert p.on_decode(ids(*range(7)), None, 7).tolist() == [0, 1, 2]
    assert p.over_budget(6, 100) == 0 and p.over_budget(7, 100) == 3 and p.over_budget(9, 9) == 5


def test_scissorhands_with_an_interval_drops_at_least_its_m():
    """Budget 6, m 3, interval 2: 7 live is under budget + 2; at 8 it drops max(2, 3) = 3."""
    p = policy("scissorhands", budget_tokens=6, scissorhands_drop=3, scissorhands_recent=1,
               interval=2)
    uniform = np.full(7, 1 / 7, np.float32)
    assert p.on_decode(ids(*range(7)), uniform, 7).size == 0
    assert len(p.on_decode(ids(*range(8)), np.full(8, 1 / 8, np.float32), 8)) == 3


# ---- engines ------------------------------------------------------------------------------------
PROMPTS = random_prompts(3, seed=61, lo=30, hi=60)


def _run(model, prompts, **kw):
    """-> (LLM, (sequence, its RequestKV) per prompt, each one's most live tokens)."""
    llm = LLM(model, num_gpu_blocks_override=256, kv_check_invariants=True, kv_eviction_log=True,
              kv_min_tokens=0, **kw)
    eng = llm.llm_engine
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, GREEDY)
    seqs = [eng.requests[f"r{i}"].seqs[0] for i in range(len(prompts))]
    kvs = [eng.kv.requests[s.seq_id] for s in seqs]
    live_max = [0] * len(prompts)
    while eng.has_unfinished_requests():
        eng.step()
        for i, s in enumerate(seqs):
            if s.seq_id in eng.kv.bm.token_table:
                live_max[i] = max(live_max[i], eng.kv.bm.token_table.num_live(s.seq_id))
    return llm, list(zip(seqs, kvs)), live_max


@pytest.mark.parametrize("name", GENERATED)
def test_scope_generated_keeps_every_prompt_token_live(tiny_llama, name):
    _, seqs, live_max = _run(tiny_llama, PROMPTS, kv_eviction_policy=name, kv_budget_tokens=8,
                             kv_evict_scope="generated")
    for (s, kv), peak in zip(seqs, live_max):
        evicted = np.concatenate(kv.eviction_log) if kv.eviction_log else ids()
        assert len(evicted) > 0 and evicted.min() >= s.num_prompt_tokens, name
        budget = kv.policy.budget(s.num_tokens)           # 8, or a policy's larger minimum
        assert budget == max(8, kv.policy.recent_minimum)
        assert peak <= s.num_prompt_tokens + budget + 1, name   # plus the new token


@pytest.mark.parametrize("interval", [1, 5])
@pytest.mark.parametrize("scope", ["all", "generated"])
def test_interval_evicts_only_at_budget_plus_n(tiny_llama, scope, interval):
    """A fixed budget with a one-in-one-out policy: every eviction takes exactly N tokens, past
    the prompt's own (bulk) eviction under scope all."""
    _, seqs, _ = _run(tiny_llama, PROMPTS, kv_eviction_policy="streamingllm", kv_budget_tokens=8,
                      kv_evict_scope=scope, kv_evict_interval=interval)
    for _, kv in seqs:
        sizes = [len(e) for e in kv.eviction_log]
        decode = sizes[1:] if scope == "all" else sizes
        assert decode and set(decode) == {interval}, sizes


@pytest.mark.parametrize("scope,interval", [("all", 1), ("generated", 1), ("generated", 4),
                                            ("all", 16)])
@pytest.mark.parametrize("name", ["h2o", "scissorhands", "keydiff"])
def test_naive_evict_equals_vtoken_under_every_scope_and_interval(tiny_llama, name, scope,
                                                                  interval):
    out = {}
    for mode in ("none", "vtoken", "vtoken-fill"):
        _, seqs, _ = _run(tiny_llama, PROMPTS, kv_eviction_policy=name, kv_budget_tokens=12,
                          kv_evict_scope=scope, kv_evict_interval=interval, kv_reclamation=mode,
                          kv_frag_threshold=0.0)
        out[mode] = [(s.output_token_ids, [e.tolist() for e in kv.eviction_log])
                     for s, kv in seqs]
    assert out["none"] == out["vtoken"] == out["vtoken-fill"]
    assert all(log for _, log in out["none"])


def test_h2o_under_scope_generated_takes_prefix_cache_hits(tiny_llama):
    """A repeated prompt: hits on its blocks, and the tokens of its first run."""
    prompt = random_prompts(1, seed=62, lo=70, hi=71)[0]
    llm = LLM(tiny_llama, num_gpu_blocks_override=256, enable_prefix_caching=True,
              kv_eviction_policy="h2o", kv_budget_tokens=8, kv_evict_scope="generated",
              kv_check_invariants=True)
    first = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    assert llm.get_kv_stats()["prefix_cache_hit_blocks"] == 0
    again = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    assert llm.get_kv_stats()["prefix_cache_hit_blocks"] >= 70 // 16
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert first.kv_stats["evicted_tokens"] > 0
    # under scope all, H2O scores every prompt query: no hits
    llm = LLM(tiny_llama, num_gpu_blocks_override=256, enable_prefix_caching=True,
              kv_eviction_policy="h2o", kv_budget_tokens=8, kv_min_tokens=0)
    for _ in range(2):
        llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    assert llm.get_kv_stats()["prefix_cache_hit_blocks"] == 0


# ---- whose budget -------------------------------------------------------------------------------
def _budget(llm, prompt, **kw):
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False, **kw)[0]
    return out.kv_stats["budget_tokens"], out.kv_stats["evicted_tokens"]


def test_a_named_budget_is_not_raised_by_the_default_floor(tiny_llama):
    prompt = random_prompts(1, seed=63, lo=100, hi=101)[0]
    named = LLM(tiny_llama, num_gpu_blocks_override=256, kv_eviction_policy="h2o",
                kv_budget_tokens=32)
    assert named.llm_engine.kv_config.floor == 0
    budget, evicted = _budget(named, prompt)
    assert budget == 32 and evicted > 0
    floored = LLM(tiny_llama, num_gpu_blocks_override=256, kv_eviction_policy="h2o",
                  kv_budget_tokens=32, kv_min_tokens=64)          # the operator's floor applies
    assert _budget(floored, prompt)[0] == 64
    ratio = LLM(tiny_llama, num_gpu_blocks_override=256, kv_eviction_policy="h2o")
    assert _budget(ratio, prompt) == (512, 0)                   # the default floor under a ratio
    # per request: a named budget over the ratio engine's default floor; the operator's floor
    assert _budget(ratio, prompt, kv_eviction=KVEvictionParams(budget_tokens=32))[0] == 32
    assert _budget(floored, prompt, kv_eviction=KVEvictionParams(budget_tokens=16))[0] == 64
    # scope generated reports the prompt plus the generated budget
    assert _budget(named, prompt, kv_eviction=KVEvictionParams(scope="generated"))[0] == 132


def test_cli_floor_is_named_only_when_given():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    unnamed = EngineArgs.from_cli_args(parser.parse_args(["--kv-budget-tokens", "32"]))
    assert unnamed.eviction_config().floor == 0
    named = EngineArgs.from_cli_args(parser.parse_args(["--kv-budget-tokens", "32",
                                                        "--kv-min-tokens", "64"]))
    assert named.eviction_config().floor == 64
    args = parser.parse_args(["--kv-evict-scope", "generated", "--kv-evict-interval", "16"])
    cfg = EngineArgs.from_cli_args(args).eviction_config()
    assert (cfg.scope, cfg.interval, cfg.floor) == ("generated", 16, 512)


@pytest.fixture(scope="module")
def floored_server(tiny_llama, tmp_path_factory):
    """Started with --kv-min-tokens 48: the operator's floor."""
    model = chat_model_dir(tiny_llama, str(tmp_path_factory.mktemp("scope") / "chat"))
    engine, srv = serve(model, num_gpu_blocks_override=256, kv_check_invariants=True,
                        kv_min_tokens=48)
    with srv:
        yield srv, engine
        wait_until_clean(engine)


LONG = " ".join(f"w{t}" for t in random_prompts(1, seed=64, lo=100, hi=101)[0])


@pytest.mark.parametrize("body,budget", [
    ({"kv_budget_tokens": 32}, 48),                              # the operator's floor wins
    ({"kv_budget_tokens": 32, "kv_min_tokens": 0}, 32),
    ({"kv_budget_tokens": 64}, 64)])
def test_server_reports_the_effective_budget(floored_server, body, budget):
    srv, engine = floored_server
    r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": LONG, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
        "kv_eviction_policy": "h2o", "kv_usage": True, **body})
    assert r.status_code == 200, r.text
    kv = r.json()["usage"]["kv"]
    assert kv["budget_tokens"] == budget and kv["evicted_tokens"] > 0
    wait_until_clean(engine)


def test_server_scope_generated_and_interval_in_the_body(floored_server):
    srv, engine = floored_server
    r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": LONG, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
        "kv_eviction_policy": "h2o", "kv_budget_tokens": 4, "kv_min_tokens": 0,
        "kv_evict_scope": "generated", "kv_evict_interval": 4, "kv_usage": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["kv"]["budget_tokens"] == usage["prompt_tokens"] + 4
    assert usage["kv"]["evicted_tokens"] > 0
    for field, value in (("kv_evict_scope", "prompt"), ("kv_evict_interval", 0)):
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "w5 w6", "max_tokens": 2, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field
    r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "w5 w6", "max_tokens": 2, "kv_eviction_policy": "snapkv",
        "kv_evict_scope": "generated"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_evict_scope"
    wait_until_clean(engine)


def test_scope_generated_with_a_prefill_chunk_runs_the_policy_after_the_prompt(tiny_llama):
    """--kv-prefill-chunk streams a prompt only where it may evict: under scope generated the
    prompt is computed as without a policy and the policy first runs on generated tokens."""
    _, seqs, _ = _run(tiny_llama, PROMPTS, kv_eviction_policy="tova", kv_budget_tokens=6,
                      kv_evict_scope="generated", kv_prefill_chunk=8)
    for s, kv in seqs:
        assert kv.eviction_log and np.concatenate(kv.eviction_log).min() >= s.num_prompt_tokens
