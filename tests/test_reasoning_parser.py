"""--reasoning-parser: the deepseek_r1 and qwen3 parsers (whole and streamed, split at every
position), the grammar that starts a structured-output constraint where the reasoning ends, and
the server (reasoning_content whole and streamed, include_reasoning, tools and structured outputs
beside reasoning, and no change without the flag).

The server runs the tiny byte-level model with <think> and </think> added as single tokens, as
reasoning models have them. A random model writes its tags in no useful order, so each server
test reads the raw output back from the response's logprobs (one token each) and checks the
split against it; allowed_token_ids keeps the output to the tags and a few characters.
"""
import json
import random
import shutil

import httpx
import jsonschema
import pytest
from transformers import AutoTokenizer

from server_utils import ServerThread, make_engine, wait_until_clean
from vllm.entrypoints.cli import make_parser
from vllm.entrypoints.openai.api_server import build_app, make_arg_parser
from vllm.reasoning import (DeepSeekR1ReasoningParser, Qwen3ReasoningParser,
                            get_reasoning_parser, reasoning_parser_names)
from vllm.reasoning.grammar_after_reasoning import text_without
from vllm.sampling_params import StructuredOutputsParams

THINK, END = "<think>", "</think>"


# ---- parsers, no server -------------------------------------------------------------------------
R1_CASES = [   # output -> (reasoning_content, content)
    ("<think>I add.</think>\n\nIt is 4.", ("I add.", "\n\nIt is 4.")),   # the content as is
    ("I add.</think>\n\nIt is 4.", ("I add.", "\n\nIt is 4.")),   # <think> was in the prompt
    ("I add and add", ("I add and add", None)),                     # no </think>: all reasoning
    ("<think>I add", ("I add", None)),
    ("</think>It is 4.", (None, "It is 4.")),
    ("a</thi<</think>b</think>\n", ("a</thi<", "b</think>\n")),     # only the first tag counts
    ("x<think>y</think>z", ("x<think>y", "z")),                    # only a leading <think> goes
    ("I add.</think>", ("I add.", None)),
    ("<th", ("<th", None)),
    ("", (None, None)),
]
QWEN3_CASES = [
    ("<think>I add.</think>\n\nIt is 4.", ("I add.", "\n\nIt is 4.")),
    ("It is 4.", (None, "It is 4.")),                                # thinking disabled
    ("I add.</think>It is 4.", (None, "I add.</think>It is 4.")),  # no leading <think>
    ("<think>I add", ("I add", None)),                              # cut inside its reasoning
    ("<think></think>It is 4.", (None, "It is 4.")),
    ("\n<think>a</think>b", (None, "\n<think>a</think>b")),
    ("<thin", (None, "<thin")),
    ("<think>a</thi<</think>\n\n\nb\n", ("a</thi<", "\n\n\nb\n")),
    ("", (None, None)),
]
PARSERS = {"deepseek_r1": (DeepSeekR1ReasoningParser, R1_CASES),
           "qwen3": (Qwen3ReasoningParser, QWEN3_CASES)}


def test_registry():
    assert reasoning_parser_names() == ["deepseek_r1", "qwen3"]
    assert get_reasoning_parser("deepseek_r1") is DeepSeekR1ReasoningParser
    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    with pytest.raises(ValueError, match="--reasoning-parser.*deepseek_r1, qwen3"):
        get_reasoning_parser("granite")


@pytest.mark.parametrize("name", PARSERS)
def test_whole_output(name):
    cls, cases = PARSERS[name]
    for text, want in cases:
        assert cls().extract_reasoning_content(text) == want, text


def stream_all(parser, pieces):
    """Feed pieces as a server does -> (reasoning, content) joined, as a client joins them."""
    reasoning, content, previous = "", "", ""
    for i, piece in enumerate(pieces):
        current = previous + piece
        delta = parser.extract_reasoning_content_streaming(previous, current, piece,
                                                           final=i == len(pieces) - 1)
        previous = current
        if delta is None:
            continue
        assert delta.reasoning_content or delta.content, "an empty delta is None"
        reasoning += delta.reasoning_content or ""
        content += delta.content or ""
    return reasoning or None, content or None


