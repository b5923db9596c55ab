"""The rest of upstream vLLM's OpenAI server surface, on a tiny model through the openai client
(raw httpx where the client cannot say it): token-level fields (prompt_logprobs, echo,
return_tokens_as_token_ids, allowed_token_ids), chat echo / continue_final_message, streaming
finish chunks and usage, server flags and routes, error wording, usage.kv opt-in, upstream's
response shapes (/version, system_fingerprint, added tokens, a forced tool call's content),
sleep mode (server, LLM, tensor parallelism) and the API key on every route.

Where upstream's behaviour is a choice (a status code, a message text) the test says so."""
import gc
import json
import os
import re
import subprocess
import threading
import time
import weakref

import httpx
import openai
import pytest
from transformers import AutoTokenizer

import vllm
from tests.server_utils import (ServerThread, chat_model_dir, interrupt, make_engine,
                                openai_client, serve, served, vllm_command, wait_healthy,
                                wait_until_clean)
from vllm import LLM, SamplingParams
from vllm.engine.llm_engine import EngineSleepingError
from vllm.entrypoints.openai.api_server import build_app
from vllm.entrypoints.openai.fingerprint import system_fingerprint
from vllm.entrypoints.openai.server_options import ServerOptions
from vllm.entrypoints.openai.tokenizer_info import ADDED_TOKEN_FIELDS, tokenizer_config

PROMPT = "w10 w20 w30 w40"
CHAT = [{"role": "user", "content": "w7"}, {"role": "assistant", "content": "w8 w9"}]
UPSTREAM_USAGE_KEYS = {"prompt_tokens", "completion_tokens", "total_tokens",
                       "prompt_tokens_details"}


@pytest.fixture(scope="module")
def model_dir(tiny_llama, tmp_path_factory):
    return chat_model_dir(tiny_llama, str(tmp_path_factory.mktemp("surface") / "llama"))


@pytest.fixture(scope="module")
def server(model_dir):
    yield from served(model_dir, max_num_seqs=32)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


@pytest.fixture(scope="module")
def flagged(model_dir):
    """A server with every server flag of this file on."""
    options = ServerOptions(root_path="/api", model_root="org/tiny-llama",
                            enable_server_load_tracking=True,
                            enable_tokenizer_info_endpoint=True,
                            return_tokens_as_token_ids=True, kv_usage_in_response=True)
    engine, srv = serve(model_dir, options=options, max_num_seqs=8)
    with srv:
        srv.engine = engine
        yield srv


def post(url, body, **kw):
    return httpx.post(url, json=body, timeout=60, **kw)


def sse_events(text: str):
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def encode(server, text: str):
    return post(server.url + "/tokenize", {"prompt": text, "add_special_tokens": False}
                ).json()["tokens"]


def assert_400(exc_info, text: str):
    assert exc_info.value.status_code == 400
    assert text in exc_info.value.message, exc_info.value.message


# ---- 1. log-probs and tokens --------------------------------------------------------------------
def test_prompt_logprobs_both_endpoints(server, client):
    ids = encode(server, PROMPT)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 2})
    plp = out.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None           # nothing predicts the first token
    for tok, entry in zip(ids[1:], plp[1:]):
        assert str(tok) in entry and 2 <= len(entry) <= 3     # the prompt token + the top 2
        assert entry[str(tok)]["decoded_token"] == f"w{tok}"
        assert entry[str(tok)]["logprob"] <= 0 and entry[str(tok)]["rank"] >= 1
    chat = client.chat.completions.create(model="tiny", messages=CHAT[:1], max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    top = chat.model_extra["prompt_logprobs"]                # upstream: at the top level
    assert len(top) == chat.usage.prompt_tokens and top[0] is None
    assert all(len(e) == 1 for e in top[1:])
    # upstream's choices: bounded by --max-logprobs, and not available when streaming
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, extra_body={"prompt_logprobs": 21})
    assert_400(e, "Requested prompt logprobs of 21, which is greater than max allowed: 20")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    assert_400(e, "`prompt_logprobs` are not available when `stream=True`.")


