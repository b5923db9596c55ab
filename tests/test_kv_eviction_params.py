"""Eviction users can trust: a floor under every budget (short chats are never touched) and
per-request eviction settings through LLM.generate and both OpenAI endpoints."""
import httpx
import openai
import pytest

from tests.conftest import random_prompts
from tests.server_utils import chat_model_dir, serve, wait_until_clean
from vllm import KVEvictionParams, LLM, SamplingParams
from vllm.config import KVEvictionConfig
from vllm.core.eviction import token_budget

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def generate(llm, prompts, **kw):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, **kw)
    return [o.outputs[0].token_ids for o in outs], [o.kv_stats["evicted_tokens"] for o in outs]


# ---- the floor ------------------------------------------------------------------------------------
def test_budget_floor():
    cfg = KVEvictionConfig(policy="h2o", eviction_ratio=0.5, min_tokens=100)
    assert token_budget(cfg, 60, 1) == 100          # short: everything stays
    assert token_budget(cfg, 300, 1) == 150         # long: the ratio bites
    assert token_budget(KVEvictionConfig(policy="h2o", budget_tokens=64, min_tokens=100),
                        300, 1) == 100              # the floor wins over a smaller fixed budget
    with pytest.raises(ValueError, match="--kv-min-tokens"):
        KVEvictionConfig(policy="h2o", min_tokens=-1)


@pytest.mark.parametrize("policy", ["h2o", "tova", "snapkv", "scissorhands", "streamingllm",
                                    "random"])
def test_default_floor_leaves_short_requests_untouched(tiny_llama, policy):
    """LLM(kv_eviction_policy=...) with the default floor: a short request is answered exactly as
    without eviction; a long one is still bounded."""
    prompts = random_prompts(3, seed=51, lo=30, hi=90)
    native, _ = generate(LLM(tiny_llama, num_gpu_blocks_override=256), prompts)
    llm = LLM(tiny_llama, kv_eviction_policy=policy, num_gpu_blocks_override=256)
    tokens, evicted = generate(llm, prompts)
    assert tokens == native and evicted == [0, 0, 0]
    long_prompt = random_prompts(1, seed=52, lo=700, hi=701)
    _, (evicted,) = generate(llm, long_prompt)
    assert evicted > 0
    assert llm.llm_engine.kv_config.floor == 512


# ---- per request, offline ------------------------------------------------------------------------
def test_per_request_settings_match_engine_wide_ones(tiny_llama):
    prompts = random_prompts(3, seed=53, lo=80, hi=120)
    h2o = KVEvictionParams(policy="h2o", eviction_ratio=0.5, min_tokens=0)
    tova = KVEvictionParams(policy="tova", budget_tokens=40, min_tokens=0)
    llm = LLM(tiny_llama, num_gpu_blocks_override=256, kv_check_invariants=True)  # no policy
    mixed, evicted = generate(llm, prompts, kv_eviction=[h2o, None, tova])
    alone = [generate(LLM(tiny_llama, num_gpu_blocks_override=256, kv_min_tokens=0, **kw),
                      [p])[0][0]
             for p, kw in zip(prompts, [dict(kv_eviction_policy="h2o"), {},
                                        dict(kv_eviction_policy="tova", kv_budget_tokens=40)])]
    assert mixed == alone
    assert evicted[0] > 0 and evicted[1] == 0 and evicted[2] > 0
    # and the other way round: a request opts out on an evicting engine
    llm = LLM(tiny_llama, num_gpu_blocks_override=256, kv_eviction_policy="h2o", kv_min_tokens=0)
    _, evicted = generate(llm, prompts[:1], kv_eviction=KVEvictionParams(policy="none"))
    assert evicted == [0]


@pytest.mark.parametrize("kwargs,field", [
    (dict(policy="lru"), "kv_eviction_policy"), (dict(eviction_ratio=1.0), "kv_eviction_ratio"),
    (dict(eviction_ratio=-0.5), "kv_eviction_ratio"), (dict(budget_tokens=0), "kv_budget_tokens"),
    (dict(min_tokens=-1), "kv_min_tokens"), (dict(prefill_chunk=0), "kv_prefill_chunk")])