def splits(text):
    """Every split into two pieces, every split into three around it, and one char at a time."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
        yield [text[:i], text[i:i + 2], text[i + 2:]]
    yield list(text) or [""]


@pytest.mark.parametrize("name", PARSERS)
def test_stream_matches_whole_at_every_split(name):
    cls, cases = PARSERS[name]
    for text, want in cases:
        for pieces in splits(text):
            assert stream_all(cls(), pieces) == want, pieces


def test_stream_holds_back_a_partial_tag():
    r1 = DeepSeekR1ReasoningParser()
    assert r1.extract_reasoning_content_streaming("", "ab</th", "ab</th").reasoning_content \
        == "ab"
    assert r1.extract_reasoning_content_streaming("ab</th", "ab</thin", "in") is None
    end = r1.extract_reasoning_content_streaming("ab</thin", "ab</think>\n\nc", "k>\n\nc")
    assert (end.reasoning_content, end.content) == (None, "\n\nc")
    cut = r1.extract_reasoning_content_streaming("ab</th", "ab</th", "", final=True)
    assert cut.reasoning_content == "</th"             # the last delta sends what was held
    qwen3 = Qwen3ReasoningParser()
    assert qwen3.extract_reasoning_content_streaming("", "<th", "<th") is None
    assert qwen3.extract_reasoning_content_streaming("<th", "<thx", "x").content == "<thx"


# ---- the grammar after the reasoning ------------------------------------------------------------
@pytest.fixture(scope="module")
def think_model(tiny_llama_bytes, tmp_path_factory):
    """The byte-level tiny model with <think> and </think> as single added tokens."""
    path = str(tmp_path_factory.mktemp("models") / "llama-bytes-think")
    shutil.copytree(tiny_llama_bytes, path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens([THINK, END])
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tok(think_model):
    return AutoTokenizer.from_pretrained(think_model)


@pytest.fixture(scope="module")
def accepts(tok):
    """accepts(ebnf)(text): whether the grammar takes text as a whole output (then EOS)."""
    import xgrammar as xgr
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=512))

    def for_grammar(ebnf):
        compiled = compiler.compile_grammar(ebnf)

        def check(text):
            matcher = xgr.GrammarMatcher(compiled)
            ids = tok.encode(text, add_special_tokens=False)
            return all(matcher.accept_token(i) for i in ids) \
                and matcher.accept_token(tok.eos_token_id)
        return check
    return for_grammar


def test_text_without_a_tag(accepts):
    check = accepts("root ::= t\n" + text_without(END, "t"))
    rng = random.Random(0)
    texts = ["", "<", "</think", "</think>", "a</think>", "<</think>", "</thi</think>",
             "</thinx>", "<<think>>", "</t</th</thi", "</think>>"]
    texts += ["".join(rng.choice("</think>x") for _ in range(rng.randint(1, 14)))
              for _ in range(300)]
    for text in texts:
        assert check(text) == (END not in text), text


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["n"], "additionalProperties": False}


def test_constraint_starts_after_the_reasoning(accepts):
    params = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    r1 = accepts(DeepSeekR1ReasoningParser().content_constraint(params).grammar)
    for text in ['</think>{"n": 1}', '<think>I add.</think>\n\n{"n": 2}',
                 'a</thi<</think>{"n": 3}',
                 'free {"n": 99} text', '{"n": 1}',      # all reasoning: it may stop there
                 'cut in its reasoning</thi']:
        assert r1(text), text
    for text in ['I add.</think>{"n": 10}', 'I add.</think>', 'a</think>it is 4',
                 '</think>{"n": 1}</think>', '</think>{"n":1}']:
        assert not r1(text), text
    qwen3 = accepts(Qwen3ReasoningParser().content_constraint(params).grammar)
    for text in ['{"n": 1}', '<think>I add.</think>\n{"n": 2}', '<think>cut in its reasoning']:
        assert qwen3(text), text
    for text in ['I add.</think>{"n": 1}', '<think>I add.</think>4', 'It is 4.']:
        assert not qwen3(text), text


@pytest.mark.parametrize("spec,good,bad", [
    (dict(regex="[0-9]{2}"), "42", "4"),
    (dict(choice=["yes", "no"]), "no", "maybe"),
    (dict(grammar='root ::= "a" root | "b"'), "aab", "aa"),
    (dict(json_object=True), '{"k": [1]}', "[1]"),
])
def test_every_constraint_kind_after_the_reasoning(accepts, spec, good, bad):
    check = accepts(DeepSeekR1ReasoningParser().content_constraint(
        StructuredOutputsParams(**spec)).grammar)
    assert check(f"I think.</think>\n{good}") and not check(f"I think.</think>\n{bad}")


# ---- server -------------------------------------------------------------------------------------
TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def servers(think_model):
    """One engine behind three apps: deepseek_r1 (with hermes tool calls), qwen3, no parser."""
    engine = make_engine(think_model)
    apps = {name: build_app(engine, ["tiny"], chat_template=TEMPLATE, shutdown_engine=False,
                            reasoning_parser=parser, enable_auto_tool_choice=True,
                            tool_call_parser="hermes")
            for name, parser in (("deepseek_r1", "deepseek_r1"), ("qwen3", "qwen3"),
                                 ("plain", None))}
    threads = {name: ServerThread(app) for name, app in apps.items()}
    for t in threads.values():
        t.__enter__()
    try:
        yield {name: t.url for name, t in threads.items()}
        wait_until_clean(engine)
    finally:
        for t in threads.values():
            t.__exit__(None, None, None)
        engine.shutdown()


@pytest.fixture(scope="module")
def ids(tok):
    def encode(text):
        return sorted(set(tok.encode(text, add_special_tokens=False)))
    return encode


def _chat(url, **body):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Add 2 and 2."}],
            "max_tokens": 30, **body}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _raw(choice):
    """The output as the model wrote it, tags included: its tokens' logprob entries (the last,
    EOS, is not part of the text)."""
    tokens = [t["token"] for t in choice["logprobs"]["content"]]
    if choice["finish_reason"] != "length" and tokens[-1:] == ["</s>"]:
        tokens.pop()
    return "".join(tokens)


def _stream(url, **body):
    """-> (reasoning joined, content joined, every delta)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Add 2 and 2."}],
            "max_tokens": 30, "stream": True, **body}
    deltas = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                deltas += [c["delta"] for c in json.loads(line[6:])["choices"]]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    return reasoning or None, content or None, deltas