def test_prompt_logprobs_skip_the_prefix_cache(tiny_llama):
    """A cached prefix is never run, so it has no logprobs: a request that asks for them reads
    no cache (upstream does the same) and scores every prompt position, hit or not."""
    from vllm import LLM, SamplingParams
    llm = LLM(tiny_llama, enable_prefix_caching=True, block_size=4, num_gpu_blocks_override=64)
    prompt = [list(range(10, 22))]
    params = SamplingParams(max_tokens=2, prompt_logprobs=1)
    first, again = (llm.generate(prompt, params, use_tqdm=False)[0] for _ in range(2))
    assert len(first.prompt_logprobs) == len(again.prompt_logprobs) == 12
    for a, b in zip(first.prompt_logprobs[1:], again.prompt_logprobs[1:]):
        assert {t: v.logprob for t, v in a.items()} == pytest.approx(
            {t: v.logprob for t, v in b.items()})


def test_completion_echo_with_logprobs_covers_the_prompt(server, client):
    ids = encode(server, PROMPT)
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1, echo=True,
              extra_body={"ignore_eos": True})
    out = client.completions.create(**kw).choices[0]
    lp = out.logprobs
    assert out.text.startswith(PROMPT)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(ids) + 3
    assert lp.tokens[:len(ids)] == [f"w{t}" for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None   # first prompt token
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(out.text)
    plain = client.completions.create(**{**kw, "echo": False}).choices[0].logprobs
    assert lp.tokens[len(ids):] == plain.tokens
    assert lp.token_logprobs[len(ids):] == pytest.approx(plain.token_logprobs)
    # streamed: the prompt goes out with the first delta, the tokens are the same
    chunks = list(client.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    assert "".join(c.choices[0].text for c in chunks) == out.text


def test_chat_echo_continue_final_message_and_no_generation_prompt(server, client):
    # the prompt: continue_final_message ends inside the last message (template: w3 .. w4 ..)
    tok = post(server.url + "/tokenize", {"messages": CHAT, "continue_final_message": True,
                                          "add_generation_prompt": False}).json()["tokens"]
    assert tok == encode(server, "w3 w7 w4 w3 w8 w9")
    kw = dict(model="tiny", messages=CHAT, max_tokens=3, temperature=0,
              extra_body={"ignore_eos": True, "continue_final_message": True,
                          "add_generation_prompt": False, "echo": True})
    out = client.chat.completions.create(**kw)
    assert out.usage.prompt_tokens == len(tok)
    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.content.startswith("w8 w9")   # echoed, then more
    plain = client.chat.completions.create(**{**kw, "extra_body": {
        **kw["extra_body"], "echo": False}}).choices[0].message.content
    assert msg.content == "w8 w9" + plain
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[1].choices[0].delta.content == "w8 w9"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    # add_generation_prompt false: no w5; upstream's choice: the reply takes the last role
    out = client.chat.completions.create(model="tiny", messages=CHAT[:1], max_tokens=2,
                                         extra_body={"add_generation_prompt": False})
    assert out.usage.prompt_tokens == len(encode(server, "w3 w7 w4"))
    assert out.choices[0].message.role == "user"
    with pytest.raises(openai.BadRequestError) as e:          # upstream's text
        client.chat.completions.create(model="tiny", messages=CHAT, extra_body={
            "continue_final_message": True, "add_generation_prompt": True})
    assert_400(e, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")


def test_return_tokens_as_token_ids(server, client, flagged):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
              extra_body={"ignore_eos": True})
    text_lp = client.completions.create(**kw).choices[0].logprobs
    ids_lp = client.completions.create(**{**kw, "extra_body": {
        "ignore_eos": True, "return_tokens_as_token_ids": True}}).choices[0].logprobs
    assert ids_lp.tokens == [f"token_id:{t[1:]}" for t in text_lp.tokens]   # w<id> -> id
    assert all(re.fullmatch(r"token_id:\d+", k) for top in ids_lp.top_logprobs for k in top)
    chat = client.chat.completions.create(
        model="tiny", messages=CHAT[:1], max_tokens=3, logprobs=True, top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True})
    for item in chat.choices[0].logprobs.content:
        assert re.fullmatch(r"token_id:\d+", item.token)
        assert bytes(item.bytes).decode() == f"w{item.token.split(':')[1]}"   # bytes: the text
        assert all(t.token.startswith("token_id:") for t in item.top_logprobs)
    # the server flag (--return-tokens-as-token-ids) makes it the default; a request overrides
    url = flagged.url + "/api/v1/completions"
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 0,
            "ignore_eos": True}
    assert post(url, body).json()["choices"][0]["logprobs"]["tokens"] == ids_lp.tokens
    overridden = post(url, {**body, "return_tokens_as_token_ids": False}).json()
    assert overridden["choices"][0]["logprobs"]["tokens"] == text_lp.tokens


