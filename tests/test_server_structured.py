"""Structured outputs through the OpenAI server (official openai client, tiny byte-level model):
response_format, structured_outputs and the older guided_* fields, on /v1/completions and
/v1/chat/completions, whole and streamed, with n=2 and with KV eviction; bad specs are 400s whose
`param` names the body field the client sent.

The random model would fill free JSON whitespace until max_tokens, so JSON requests push the
whitespace tokens down with logit_bias (a grammar mask still wins: whitespace inside strings stays
possible) or turn it off with disable_any_whitespace / guided_whitespace_pattern.
"""
import json
import re

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from server_utils import serve, wait_until_clean

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                         "days": {"type": "integer", "minimum": 1, "maximum": 9},
                         "note": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                         "sunny": {"type": "boolean"}},
          "required": ["city", "days", "note", "sunny"]}
# (not maxLength: xgrammar 0.2.9 lets a maxLength string take raw control characters, which
# is not JSON)
REGEX = r"(red|green|blue)-[0-9]{2}"
CHOICES = ["alpha", "beta", "gamma"]
GRAMMAR = 'root ::= ("on" | "off") "-" [0-9] [0-9]'
GRAMMAR_RE = r"(on|off)-[0-9]{2}"
EVICT = {"kv_eviction_policy": "h2o", "kv_budget_tokens": 8, "kv_min_tokens": 0}
MESSAGES = [{"role": "user", "content": "Give me the weather as JSON."}]


@pytest.fixture(scope="module")
def server(tiny_llama_bytes, tmp_path_factory):
    from server_utils import chat_model_dir
    # the word-level CHAT_TEMPLATE renders to plain text, which the byte tokenizer also encodes
    model = chat_model_dir(tiny_llama_bytes, str(tmp_path_factory.mktemp("m") / "chat-bytes"))
    engine, srv = serve(model)
    with srv:
        yield engine, srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1].url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def no_ws(tiny_llama_bytes):
    tok = AutoTokenizer.from_pretrained(tiny_llama_bytes)
    return {str(tok.convert_tokens_to_ids(t)): -100 for t in ("Ġ", "Ċ", "ĉ", "č")}


def _complete(client, body, **kw):
    return client.completions.create(model="tiny", prompt="weather:", extra_body=body,
                                     seed=kw.pop("seed", 0), **kw)


def _chat(client, body, **kw):
    return client.chat.completions.create(model="tiny", messages=MESSAGES, extra_body=body,
                                          seed=kw.pop("seed", 0), **kw)


def _bad(call, param):
    with pytest.raises(openai.BadRequestError) as e:
        call()
    assert e.value.status_code == 400
    assert e.value.body["param"] == param, e.value.body
    return e.value.body["message"]