def _split_r1(raw):
    """deepseek_r1 by hand: up to the first </think> (a leading <think> dropped)."""
    text = raw[len(THINK):] if raw.startswith(THINK) else raw
    reasoning, tag, content = text.partition(END)
    return reasoning or None, (content or None) if tag else None


def _split_qwen3(raw):
    if not raw.startswith(THINK):
        return None, raw or None
    reasoning, tag, content = raw[len(THINK):].partition(END)
    return reasoning or None, (content or None) if tag else None


# (logit_bias on the tags, seed): outputs with and without either tag, and tags in the content
GRID = [({}, 1), ({END: -2}, 0), ({END: -2}, 3), ({END: -3, THINK: 2}, 1),
        ({END: -3, THINK: 2}, 2), ({THINK: 3}, 0)]


@pytest.mark.parametrize("name,split", [("deepseek_r1", _split_r1), ("qwen3", _split_qwen3)])
def test_server_splits_whole_and_streamed(servers, tok, ids, name, split):
    seen = set()
    for bias, seed in GRID:
        body = dict(seed=seed, allowed_token_ids=ids(f"{THINK}{END}ab\n"),
                    logit_bias={str(tok.convert_tokens_to_ids(t)): b for t, b in bias.items()})
        whole = _chat(servers[name], logprobs=True, **body)
        raw = _raw(whole)
        want = split(raw)
        message = whole["message"]
        assert (message["reasoning_content"], message["content"]) == want, raw
        reasoning, content, deltas = _stream(servers[name], **body)
        assert (reasoning, content) == want, raw
        assert all(set(d) <= {"role", "content", "reasoning_content"} for d in deltas)
        seen.add((want[0] is not None, want[1] is not None))
    assert (True, True) in seen and (False, True) in seen     # the grid covers both kinds


