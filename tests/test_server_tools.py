"""Tool calling: the hermes parser (whole and streamed, split at every position), the forced-call
parsers, and the server through the official openai client (tiny byte-level model with
examples/tool_chat_template_hermes.jinja): named and "required" tool_choice constrained by the
tools' schemas, "auto" parsed by --tool-call-parser hermes, upstream's 400s, tool messages in the
template.

A random tiny model never writes <tool_call> on its own, so the auto path is driven by a
guided_regex that spells one out (upstream allows structured outputs beside tool_choice "auto").
"""
import json
import os

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from server_utils import ServerThread, make_engine, wait_until_clean
from vllm.entrypoints.openai.api_server import build_app
from vllm.entrypoints.openai.tool_parsers import (HermesToolParser, ToolCallStream,
                                                  get_tool_parser)
from vllm.entrypoints.openai.tool_parsers.forced_tool_parsers import (NamedToolParser,
                                                                      RequiredToolParser)

TEMPLATE = os.path.join(os.path.dirname(__file__), "..", "examples",
                        "tool_chat_template_hermes.jinja")
# compact: the byte-level model spends a token per character of the prompt, in 1024 positions
WEATHER = {"type": "object",
           "properties": {"city": {"enum": ["Paris", "Rome"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"]}
CLOCK = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
CALL_RE = (r'Sure\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
           r'\{"city": "(Paris|Rome)", "days": [1-9]\}\}\n</tool_call>')


# ---- parsers, no server -------------------------------------------------------------------------
HERMES_TEXTS = [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"days": 3}}\n</tool_call>\n<tool_call>{"arguments": {"tz": "UTC"}, "name": "get_time"}'
    '</tool_call>\n',
    '<tool_call>{"name": "f", "arguments": {"s": "a \\"</tool_call>\\" <tool_call>", '
    '"n": [1, {"k": null}], "x": -1.5e3}}</tool_call>',
    '<tool_call>\n{"name": "f"}\n</tool_call> and after it, more words  ',
    '<tool_call>{"name": "f", "arguments": {"a": 1}}',           # unclosed last block
    'no calls here, only < angle > brackets and a <tool',
    '',
]


def stream_all(parser_factory, pieces):
    """Feed pieces; -> (content, [[name, arguments]], headers) as a client reassembles them."""
    stream = ToolCallStream(parser_factory())
    content, calls, headers = "", {}, []
    for i, piece in enumerate(pieces):
        delta_content, deltas = stream.feed(piece, final=i == len(pieces) - 1)
        content += delta_content
        for d in deltas:
            if "id" in d:
                assert d["index"] == len(calls) and d["type"] == "function"
                assert d["id"].startswith("chatcmpl-tool-")
                calls[d["index"]] = [d["function"]["name"], d["function"]["arguments"]]
                headers.append(d)
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[d["index"]][1] += d["function"]["arguments"]
    return content, [calls[k] for k in sorted(calls)], stream.called


def splits(text):
    """Every split into two pieces, every split into three around it, and one char at a time."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
        yield [text[:i], text[i:i + 2], text[i + 2:]]
    yield list(text) or [""]


@pytest.mark.parametrize("text", HERMES_TEXTS)
def test_hermes_stream_matches_whole_at_every_split(text):
    whole = HermesToolParser().extract(text)
    want = [[c.name, c.arguments] for c in whole.calls]
    for pieces in splits(text):
        content, calls, called = stream_all(HermesToolParser, pieces)
        assert calls == want, pieces
        assert content == (whole.content or ""), pieces
        assert called == bool(want)


def test_hermes_whole():
    first = HermesToolParser().extract(HERMES_TEXTS[0])
    assert first.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in first.calls] == [
        ("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "UTC"})]
    # a closing tag inside an argument string does not end the call
    second = HermesToolParser().extract(HERMES_TEXTS[1])
    assert json.loads(second.calls[0].arguments)["s"] == 'a "</tool_call>" <tool_call>'
    assert second.content is None
    third = HermesToolParser().extract(HERMES_TEXTS[2])
    assert third.calls[0].arguments == "{}" and third.content == " and after it, more words"
    assert HermesToolParser().extract(HERMES_TEXTS[3]).calls[0].arguments == '{"a": 1}'
    plain = HermesToolParser().extract(HERMES_TEXTS[4])
    assert plain.calls == [] and plain.content == HERMES_TEXTS[4]


@pytest.mark.parametrize("text", ['<tool_call>not json</tool_call>',
                                  '<tool_call>{"name": "f", "arguments": {"a": </tool_call>',
                                  '<tool_call>{"arguments": {}}</tool_call>',
                                  'x <tool_call>{"name": "f", "arguments": {"a": tru'])
def test_hermes_malformed_is_content(text):
    """As upstream: a call that does not parse leaves the whole text as content."""
    whole = HermesToolParser().extract(text)
    assert whole.calls == [] and whole.content == text
    content, calls, _ = stream_all(HermesToolParser, list(text))
    if not calls:
        assert content == text


def test_forced_parsers_stream_matches_whole():
    text = ('[{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}, '
            '{"name": "get_time", "parameters": {"tz": "CET"}}]')
    whole = RequiredToolParser().extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [
        ("get_weather", {"city": "Rome", "days": 2}), ("get_time", {"tz": "CET"})]
    for pieces in splits(text):
        assert stream_all(RequiredToolParser, pieces)[1] == [[c.name, c.arguments]
                                                             for c in whole.calls]
    args = '{"city": "Paris", "days": 1}'
    for pieces in splits(args):
        content, calls, _ = stream_all(lambda: NamedToolParser("get_weather"), pieces)
        assert content == "" and calls == [["get_weather", args]]
    assert RequiredToolParser().extract(text[:-1]).calls == []       # an unclosed array


def test_parser_registry():
    assert get_tool_parser("hermes") is HermesToolParser
    with pytest.raises(ValueError, match="--tool-call-parser.*hermes"):
        get_tool_parser("nope")


def test_template_renders_tools_calls_and_results(tiny_llama_bytes):
    tok = AutoTokenizer.from_pretrained(tiny_llama_bytes)
    messages = [{"role": "system", "content": "Be brief."}, *MESSAGES,
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "22 C"}]
    text = tok.apply_chat_template(messages, chat_template=open(TEMPLATE).read(), tools=TOOLS,
                                   tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n")
    assert json.dumps(TOOLS[0]) in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>\n') in text
    assert "<|im_start|>user\n<tool_response>\n22 C\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")


# ---- server -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(tiny_llama_bytes):
    """One server with --enable-auto-tool-choice --tool-call-parser hermes, one without."""
    with_flags = make_engine(tiny_llama_bytes)
    without = make_engine(tiny_llama_bytes)
    a = ServerThread(build_app(with_flags, ["tiny"], chat_template=TEMPLATE,
                               enable_auto_tool_choice=True, tool_call_parser="hermes"))
    b = ServerThread(build_app(without, ["tiny"], chat_template=TEMPLATE))
    with a, b:
        yield {"auto": (with_flags, a), "plain": (without, b)}


def _client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def client(servers):
    return _client(servers["auto"][1])


@pytest.fixture(scope="module")
def plain_client(servers):
    return _client(servers["plain"][1])


@pytest.fixture(scope="module")
def no_ws(tiny_llama_bytes):
    """The random model would fill free JSON whitespace until max_tokens."""
    tok = AutoTokenizer.from_pretrained(tiny_llama_bytes)
    return {str(tok.convert_tokens_to_ids(t)): -100 for t in ("Ġ", "Ċ", "ĉ", "č")}


def _chat(client, **kw):
    kw.setdefault("messages", MESSAGES)
    kw.setdefault("max_tokens", 120)
    return client.chat.completions.create(model="tiny", **kw)


def _bad(call, param):
    with pytest.raises(openai.BadRequestError) as e:
        call()
    assert e.value.body["param"] == param, e.value.body
    return e.value.body["message"]


def _valid_call(call):
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_tool_choice(client, no_ws):
    r = _chat(client, tools=TOOLS, tool_choice=NAMED, n=2, logit_bias=no_ws, seed=1)
    for c in r.choices:
        assert c.message.content == "" and len(c.message.tool_calls) == 1   # upstream: ""
        assert c.message.tool_calls[0].function.name == "get_weather"
        _valid_call(c.message.tool_calls[0])
        assert c.finish_reason == "stop"      # as OpenAI (and upstream) for a named function


def _stream(client, **kw):
    """-> per choice: (content, {index: [id, name, arguments]}, finish_reason)."""
    out = {}
    for chunk in _chat(client, stream=True, **kw):
        for c in chunk.choices:
            content, calls, _ = out.setdefault(c.index, ["", {}, None])
            out[c.index][0] = content + (c.delta.content or "")
            for d in c.delta.tool_calls or []:
                if d.id is not None:     # the first delta of a call: id, type, name
                    assert d.type == "function" and d.function.name and d.index not in calls
                    calls[d.index] = [d.id, d.function.name, d.function.arguments or ""]
                else:
                    assert d.function.name is None and d.type is None
                    calls[d.index][2] += d.function.arguments
            if c.finish_reason:
                out[c.index][2] = c.finish_reason
    return out


def test_named_tool_choice_streamed(client, no_ws):
    whole = _chat(client, tools=TOOLS, tool_choice=NAMED, logit_bias=no_ws, seed=3, n=2)
    streamed = _stream(client, tools=TOOLS, tool_choice=NAMED, logit_bias=no_ws, seed=3, n=2)
    for i, choice in enumerate(whole.choices):
        want = choice.message.tool_calls[0].function
        content, calls, finish = streamed[i]
        assert finish == "stop" and content == "" and len(calls) == 1
        assert calls[0][1:] == [want.name, want.arguments]    # same seed: the same call
        jsonschema.validate(json.loads(calls[0][2]), WEATHER)


def test_required_tool_choice(client, no_ws):
    r = _chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=2,
              logit_bias=no_ws, seed=2, max_tokens=200)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content == ""
        assert len(c.message.tool_calls) == 1
        _valid_call(c.message.tool_calls[0])
    streamed = _stream(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                       logit_bias=no_ws, seed=2, max_tokens=200, n=2)
    for i, choice in enumerate(r.choices):
        content, calls, finish = streamed[i]
        assert finish == "tool_calls" and content == "" and len(calls) == 1
        want = choice.message.tool_calls[0].function
        assert calls[0][1:] == [want.name, want.arguments]


def test_required_allows_parallel_calls(client, no_ws):
    """Without parallel_tool_calls=false the array may hold several calls; every complete one
    is valid (a cut at max_tokens reports "length", never a broken call)."""
    r = _chat(client, tools=TOOLS, tool_choice="required", logit_bias=no_ws, seed=5,
              max_tokens=250, n=2)
    assert any(c.finish_reason == "tool_calls" for c in r.choices)
    for c in r.choices:
        if c.finish_reason == "length":
            continue
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        for call in c.message.tool_calls:
            _valid_call(call)


def test_auto_with_hermes(client):
    r = _chat(client, tools=TOOLS, tool_choice="auto", extra_body={"guided_regex": CALL_RE},
              n=2, seed=0)
    for c in r.choices:
        assert c.finish_reason == "tool_calls"
        assert c.message.content == "Sure."
        (call,) = c.message.tool_calls
        assert call.function.name == "get_weather"
        _valid_call(call)
    # tool_choice defaults to "auto" with tools
    streamed = _stream(client, tools=TOOLS, extra_body={"guided_regex": CALL_RE}, seed=0, n=2)
    for i, choice in enumerate(r.choices):
        content, calls, finish = streamed[i]
        assert finish == "tool_calls" and content == "Sure."
        want = choice.message.tool_calls[0].function
        assert [c[1:] for c in calls.values()] == [[want.name, want.arguments]]


def test_auto_without_a_call_is_content(client):
    r = _chat(client, tools=TOOLS, extra_body={"guided_regex": "It is (sunny|raining)\\."})
    c = r.choices[0]
    assert c.message.tool_calls is None and c.finish_reason == "stop"
    assert c.message.content in ("It is sunny.", "It is raining.")


def test_auto_needs_the_flags(plain_client):
    msg = _bad(lambda: _chat(plain_client, tools=TOOLS, tool_choice="auto"), "tool_choice")
    assert "--enable-auto-tool-choice" in msg and "--tool-call-parser" in msg
    # upstream: tools without tool_choice mean "auto"
    _bad(lambda: _chat(plain_client, tools=TOOLS), "tool_choice")
    # named and "none" need no flags
    r = _chat(plain_client, tools=TOOLS, tool_choice=NAMED, max_tokens=3)
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_tool_choice_errors(client):
    _bad(lambda: _chat(client, tool_choice="required"), "tool_choice")
    _bad(lambda: _chat(client, tool_choice=NAMED), "tool_choice")
    msg = _bad(lambda: _chat(client, tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "nope"}}), "tool_choice")
    assert "does not match" in msg
    _bad(lambda: _chat(client, tools=[], tool_choice="none"), "tools")
    _bad(lambda: _chat(client, tools=TOOLS, tool_choice="sometimes"), "tool_choice")
    # a named or required choice constrains the output itself
    _bad(lambda: _chat(client, tools=TOOLS, tool_choice=NAMED,
                       response_format={"type": "json_object"}), "tool_choice")
    bad_tool = [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {
            "a": {"$ref": "#/$defs/missing"}}}}}]
    _bad(lambda: _chat(client, tools=bad_tool, tool_choice={
        "type": "function", "function": {"name": "f"}}), "tools.0.function.parameters")
    _bad(lambda: _chat(client, tools=bad_tool, tool_choice="required"), "tools")


def test_tool_choice_none_renders_tools_but_ignores_them(client):
    def prompt_tokens(**kw):
        return _chat(client, max_tokens=2, **kw).usage.prompt_tokens
    plain = prompt_tokens()
    assert prompt_tokens(tools=TOOLS, tool_choice="none") > plain + 100    # tools in the prompt
    r = _chat(client, tools=TOOLS, tool_choice="none", max_tokens=5)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


def test_tool_messages_render(client, servers):
    """A later turn: the assistant's call (arguments as OpenAI's JSON string) and the tool's
    result reach the template; /tokenize shows the prompt."""
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather",
                                 "arguments": '{"city": "Paris", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "22 C and sunny"}]
    base = servers["auto"][1].url
    import httpx
    ids = httpx.post(f"{base}/tokenize", json={"model": "tiny", "messages": history,
                                               "tools": TOOLS}).json()["tokens"]
    prompt = httpx.post(f"{base}/detokenize", json={"model": "tiny", "tokens": ids}).json()
    prompt = prompt["prompt"]
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n'
            '</tool_call>') in prompt
    assert "<tool_response>\n22 C and sunny\n</tool_response>" in prompt
    assert '"name": "get_time"' in prompt                         # the tools, in the system
    r = _chat(client, messages=history, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert r.usage.prompt_tokens == len(ids)
    bad = [*history[:1], {**history[1], "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]
    _bad(lambda: _chat(client, messages=bad), "messages.1.tool_calls.0.function.arguments")
    wait_until_clean(servers["auto"][0])


def test_cli_flags():
    from vllm.entrypoints.openai.api_server import make_arg_parser
    from vllm.entrypoints.openai.serving_chat import auto_tool_parser

    def parser_for(*argv):
        args = make_arg_parser().parse_args(list(argv))
        return auto_tool_parser(args.enable_auto_tool_choice, args.tool_call_parser)
    assert parser_for("--enable-auto-tool-choice", "--tool-call-parser", "hermes") \
        is HermesToolParser
    assert parser_for() is None
    assert parser_for("--tool-call-parser", "hermes") is None     # "auto" stays off, as upstream
    with pytest.raises(ValueError, match="--tool-call-parser"):
        parser_for("--enable-auto-tool-choice")
    with pytest.raises(ValueError, match="registered"):
        parser_for("--enable-auto-tool-choice", "--tool-call-parser", "nope")


def test_llm_chat_passes_tools(tiny_llama_bytes):
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams
    llm = LLM(tiny_llama_bytes, num_gpu_blocks_override=128)
    template = open(TEMPLATE).read()
    params = SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=(
        StructuredOutputsParams(json=WEATHER, disable_any_whitespace=True)))
    out = llm.chat(MESSAGES, params, use_tqdm=False, chat_template=template, tools=TOOLS)[0]
    assert json.dumps(TOOLS[1]) in out.prompt
    assert "<tools>" not in llm.chat(MESSAGES, params, use_tqdm=False,
                                     chat_template=template)[0].prompt
    jsonschema.validate(json.loads(out.outputs[0].text), WEATHER)