def test_allowed_token_ids(client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, n=2, seed=3,
                                    temperature=1.0, logprobs=0,
                                    extra_body={"allowed_token_ids": [7, 8], "ignore_eos": True})
    for c in out.choices:
        assert set(c.logprobs.tokens) <= {"w7", "w8"} and len(c.logprobs.tokens) == 12
    with pytest.raises(openai.BadRequestError) as e:          # upstream's text
        client.completions.create(model="tiny", prompt=PROMPT,
                                  extra_body={"allowed_token_ids": [7, 100000]})
    assert_400(e, "allowed_token_ids contains out-of-vocab token id!")
    assert e.value.body["param"] == "allowed_token_ids"


def test_tokenize_token_strs_and_tokenizer_info(server, flagged):
    r = post(server.url + "/tokenize", {"prompt": "w7 w300", "return_token_strs": True}).json()
    assert r["token_strs"][-2:] == ["w7", "w300"]
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"])
    assert post(server.url + "/tokenize", {"prompt": "w7"}).json()["token_strs"] is None
    # upstream serves /tokenizer_info only with --enable-tokenizer-info-endpoint
    assert httpx.get(server.url + "/tokenizer_info").status_code == 404
    info = httpx.get(flagged.url + "/api/tokenizer_info").json()
    assert info["tokenizer_class"] and info["eos_token"] == "</s>"
    assert "w3 {{ m['content'] }}" in info["chat_template"]
    assert "vocab_file" not in info and "tokenizer_file" not in info


# ---- 2. streaming ------------------------------------------------------------------------------
STAGGERED = {"allowed_token_ids": [7, 8], "stop_token_ids": [8], "seed": 2}


def _finish_chunks(events):
    return [(c["index"], c["finish_reason"]) for e in events for c in e["choices"]
            if c["finish_reason"] is not None]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_each_choice_finishes_once(server, path):
    """Samples that stop at different steps (stop token 8 among 7/8): one finish chunk each."""
    body = {"model": "tiny", "n": 4, "max_tokens": 40, "temperature": 1.0, "stream": True,
            **STAGGERED}
    body.update({"prompt": PROMPT} if "chat" not in path else {"messages": CHAT[:1]})
    events = sse_events(post(server.url + path, body).text)
    finishes = _finish_chunks(events)
    assert sorted(i for i, _ in finishes) == [0, 1, 2, 3]
    whole = post(server.url + path, {**body, "stream": False}).json()
    key = "text" if "chat" not in path else "message"
    lengths = {len((c[key] if key == "text" else c[key]["content"]).split())
               for c in whole["choices"]}
    assert len(lengths) > 1       # the samples did finish at different steps


def test_stream_options_rules(server, client):
    with pytest.raises(openai.BadRequestError) as e:          # upstream's text
        client.completions.create(model="tiny", prompt=PROMPT, stream=False,
                                  stream_options={"include_usage": True})
    assert_400(e, "Stream options can only be defined when `stream=True`.")
    base = {"model": "tiny", "messages": CHAT[:1], "max_tokens": 3, "stream": True,
            "ignore_eos": True}
    url = server.url + "/v1/chat/completions"
    # continuous usage needs include_usage: off -> no usage anywhere
    off = sse_events(post(url, {**base, "stream_options": {
        "include_usage": False, "continuous_usage_stats": True}}).text)
    assert all(e.get("usage") is None for e in off)
    # on: every chunk, the role chunk included (no completion tokens yet), then the total
    on = sse_events(post(url, {**base, "stream_options": {
        "continuous_usage_stats": True}}).text)
    assert on[0]["choices"][0]["delta"]["role"] == "assistant"
    assert on[0]["usage"]["completion_tokens"] == 0 and on[0]["usage"]["prompt_tokens"] > 0
    assert all(e["usage"] is not None for e in on)
    assert on[-1]["choices"] == [] and on[-1]["usage"]["completion_tokens"] == 3
    # include_usage defaults to true once stream_options is given (upstream); absent: none
    assert sse_events(post(url, {**base, "stream_options": {}}).text)[-1]["choices"] == []
    assert all(e.get("usage") is None for e in sse_events(post(url, base).text))


