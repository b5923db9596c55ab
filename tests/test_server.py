"""The OpenAI-compatible server on a tiny model, driven by the openai client and raw httpx."""
import json

import httpx
import openai
import pytest

import vllm
from tests.server_utils import (CHAT_TEMPLATE, chat_model_dir, openai_client, serve, served,
                                wait_until_clean)
from vllm import LLM, SamplingParams

PROMPTS = ["w10 w20 w30 w40", "w7 w8 w9 w100 w200 w300 w400 w5", "w450 w3"]
MESSAGES = [{"role": "system", "content": "w11 w12"}, {"role": "user", "content": "w13 w14 w15"}]


@pytest.fixture(scope="module")
def model_dir(tiny_llama, tmp_path_factory):
    return chat_model_dir(tiny_llama, str(tmp_path_factory.mktemp("chat") / "llama"))


@pytest.fixture(scope="module")
def server(model_dir):
    yield from served(model_dir, max_num_seqs=32)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, num_gpu_blocks_override=512)


def greedy(max_tokens=12, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def sse_events(text: str):
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# ---- basic routes ----------------------------------------------------------------------------
def test_models_health_version(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json() == {"version": vllm.__version__}
    info = server.engine.engine.get_engine_info()       # the engine's own, not /version's
    assert info["cpu"] and info["cpu_kernels"] in ("avx512", "avx2", "generic", "off")


# ---- outputs equal the offline API ------------------------------------------------------------
def test_completion_greedy_matches_llm_generate(server, client, llm):
    ref = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    for prompt, r in zip(PROMPTS, ref):
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert out.choices[0].text == r.outputs[0].text
        assert out.choices[0].finish_reason == "length"
        assert out.usage.prompt_tokens == len(r.prompt_token_ids)
        assert out.usage.completion_tokens == 12
    # token-id prompts and a batch of prompts give the same texts
    ids = [r.prompt_token_ids for r in ref]
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == \
        [r.outputs[0].text for r in ref]
    assert out.usage.completion_tokens == 12 * len(PROMPTS)
    assert out.usage.total_tokens == sum(map(len, ids)) + 12 * len(PROMPTS)


def test_chat_greedy_matches_llm_chat(server, client, llm):
    ref = llm.chat(MESSAGES, greedy(10), use_tqdm=False)[0]
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.outputs[0].text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == 10
    assert out.usage.total_tokens == len(ref.prompt_token_ids) + 10


# ---- streaming -------------------------------------------------------------------------------
def test_completion_stream_sse(server, client):
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 9, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 9
    usage = events[-1]["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + 9 and usage["prompt_tokens"] > 0
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    whole = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=9,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert text == whole.choices[0].text
    # the openai client reads the same stream
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=9,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == text


def test_chat_stream(server, client):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
              extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length"


# ---- sampling options ------------------------------------------------------------------------
def test_logprobs_completion_and_stream(server, client):
    out = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=6,
                                    temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tlp <= 0 and 3 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(tlp)     # greedy: the token is the argmax
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=6,
                                            temperature=0, logprobs=3, stream=True,
                                            extra_body={"ignore_eos": True}))
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens


def test_logprobs_chat(server, client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5,
                                         temperature=0, logprobs=True, top_logprobs=2,
                                         extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert len(item.top_logprobs) == 2 and item.logprob <= 0
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert item.bytes == list(item.token.encode())


def test_n_and_seed(server, client):
    kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=8, n=3, temperature=1.0, seed=1234,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 24
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, n=2,
                                          seed=5, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_stop_strings(server, client):
    free = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=12,
                                     temperature=0, extra_body={"ignore_eos": True})
    words = free.choices[0].text.split()
    stop = words[4]
    expect = free.choices[0].text[:free.choices[0].text.index(stop)]
    kw = dict(model="tiny", prompt=PROMPTS[2], max_tokens=12, temperature=0, stop=[stop],
              extra_body={"ignore_eos": True})
    out = client.completions.create(**kw)
    assert out.choices[0].text == expect
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].stop_reason == stop
    streamed = "".join(c.choices[0].text
                       for c in client.completions.create(stream=True, **kw))
    assert streamed == expect     # the stop string never leaks into the stream


def test_extra_sampling_fields(server, client, llm):
    ref = llm.generate(PROMPTS[0], greedy(), use_tqdm=False)[0].outputs[0]
    base = dict(model="tiny", prompt=PROMPTS[0], max_tokens=12)
    # top_k=1 and min_p=1 both reduce sampling to greedy
    for extra in ({"top_k": 1, "ignore_eos": True}, {"min_p": 1.0, "ignore_eos": True}):
        out = client.completions.create(temperature=1.0, extra_body=extra, **base)
        assert out.choices[0].text == ref.text
    # stop_token_ids stops at the third greedy token; min_tokens defers it
    third = ref.token_ids[2]
    out = client.completions.create(temperature=0, extra_body={"stop_token_ids": [third],
                                                               "ignore_eos": True}, **base)
    assert out.choices[0].finish_reason == "stop" and out.choices[0].stop_reason == third
    assert out.usage.completion_tokens == ref.token_ids.index(third) + 1
    out = client.completions.create(
        temperature=0, extra_body={"stop_token_ids": [ref.token_ids[0]], "min_tokens": 5,
                                   "ignore_eos": True}, **base)
    assert out.usage.completion_tokens >= 5