def test_include_reasoning_false(servers, tok, ids):
    body = dict(seed=3, allowed_token_ids=ids(f"{THINK}{END}ab\n"),
                logit_bias={str(tok.convert_tokens_to_ids(END)): -2})
    full = _chat(servers["deepseek_r1"], **body)["message"]
    assert full["reasoning_content"] and full["content"]
    quiet = _chat(servers["deepseek_r1"], include_reasoning=False, **body)["message"]
    assert quiet["reasoning_content"] is None and quiet["content"] == full["content"]
    reasoning, content, deltas = _stream(servers["deepseek_r1"], include_reasoning=False, **body)
    assert reasoning is None and content == full["content"]
    assert not any("reasoning_content" in d for d in deltas)


def test_without_the_flag_nothing_changes(servers, tok, ids):
    body = dict(seed=3, allowed_token_ids=ids(f"{THINK}{END}ab\n"),
                logit_bias={str(tok.convert_tokens_to_ids(END)): -2})
    raw = _raw(_chat(servers["deepseek_r1"], logprobs=True, **body))
    assert END in raw
    message = _chat(servers["plain"], **body)["message"]
    assert message == {"role": "assistant", "content": raw}       # no reasoning_content key
    reasoning, content, deltas = _stream(servers["plain"], **body)
    assert content == raw and not any("reasoning_content" in d for d in deltas)


def test_structured_output_applies_to_the_content(servers, tok, ids):
    """The reasoning is free; from </think> on, the schema holds (and upstream's 400s stay)."""
    eos, end = tok.eos_token_id, tok.convert_tokens_to_ids(END)
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    body = dict(response_format=fmt, max_tokens=60, logprobs=True,
                allowed_token_ids=[eos] + ids(f'{THINK}{END}{{"n:}}0123456789ab'))
    finished = 0
    for name, split in (("deepseek_r1", _split_r1), ("qwen3", _split_qwen3)):
        for seed, end_bias in ((0, 0), (1, 0), (2, -3), (0, 2)):
            choice = _chat(servers[name], seed=seed, **body,
                           logit_bias={str(eos): -100, str(end): end_bias})
            message = choice["message"]
            assert (message["reasoning_content"], message["content"]) == split(_raw(choice))
            if choice["finish_reason"] == "stop":
                jsonschema.validate(json.loads(message["content"]), SCHEMA)
                finished += bool(message["reasoning_content"])
            else:                     # cut inside its reasoning: no content yet
                assert choice["finish_reason"] == "length" and message["content"] is None
    assert finished                   # some answer came after some reasoning
    r = httpx.post(servers["deepseek_r1"] + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "guided_regex": "("})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"


TOOLS = [{"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def test_tool_calls_are_parsed_from_the_content(servers, tok, ids):
    eos, end = tok.eos_token_id, tok.convert_tokens_to_ids(END)
    body = dict(tools=TOOLS, guided_regex=CALL.replace("{", "\\{").replace("}", "\\}"),
                allowed_token_ids=[eos, end] + ids(CALL), max_tokens=150, seed=0,
                logit_bias={str(eos): -100, str(end): 2})
    choice = _chat(servers["deepseek_r1"], logprobs=True, **body)
    raw = _raw(choice)
    reasoning = raw.split(END)[0]
    assert reasoning and raw == f"{reasoning}{END}{CALL}"
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and message["reasoning_content"] == reasoning
    assert message["content"] is None
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    streamed, content, deltas = _stream(servers["deepseek_r1"], **body)
    assert streamed == reasoning and content is None
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'


def test_cli_flag():
    for parse in (lambda *a: make_arg_parser().parse_args(list(a)),
                  lambda *a: make_parser().parse_args(["serve", *a])):
        assert parse().reasoning_parser is None
        assert parse("--reasoning-parser", "qwen3").reasoning_parser == "qwen3"
        assert parse("--reasoning-parser", "deepseek_r1").reasoning_parser == "deepseek_r1"


def test_cli_rejects_an_unknown_parser(capsys):
    with pytest.raises(SystemExit) as e:
        make_arg_parser().parse_args(["--reasoning-parser", "granite"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--reasoning-parser: invalid choice: 'granite'" in err and "qwen3" in err