# ---- 3. server flags and routes -----------------------------------------------------------------
def test_models_card_and_model_name_rules(server, client, flagged, model_dir):
    card = client.models.list().data[0]
    assert card.id == "tiny" and card.root == model_dir
    flagged_card = httpx.get(flagged.url + "/api/v1/models").json()["data"][0]
    assert flagged_card["root"] == "org/tiny-llama"       # as the user named it
    with pytest.raises(openai.NotFoundError) as e:        # upstream: 404 and this text
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    assert "The model `nope` does not exist." in e.value.message
    assert e.value.body["param"] == "model"
    out = client.completions.create(model="", prompt=PROMPT, max_tokens=2)   # "" = the served
    assert out.model == "tiny"


def test_root_path(flagged):
    """--root-path: served under the prefix (a proxy that keeps it) and without it (one that
    strips it); the OpenAPI schema names the prefix."""
    for prefix in ("/api", ""):
        r = httpx.get(flagged.url + prefix + "/v1/models")
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"
    assert httpx.get(flagged.url + "/api/openapi.json").json()["servers"] == [{"url": "/api"}]


def test_invocations_routes_by_body_shape(server):
    url = server.url + "/invocations"
    chat = post(url, {"messages": CHAT[:1], "max_tokens": 2}).json()
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] <= 2
    cmpl = post(url, {"prompt": PROMPT, "max_tokens": 2}).json()
    assert cmpl["object"] == "text_completion"
    stream = sse_events(post(url, {"prompt": PROMPT, "max_tokens": 2, "stream": True}).text)
    assert stream[0]["object"] == "text_completion"
    bad = post(url, {"input": "w5"})                      # upstream's status and text
    assert bad.status_code == 400
    assert bad.json()["error"]["message"] == ("Cannot find suitable handler for request. "
                                              "Expected one of: ['ChatCompletionRequest', "
                                              "'CompletionRequest']")


def _load(url: str) -> int:
    return httpx.get(url).json()["server_load"]


def _wait_load(url: str, want: int) -> None:
    deadline = time.monotonic() + 20
    while _load(url) != want:
        assert time.monotonic() < deadline, f"server_load never reached {want}"
        time.sleep(0.02)


@pytest.mark.parametrize("tracked", [True, False])
def test_server_load(server, flagged, tracked):
    srv, prefix = (flagged, "/api") if tracked else (server, "")
    url = srv.url + prefix + "/load"
    assert _load(url) == 0
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    started, stop = threading.Event(), threading.Event()

    def stream_then_hang_up():
        with httpx.stream("POST", srv.url + prefix + "/v1/completions", json=body,
                          timeout=60) as r:
            for _ in r.iter_lines():
                started.set()
                if stop.is_set():
                    return

    t = threading.Thread(target=stream_then_hang_up)
    t.start()
    assert started.wait(30)
    if tracked:
        assert _load(url) == 1
    else:
        assert _load(url) == 0          # without --enable-server-load-tracking: always 0
    stop.set()
    t.join(30)
    _wait_load(url, 0)
    wait_until_clean(srv.engine)


def test_cli_flags_on_a_unix_socket(tiny_llama, tmp_path):
    """`vllm serve` with --uds and the other server flags of this file, for real."""
    sock = str(tmp_path / "vllm.sock")
    cmd = vllm_command() + ["serve", tiny_llama, "--uds", sock, "--served-model-name", "tiny",
            "--num-gpu-blocks-override", "64", "--root-path", "/api",
            "--enable-server-load-tracking", "--enable-tokenizer-info-endpoint",
            "--return-tokens-as-token-ids", "--kv-usage-in-response",
            "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    http = httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://vllm",
                        timeout=60)
    try:
        wait_healthy(proc, http.get)
        assert http.get("/api/v1/models").json()["data"][0]["root"] == tiny_llama
        assert http.get("/api/load").json() == {"server_load": 0}
        assert http.get("/tokenizer_info").json()["tokenizer_class"]
        out = http.post("/api/v1/completions", json={
            "model": "tiny", "prompt": "w5 w6", "max_tokens": 2, "logprobs": 0}).json()
        assert all(t.startswith("token_id:") for t in out["choices"][0]["logprobs"]["tokens"])
        assert set(out["usage"]["kv"]) == {"evicted_tokens", "live_tokens", "peak_blocks", "budget_tokens"}
    finally:
        http.close()
        code = interrupt(proc)
    assert code == 0


# ---- 5. error wording clients match on ---------------------------------------------------------
@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt_wording(server, prompt):
    r = post(server.url + "/v1/completions", {"model": "tiny", "prompt": prompt})
    assert r.status_code == 400                            # upstream's wording
    assert "decoder prompt cannot be empty" in r.json()["error"]["message"]