def test_penalties_and_logit_bias(server, client, llm):
    base = dict(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    forced = client.completions.create(logit_bias={"7": 100}, extra_body={"ignore_eos": True},
                                       **base)
    assert llm.get_tokenizer().encode(forced.choices[0].text, add_special_tokens=False) == [7] * 12
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                            repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.3)
    ref = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    out = client.completions.create(frequency_penalty=0.5, presence_penalty=0.3,
                                    extra_body={"repetition_penalty": 1.5, "ignore_eos": True},
                                    **base)
    assert out.choices[0].text == ref.text


def test_echo(server, client):
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4,
                                    temperature=0, echo=True, extra_body={"ignore_eos": True})
    assert out.choices[0].text.startswith(PROMPTS[0])


def test_tokenize_detokenize(server, llm):
    r = post(server, "/tokenize", {"model": "tiny", "prompt": PROMPTS[1]}).json()
    assert r["tokens"] == llm.get_tokenizer().encode(PROMPTS[1]) and r["count"] == 8
    assert r["max_model_len"] == 1024
    d = post(server, "/detokenize", {"model": "tiny", "tokens": r["tokens"]}).json()
    assert d["prompt"] == PROMPTS[1]
    chat = post(server, "/tokenize", {"model": "tiny", "messages": MESSAGES}).json()
    assert chat["tokens"] == llm.apply_chat_template(MESSAGES)["prompt_token_ids"]


# ---- errors ------------------------------------------------------------------------------------
BAD_REQUESTS = [
    ("/v1/completions", b'{"model": "tiny", "prompt": "w5", ', "body"),          # malformed JSON
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": 5}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": " ".join(["w9"] * 1024)}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "max_tokens": 1024}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [3, 99999]}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "temperature": -1}, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "top_k": -7}, "top_k"),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "n": 0}, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "presence_penalty": 2.5},
     "presence_penalty"),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "repetition_penalty": 0},
     "repetition_penalty"),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "logit_bias": {"99999": 1}},
     "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "min_tokens": 9, "max_tokens": 2},
     "min_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "stop": [""]}, "stop"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "tiny"}, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"content": "w5"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 0},
     "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "top_logprobs": 2},
     "top_logprobs"),
    ("/detokenize", {"model": "tiny", "tokens": [-1]}, "tokens"),
]


@pytest.mark.parametrize("path,body,param", BAD_REQUESTS)
def test_bad_requests_are_400(server, path, body, param):
    if isinstance(body, bytes):
        r = httpx.post(server.url + path, content=body, timeout=30,
                       headers={"content-type": "application/json"})
    else:
        r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param


def test_unknown_route_404_and_still_serving(server, client):
    r = httpx.get(server.url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert httpx.get(server.url + "/v1/completions").status_code == 405
    out = client.completions.create(model="tiny", prompt="w5 w6", max_tokens=3,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3
    wait_until_clean(server.engine)


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=3)


@pytest.mark.parametrize("path,body", [("/v1/completions", {"model": "nope", "prompt": "w5"}),
                                       ("/v1/chat/completions",
                                        {"model": "nope", "messages": MESSAGES})])
def test_unknown_model_is_404(server, client, path, body):
    """upstream's choice: an unknown model is a 404 (NotFoundError), naming the model."""
    r = post(server, path, body)
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["type"] == "not_found_error" and err["param"] == "model"
    assert err["message"] == "The model `nope` does not exist."
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="w5")


def test_non_streaming_disconnect_aborts(server):
    before = _metric_values(httpx.get(server.url + "/metrics").text)
    body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.3)
    wait_until_clean(server.engine, timeout=10)
    after = _metric_values(httpx.get(server.url + "/metrics").text)
    key = 'vllm:generation_tokens_total{engine="0",model_name="tiny"}'
    assert after[key] - before[key] < 500        # aborted, not run to 1000 tokens