def test_bad_per_request_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        KVEvictionParams(**kwargs)


def test_per_request_list_length_must_match(tiny_llama):
    llm = LLM(tiny_llama, num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match="kv_eviction settings"):
        llm.generate([[5, 6], [7, 8]], GREEDY, kv_eviction=[None])
    assert not llm.llm_engine.has_unfinished_requests()


# ---- per request, through the server -------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    """A server started without an eviction policy."""
    model = chat_model_dir(tiny_llama, str(tmp_path_factory.mktemp("kvp") / "chat"))
    engine, srv = serve(model, num_gpu_blocks_override=256, kv_check_invariants=True)
    with srv:
        yield srv, engine
        wait_until_clean(engine)


EVICT = {"kv_eviction_policy": "h2o", "kv_eviction_ratio": 0.5, "kv_min_tokens": 0}
ASK = {"ignore_eos": True, "kv_usage": True}      # usage.kv is reported when asked for
LONG_PROMPT = " ".join(f"w{t}" for t in random_prompts(1, seed=54, lo=100, hi=101)[0])


def test_completion_evicts_per_request_and_reports_kv(server):
    srv, engine = server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    plain = client.completions.create(model="tiny", prompt=LONG_PROMPT, max_tokens=8,
                                      temperature=0, extra_body=ASK)
    evicting = client.completions.create(model="tiny", prompt=LONG_PROMPT, max_tokens=8,
                                         temperature=0, extra_body={**ASK, **EVICT})
    assert plain.usage.kv["evicted_tokens"] == 0
    kv = evicting.usage.kv                      # parsed by the official client (extra field)
    assert kv["evicted_tokens"] > 0 and kv["live_tokens"] + kv["evicted_tokens"] == \
        evicting.usage.total_tokens - 1 and kv["peak_blocks"] >= 1
    stream = client.completions.create(model="tiny", prompt=LONG_PROMPT, max_tokens=8,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={**ASK, **EVICT})
    chunks = list(stream)
    assert chunks[-1].usage.kv["evicted_tokens"] == kv["evicted_tokens"]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == evicting.choices[0].text
    wait_until_clean(engine)


def test_chat_evicts_per_request(server):
    srv, engine = server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    resp = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": LONG_PROMPT}], max_tokens=6,
        temperature=0, extra_body={**ASK, "kv_eviction_policy": "streamingllm",
                                   "kv_budget_tokens": 32, "kv_min_tokens": 0})
    assert resp.usage.kv["evicted_tokens"] > 0 and resp.usage.kv["live_tokens"] == 32
    wait_until_clean(engine)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field,value", [("kv_eviction_policy", "lru"),
                                         ("kv_eviction_ratio", 1.5), ("kv_eviction_ratio", -0.1),
                                         ("kv_budget_tokens", 0), ("kv_min_tokens", -3),
                                         ("kv_prefill_chunk", 0)])
def test_bad_eviction_fields_are_400_naming_the_field(server, path, field, value):
    srv, engine = server
    body = {"model": "tiny", "max_tokens": 2, field: value}
    body.update({"prompt": "w5 w6"} if "chat" not in path else
                {"messages": [{"role": "user", "content": "w5"}]})
    r = httpx.post(srv.url + path, json=body, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == field
    wait_until_clean(engine)


def test_streamed_prompt_with_a_score_free_policy_through_the_server(server):
    """kv_prefill_chunk and keydiff in the body: the prompt evicts as it streams in, and the
    answer matches the same request through the LLM API."""
    srv, engine = server
    body = {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "kv_eviction_policy": "keydiff", "kv_budget_tokens": 24,
            "kv_min_tokens": 0, "kv_prefill_chunk": 16, "kv_usage": True}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["kv"]["live_tokens"] == 24
    assert usage["kv"]["evicted_tokens"] == usage["total_tokens"] - 1 - 24
    bad = dict(body, kv_prefill_chunk=-4)
    r = httpx.post(srv.url + "/v1/completions", json=bad, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_prefill_chunk"
    wait_until_clean(engine)