def test_out_of_vocab_wording(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=[5, 6, 70000])
    assert_400(e, "Token id 70000 is out of vocabulary")      # upstream's wording
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, logit_bias={"60000": 5})
    assert_400(e, "token_id(s) [60000] in logit_bias contain out-of-vocab token ids")


@pytest.mark.parametrize("seed,kind", [(2 ** 63, "less_than_equal"),
                                       (-2 ** 63 - 1, "greater_than_equal")])
def test_seed_bounds_are_upstreams(client, seed, kind):
    """upstream declares seed as a torch.long (ge=min, le=max); its 400 lists pydantic's
    errors ("1 validation error:" then each with its type)."""
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, seed=seed)
    assert_400(e, "1 validation error:")
    assert f"'type': '{kind}'" in e.value.message and e.value.body["param"] == "seed"
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1,
                                     seed=2 ** 63 - 1).usage.completion_tokens == 1


# ---- 6. usage.kv only when asked --------------------------------------------------------------
def test_kv_usage_is_opt_in(server, flagged):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True}
    url = server.url + "/v1/completions"
    assert set(post(url, body).json()["usage"]) == UPSTREAM_USAGE_KEYS    # upstream's shape
    asked = post(url, {**body, "kv_usage": True}).json()["usage"]
    assert set(asked["kv"]) == {"evicted_tokens", "live_tokens", "peak_blocks", "budget_tokens"}
    assert asked["kv"]["live_tokens"] > 0
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    assert "kv" not in sse_events(post(url, stream).text)[-1]["usage"]
    assert "kv" in sse_events(post(url, {**stream, "kv_usage": True}).text)[-1]["usage"]
    chat = {"model": "tiny", "messages": CHAT[:1], "max_tokens": 2}
    assert set(post(server.url + "/v1/chat/completions", chat).json()["usage"]) == \
        UPSTREAM_USAGE_KEYS
    # --kv-usage-in-response: always
    assert "kv" in post(flagged.url + "/api/v1/chat/completions", chat).json()["usage"]


# ---- 7. upstream's shapes ----------------------------------------------------------------------
TEMPLATE = os.path.join(os.path.dirname(__file__), "..", "examples",
                        "tool_chat_template_hermes.jinja")
KEY = "sk-surface"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def keyed(tiny_llama_bytes):
    """The byte-level model (any text is a prompt) with the Hermes tool template, --api-key,
    --enable-sleep-mode, --enable-tokenizer-info-endpoint and prefix caching."""
    options = ServerOptions(enable_tokenizer_info_endpoint=True)
    engine = make_engine(tiny_llama_bytes, num_gpu_blocks_override=128,
                         enable_prefix_caching=True, enable_sleep_mode=True)
    srv = ServerThread(build_app(engine, ["tiny"], api_key=KEY, chat_template=TEMPLATE,
                                 options=options))
    with srv:
        srv.engine = engine
        yield srv
        wait_until_clean(engine)


def keyed_post(srv, path, body=None, **kw):
    return httpx.post(srv.url + path, json=body, headers=AUTH, timeout=60, **kw)


def test_version_is_upstreams_shape(server):
    assert httpx.get(server.url + "/version").json() == {"version": vllm.__version__}


def test_system_fingerprint_is_the_same_through_invocations(server, flagged):
    """Upstream's default form, vllm-<version>-<hash of the configuration>, on every whole
    response; /invocations answers as the endpoint it stands for."""
    fp = system_fingerprint(server.engine.engine)
    assert re.fullmatch(rf"vllm-{re.escape(vllm.__version__)}-[0-9a-f]{{8}}", fp)
    chat = {"messages": CHAT[:1], "max_tokens": 2}
    cmpl = {"prompt": PROMPT, "max_tokens": 2}
    for path, body in (("/v1/chat/completions", chat), ("/invocations", chat),
                       ("/v1/completions", cmpl), ("/invocations", cmpl)):
        out = post(server.url + path, body).json()
        assert out["system_fingerprint"] == fp, path
        assert "service_tier" in out and out["service_tier"] is None      # upstream's keys
    other = post(flagged.url + "/api/v1/completions", cmpl).json()["system_fingerprint"]
    assert other == system_fingerprint(flagged.engine.engine) != fp    # --max-num-seqs 8