# ---- every kind, both endpoints -----------------------------------------------------------------
KINDS = {
    "guided_json": ({"guided_json": SCHEMA}, "schema"),
    "guided_regex": ({"guided_regex": REGEX}, "regex"),
    "guided_choice": ({"guided_choice": CHOICES}, "choice"),
    "guided_grammar": ({"guided_grammar": GRAMMAR}, "grammar"),
    "structured_outputs.json": ({"structured_outputs": {"json": SCHEMA}}, "schema"),
    "structured_outputs.regex": ({"structured_outputs": {"regex": REGEX}}, "regex"),
    "structured_outputs.choice": ({"structured_outputs": {"choice": CHOICES}}, "choice"),
    "structured_outputs.grammar": ({"structured_outputs": {"grammar": GRAMMAR}}, "grammar"),
    "structured_outputs.json_object": ({"structured_outputs": {"json_object": True}}, "object"),
    "response_format.json_schema": ({"response_format": {
        "type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}}, "schema"),
    "response_format.json_object": ({"response_format": {"type": "json_object"}}, "object"),
}


def check(text: str, expect: str) -> None:
    if expect == "schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif expect == "object":
        assert isinstance(json.loads(text), dict), text
    elif expect == "regex":
        assert re.fullmatch(REGEX, text), text
    elif expect == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(GRAMMAR_RE, text), text


def _object_bias(no_ws, tiny_llama_bytes):
    """json_object allows any keys and values: a random model's strings would run to max_tokens,
    so '}' is pushed up (the grammar decides when it is allowed)."""
    tok = AutoTokenizer.from_pretrained(tiny_llama_bytes)
    return {**no_ws, str(tok.convert_tokens_to_ids("}")): 8}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_kind_validates(client, no_ws, tiny_llama_bytes, kind, endpoint):
    body, expect = KINDS[kind]
    bias = _object_bias(no_ws, tiny_llama_bytes) if expect == "object" else no_ws
    if endpoint == "completions":
        r = _complete(client, body, max_tokens=80, n=2, logit_bias=bias)
        texts = [c.text for c in r.choices]
    else:
        r = _chat(client, body, max_tokens=80, n=2, logit_bias=bias)
        texts = [c.message.content for c in r.choices]
    assert len(texts) == 2
    for c, text in zip(r.choices, texts):
        assert c.finish_reason == "stop", (kind, text)
        check(text, expect)


def test_unconstrained_output_is_not_json(client):
    """The constraint is what makes the output valid (the tests above could not pass without it)."""
    r = _complete(client, {}, max_tokens=30)
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


def test_text_response_format_is_no_constraint(client):
    r = _chat(client, {"response_format": {"type": "text"}}, max_tokens=5)
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_with_eviction_n2(client, server, no_ws, endpoint):
    body = {"guided_json": SCHEMA, **EVICT}
    for _ in range(2):
        if endpoint == "completions":
            r = _complete(client, body, max_tokens=80, n=2, logit_bias=no_ws, seed=None)
            texts = [c.text for c in r.choices]
        else:
            r = _chat(client, body, max_tokens=80, n=2, logit_bias=no_ws, seed=None)
            texts = [c.message.content for c in r.choices]
        for text in texts:
            check(text, "schema")
        assert r.usage.completion_tokens > 8      # past the budget: eviction did run
    wait_until_clean(server[0])


def _stream_texts(stream, field):
    texts = {}
    finish = {}
    for chunk in stream:
        for c in chunk.choices:
            piece = getattr(c, field) if field == "text" else c.delta.content
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return texts, finish


def test_streamed_completion(client, no_ws):
    stream = _complete(client, {"structured_outputs": {"json": SCHEMA}, **EVICT},
                       max_tokens=80, n=2, stream=True, logit_bias=no_ws)
    texts, finish = _stream_texts(stream, "text")
    assert sorted(texts) == [0, 1] and finish == {0: "stop", 1: "stop"}
    for text in texts.values():
        check(text, "schema")


def test_streamed_chat(client, no_ws):
    stream = _chat(client, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "w", "schema": SCHEMA}}}, max_tokens=80, n=2, stream=True, logit_bias=no_ws)
    texts, finish = _stream_texts(stream, "delta")
    assert sorted(texts) == [0, 1] and finish == {0: "stop", 1: "stop"}
    for text in texts.values():
        check(text, "schema")
    stream = _chat(client, {"guided_regex": REGEX}, max_tokens=20, stream=True)
    texts, _ = _stream_texts(stream, "delta")
    check(texts[0], "regex")


def test_whitespace_off(client):
    """guided_whitespace_pattern "" and disable_any_whitespace: compact JSON without logit_bias."""
    for body in ({"guided_json": SCHEMA, "guided_whitespace_pattern": ""},
                 {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}):
        r = _complete(client, body, max_tokens=80)
        check(r.choices[0].text, "schema")
        assert "\n" not in r.choices[0].text


# ---- errors -------------------------------------------------------------------------------------
BAD_REGEX = "(unclosed"
BAD_SCHEMA = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bad_spec_is_400_naming_the_field(client, endpoint):
    call = _complete if endpoint == "completions" else _chat
    cases = [
        ({"guided_regex": BAD_REGEX}, "guided_regex"),
        ({"guided_json": BAD_SCHEMA}, "guided_json"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_grammar": "root ::= (("}, "guided_grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {"regex": BAD_REGEX}}, "structured_outputs.regex"),
        ({"structured_outputs": {"json": BAD_SCHEMA}}, "structured_outputs.json"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
         "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format"),
        ({"guided_json": SCHEMA, "guided_whitespace_pattern": "(("}, "guided_whitespace_pattern"),
    ]
    for body, param in cases:
        _bad(lambda: call(client, body, max_tokens=5), param)


def test_more_than_one_kind_is_400(client):
    # ours: upstream lets response_format override structured_outputs; a clear 400 is safer
    msg = _bad(lambda: _complete(client, {"guided_regex": REGEX, "guided_choice": CHOICES},
                                 max_tokens=5), "guided_choice")
    assert "guided_regex" in msg and "guided_choice" in msg
    _bad(lambda: _chat(client, {"response_format": {"type": "json_object"},
                                "guided_json": SCHEMA}, max_tokens=5), "guided_json")
    _bad(lambda: _chat(client, {"structured_outputs": {"regex": REGEX, "choice": CHOICES}},
                       max_tokens=5), "structured_outputs")
    _bad(lambda: _chat(client, {"structured_outputs": {"disable_any_whitespace": True}},
                       max_tokens=5), "structured_outputs")


def test_bad_spec_leaves_nothing_behind(client, server):
    _bad(lambda: _complete(client, {"guided_regex": BAD_REGEX}, max_tokens=5, n=2),
         "guided_regex")
    _bad(lambda: _complete(client, {"guided_regex": BAD_REGEX}, max_tokens=5, stream=True),
         "guided_regex")
    wait_until_clean(server[0])