def test_engine_step_error_fails_request_not_server(server, client):
    engine = server.engine.engine
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected step failure")
        return real_step()

    engine.step = flaky_step
    try:
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model="tiny", prompt="w5 w6", max_tokens=5,
                                      extra_body={"ignore_eos": True})
    finally:
        del engine.step
    wait_until_clean(server.engine)
    out = client.completions.create(model="tiny", prompt="w5 w6", max_tokens=5,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5
    assert server.engine.is_running


def test_metrics(server, client):
    client.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=4,
                              extra_body={"ignore_eos": True})
    text = httpx.get(server.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:kv_live_tokens",
                 "vllm:kv_memory_utilization", "vllm:kv_relocation_events_total",
                 "vllm:kv_relocated_tokens_total"):
        assert f"\n{name}{{" in text, name
    values = _metric_values(text)
    assert values['vllm:generation_tokens_total{engine="0",model_name="tiny"}'] >= 4
    assert values['vllm:prompt_tokens_total{engine="0",model_name="tiny"}'] >= 3
    assert values['vllm:kv_cache_usage_perc{engine="0",model_name="tiny"}'] == 0.0


def _metric_values(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_state_clean_after_module(server):
    wait_until_clean(server.engine)


# ---- auth --------------------------------------------------------------------------------------
def test_api_key(model_dir):
    engine, srv = serve(model_dir, api_key="s3cret", num_gpu_blocks_override=64)
    with srv:
        body = {"model": "tiny", "prompt": "w5", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.post(srv.url + "/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert httpx.get(srv.url + "/v1/models", headers=headers).status_code == 401
        assert httpx.get(srv.url + "/health").status_code == 200
        assert httpx.get(srv.url + "/metrics").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model="tiny", prompt="w5", max_tokens=2,
                                       extra_body={"ignore_eos": True}).usage.completion_tokens == 2
        wait_until_clean(engine)


# ---- vToken + H2O through the server ---------------------------------------------------------
def test_eviction_flags_through_server(model_dir):
    flags = dict(kv_eviction_policy="h2o", kv_eviction_ratio=0.5, kv_reclamation="vtoken",
                 kv_min_tokens=0,
                 kv_check_invariants=True, block_size=4, num_gpu_blocks_override=256)
    ref = LLM(model_dir, **flags).generate(PROMPTS, greedy(24), use_tqdm=False)
    engine, srv = serve(model_dir, **flags)
    with srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        for prompt, r in zip(PROMPTS, ref):
            out = client.completions.create(model="tiny", prompt=prompt, max_tokens=24,
                                            temperature=0, extra_body={"ignore_eos": True})
            assert out.choices[0].text == r.outputs[0].text
        values = _metric_values(httpx.get(srv.url + "/metrics").text)
        assert values['vllm:kv_evicted_tokens_total{engine="0",model_name="tiny"}'] > 0
        assert values['vllm:kv_relocation_events_total{engine="0",model_name="tiny"}'] > 0
        wait_until_clean(engine)


def test_chat_template_flag(tiny_llama):
    """A model without a chat template: 400 by default, works with --chat-template."""
    from tests.server_utils import make_engine, ServerThread
    from vllm.entrypoints.openai.api_server import build_app
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
    engine = make_engine(tiny_llama, num_gpu_blocks_override=64)
    with ServerThread(build_app(engine, ["tiny"], shutdown_engine=False)) as srv:
        assert httpx.post(srv.url + "/v1/chat/completions", json=body).status_code == 400
    with ServerThread(build_app(engine, ["tiny"], chat_template=CHAT_TEMPLATE)) as srv:
        assert httpx.post(srv.url + "/v1/chat/completions", json=body).status_code == 200


def test_request_that_outgrows_the_pool_is_an_openai_error(model_dir):
    """finish_reason kv_cache_exhausted never reaches a client as a finish reason: a 400 in the
    OpenAI shape (non-streaming) or an error event (streaming); the engine stays clean."""
    engine, srv = serve(model_dir, num_gpu_blocks_override=3, block_size=8)
    body = {"model": "tiny", "prompt": [5] * 10, "max_tokens": 50, "ignore_eos": True}
    with srv:
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "kv_cache_exhausted" and err["param"] == "max_tokens"
        r = httpx.post(srv.url + "/v1/completions", json=dict(body, stream=True), timeout=60)
        events = sse_events(r.text)
        assert any("error" in e and e["error"]["code"] == "kv_cache_exhausted"
                   for e in events if isinstance(e, dict))
        wait_until_clean(engine)


def test_engine_is_built_on_its_loop_thread(tiny_llama):
    """The LLMEngine is loaded by the thread that will step it (the CPU path runs ~25% slower
    when another thread steps it); it waits for start(), and shutdown() before start() ends it."""
    import threading
    from tests.server_utils import make_engine
    engine = make_engine(tiny_llama, num_gpu_blocks_override=32)
    builder = engine._thread
    assert builder.is_alive() and not engine.is_running
    engine.start()
    assert engine.is_running and engine._thread is builder
    assert engine.call(lambda e: threading.current_thread()).result(timeout=10) is builder
    engine.shutdown()
    assert not builder.is_alive()
    idle = make_engine(tiny_llama, num_gpu_blocks_override=32)
    idle.shutdown()
    assert not idle._thread or not idle._thread.is_alive()