def _added_tokens_of_tokenizer_json(model_dir: str) -> dict:
    """An independent source: tokenizer.json's added_tokens, as tokenizer_config.json writes
    added_tokens_decoder."""
    with open(os.path.join(model_dir, "tokenizer.json")) as f:
        added = json.load(f)["added_tokens"]
    return {str(t["id"]): {k: t[k] for k in ADDED_TOKEN_FIELDS} for t in added}


def test_tokenizer_info_lists_added_tokens_whole(flagged, model_dir):
    info = httpx.get(flagged.url + "/api/tokenizer_info").json()
    special = dict(lstrip=False, normalized=False, rstrip=False, single_word=False, special=True)
    assert info["added_tokens_decoder"] == {"0": {"content": "<unk>", **special},
                                            "1": {"content": "<s>", **special},
                                            "2": {"content": "</s>", **special}}
    assert info["added_tokens_decoder"] == _added_tokens_of_tokenizer_json(model_dir)
    assert info["eos_token"] == "</s>"                 # other special tokens: their text


def test_tokenizer_info_of_the_default_models_tokenizer():
    from vllm.model_executor.gguf_loader import resolve_model
    try:
        model_dir = resolve_model(None)
    except (OSError, ValueError) as e:
        pytest.skip(f"the default model is not installed: {e}")
    info = tokenizer_config(AutoTokenizer.from_pretrained(model_dir), None)
    added = info["added_tokens_decoder"]
    assert added == _added_tokens_of_tokenizer_json(model_dir)
    assert added["0"]["content"] == "<|endoftext|>" and added["2"]["content"] == "<|im_end|>"
    assert all(set(t) == set(ADDED_TOKEN_FIELDS) for t in added.values())
    json.dumps(info)                                    # the whole body is JSON


@pytest.fixture(scope="module")
def no_ws(tiny_llama_bytes):
    """The random model would fill free JSON whitespace until max_tokens."""
    tok = AutoTokenizer.from_pretrained(tiny_llama_bytes)
    return {str(tok.convert_tokens_to_ids(t)): -100 for t in ("Ġ", "Ċ", "ĉ", "č")}


ONE_ARG = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}
TOOL_BODY = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 40,
             "tools": [{"type": "function", "function": {"name": "f", "parameters": ONE_ARG}}]}


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "f"}}, "required"])
def test_forced_tool_call_content_is_empty_string(keyed, no_ws, choice):
    """upstream: a named (or required) call's message has content "" (not null); streamed, the
    role chunk's content is "" and the call's deltas carry no content."""
    body = {**TOOL_BODY, "tool_choice": choice, "logit_bias": no_ws, "seed": 1,
            "parallel_tool_calls": False, "max_tokens": 80}
    whole = keyed_post(keyed, "/v1/chat/completions", body).json()
    message = whole["choices"][0]["message"]
    assert "content" in message and message["content"] == ""
    assert message["tool_calls"][0]["function"]["name"] == "f"
    events = sse_events(keyed_post(keyed, "/v1/chat/completions", {**body, "stream": True}).text)
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert all(d.get("content") in (None, "") for d in deltas)
    assert any(d.get("tool_calls") for d in deltas)


# ---- 8. sleep mode -----------------------------------------------------------------------------
GREEDY_BODY = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 12,
               "temperature": 0, "ignore_eos": True}


def _greedy_tokens(srv) -> list:
    out = keyed_post(srv, "/v1/completions", {**GREEDY_BODY, "logprobs": 0}).json()
    return out["choices"][0]["logprobs"]["tokens"]


def _is_sleeping(srv) -> bool:
    return httpx.get(srv.url + "/is_sleeping", headers=AUTH).json()["is_sleeping"]


def _assert_refused_while_asleep(srv) -> None:
    """Generation is a 503 (our choice: upstream has no check) on every route, streamed too,
    before any response begins; the tokenizer and /health still answer."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, body in (("/v1/completions", GREEDY_BODY), ("/v1/chat/completions", chat),
                       ("/invocations", chat),
                       ("/v1/completions", {**GREEDY_BODY, "stream": True})):
        r = keyed_post(srv, path, body)
        assert r.status_code == 503, (path, r.text)
        assert r.json()["error"]["type"] == "service_unavailable"
        assert "sleeping" in r.json()["error"]["message"]
    assert httpx.get(srv.url + "/health").status_code == 200
    assert keyed_post(srv, "/tokenize", {"prompt": "ab"}).status_code == 200


def test_sleep_level_1_releases_the_kv_pool(keyed):
    llm_engine = keyed.engine.engine
    before = _greedy_tokens(keyed)
    held = llm_engine.model_executor.held_bytes()
    assert held["kv_cache"] > 0 and held["weights"] > 0
    assert llm_engine.kv.bm.pool.hashed.any()            # the prompt's blocks are cached
    pool = weakref.ref(llm_engine.kv_caches)
    assert keyed_post(keyed, "/sleep?level=1").status_code == 200
    assert _is_sleeping(keyed)
    gc.collect()
    assert pool() is None and llm_engine.kv_caches is None          # the tensor is gone
    assert llm_engine.model_executor.held_bytes() == {"kv_cache": 0, "weights": held["weights"]}
    bm = llm_engine.kv.bm
    assert bm.num_free_blocks == bm.num_blocks and not bm.pool.hashed.any()
    _assert_refused_while_asleep(keyed)
    assert keyed_post(keyed, "/wake_up").status_code == 200
    assert not _is_sleeping(keyed)
    assert llm_engine.model_executor.held_bytes() == held            # the same pool size
    assert _greedy_tokens(keyed) == before
    state = wait_until_clean(keyed.engine)                # invariants; every block free again
    assert state["total"] == 128


def test_sleep_level_2_releases_the_weights_and_wakes_by_tags(keyed):
    llm_engine = keyed.engine.engine
    before = _greedy_tokens(keyed)
    held = llm_engine.model_executor.held_bytes()
    model, weight = weakref.ref(llm_engine.model), weakref.ref(next(llm_engine.model.parameters()))
    assert keyed_post(keyed, "/sleep?level=2").status_code == 200
    gc.collect()
    assert model() is None and weight() is None
    assert llm_engine.model_executor.held_bytes() == {"kv_cache": 0, "weights": 0}
    _assert_refused_while_asleep(keyed)
    # upstream's tags: the weights come back first, then the KV cache
    r = keyed_post(keyed, "/wake_up?tags=kv_cache")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tags"
    assert keyed_post(keyed, "/wake_up?tags=weights").status_code == 200
    assert _is_sleeping(keyed)
    assert llm_engine.model_executor.held_bytes() == {"kv_cache": 0, "weights": held["weights"]}
    assert keyed_post(keyed, "/wake_up?tags=kv_cache").status_code == 200
    assert not _is_sleeping(keyed)
    assert llm_engine.model_executor.held_bytes() == held
    assert _greedy_tokens(keyed) == before                # reloaded as loaded the first time
    wait_until_clean(keyed.engine)


def _stream_in_thread(srv, body, started: threading.Event, events: list) -> threading.Thread:
    def run():
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, headers=AUTH,
                          timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[len("data: "):]))
                    started.set()
    t = threading.Thread(target=run)
    t.start()
    return t


def test_sleep_modes_for_requests_in_flight(keyed):
    """upstream's mode: abort (the default) ends them with finish_reason "abort"; wait lets
    them finish and refuses new ones meanwhile; keep, a bad level or a bad mode is a 400."""
    long = {**GREEDY_BODY, "max_tokens": 600, "stream": True}
    started, events = threading.Event(), []
    t = _stream_in_thread(keyed, long, started, events)
    assert started.wait(30)
    assert keyed_post(keyed, "/sleep").status_code == 200           # level 1, mode abort
    t.join(30)
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["abort"]
    assert keyed_post(keyed, "/wake_up").status_code == 200
    wait_until_clean(keyed.engine)

    body = {**GREEDY_BODY, "max_tokens": 200, "stream": True,
            "stream_options": {"include_usage": True}}
    started, events = threading.Event(), []
    t = _stream_in_thread(keyed, body, started, events)
    assert started.wait(30)
    sleeper = threading.Thread(target=lambda: keyed_post(keyed, "/sleep?mode=wait"))
    sleeper.start()
    deadline = time.monotonic() + 10
    while not keyed.engine._falling_asleep and sleeper.is_alive():
        assert time.monotonic() < deadline
        time.sleep(0.005)
    refused = keyed_post(keyed, "/v1/completions", GREEDY_BODY)
    sleeper.join(30)
    t.join(30)
    assert _is_sleeping(keyed)
    assert refused.status_code == 503 and "going to sleep" in refused.text, refused.text
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"] and events[-1]["usage"]["completion_tokens"] == 200
    assert keyed_post(keyed, "/wake_up").status_code == 200

    for query, param in (("level=3", "level"), ("mode=keep", "mode"), ("mode=later", "mode")):
        r = keyed_post(keyed, f"/sleep?{query}")
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert not _is_sleeping(keyed)
    wait_until_clean(keyed.engine)


def test_sleep_routes_need_the_flag(server):
    """Without --enable-sleep-mode the routes are not served (upstream serves them only in its
    dev mode) and the engine refuses, in upstream's words."""
    for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
        assert httpx.request(method, server.url + path).status_code == 404
    with pytest.raises(ValueError, match="Sleep mode is not enabled"):
        server.engine.call(lambda e: e.sleep(1)).result(timeout=30)


def test_llm_sleep_and_wake_up_on_every_rank(tiny_llama):
    """LLM(enable_sleep_mode=True).sleep(level) / .wake_up() as upstream's, at TP=2: both ranks
    release (held bytes are summed over ranks), both come back, the tokens are the same."""
    with pytest.raises(ValueError, match="Sleep mode is not enabled"):
        LLM(tiny_llama, num_gpu_blocks_override=16).sleep()
    llm = LLM(tiny_llama, tensor_parallel_size=2, num_gpu_blocks_override=32,
              enable_sleep_mode=True, enable_prefix_caching=True)
    eng = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [40, 41, 42]]

    def tokens():
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    try:
        before = tokens()
        held = eng.model_executor.held_bytes()
        rank0_pool = eng.kv_caches.numel() * eng.kv_caches.element_size()
        assert held["kv_cache"] == 2 * rank0_pool          # one KV head each: both ranks count
        for level, asleep in ((1, {"kv_cache": 0, "weights": held["weights"]}),
                              (2, {"kv_cache": 0, "weights": 0})):
            llm.sleep(level)
            assert eng.model_executor.held_bytes() == asleep
            with pytest.raises(EngineSleepingError):
                llm.generate(prompts, params, use_tqdm=False)
            llm.wake_up()
            assert eng.model_executor.held_bytes() == held
            assert tokens() == before
            eng.check_invariants()                         # every rank's views agree
            assert eng.kv.bm.num_free_blocks == eng.kv.bm.num_blocks == 32
    finally:
        eng.shutdown()


# ---- 9. the API key ----------------------------------------------------------------------------
def test_api_key_guards_every_route_that_runs_the_model_or_tokenizer(keyed):
    guarded = [("GET", "/v1/models", None),
               ("POST", "/v1/completions", {**GREEDY_BODY, "max_tokens": 1}),
               ("POST", "/v1/chat/completions",
                {"model": "tiny", "messages": [{"role": "user", "content": "a"}],
                 "max_tokens": 1}),
               ("POST", "/invocations", {"prompt": "ab", "max_tokens": 1}),
               ("POST", "/tokenize", {"prompt": "ab"}), ("POST", "/detokenize", {"tokens": [70]}),
               ("GET", "/tokenizer_info", None), ("GET", "/load", None),
               ("GET", "/is_sleeping", None), ("POST", "/sleep", None),
               ("POST", "/wake_up", None)]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                    {"Authorization": f"Basic {KEY}"}):
        for method, path, body in guarded:
            r = httpx.request(method, keyed.url + path, json=body, headers=headers, timeout=60)
            assert r.status_code == 401, (headers, path)
            assert r.json()["error"]["type"] == "authentication_error"
    assert not _is_sleeping(keyed)                        # the refused /sleep did nothing
    for scheme in ("Bearer", "bearer"):                   # upstream: any case
        for method, path, body in guarded:
            r = httpx.request(method, keyed.url + path, json=body,
                              headers={"Authorization": f"{scheme} {KEY}"}, timeout=60)
            assert r.status_code == 200, (path, r.text)
    assert not _is_sleeping(keyed)
    for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping"),
                         ("GET", "/version"), ("GET", "/metrics"), ("GET", "/openapi.json")):
        assert httpx.request(method, keyed.url + path).status_code == 200, path
    wait_until_clean(keyed.engine)


def test_api_key_from_the_environment(server, monkeypatch):
    """VLLM_API_KEY (read through vllm.envs) is the key when none is given."""
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    with ServerThread(build_app(server.engine, ["tiny"], shutdown_engine=False)) as srv:
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        assert httpx.post(srv.url + "/tokenize", json={"prompt": "w5"}).status_code == 401
        ok = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer from-env"})
        assert ok.status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200
