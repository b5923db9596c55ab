"""Structured outputs (xgrammar) and allowed_token_ids through the whole engine: every kind of
spec under greedy and seeded random sampling with n=3, beside KV eviction (every policy, every
reclamation mode), preemption by recompute, stop strings, the compile cache, and errors that
leave no engine state. The tiny random byte-level model follows any grammar: only the masks
make its output valid, so these tests fail when a mask is missing or misplaced."""
import json
import re

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.config import RECLAMATION_MODES
from vllm.core.eviction import policy_names
from vllm.kv_eviction_params import KVEvictionParams
from vllm.model_executor.sampler import Sampler, SamplingRow
from vllm.sampling_params import GuidedDecodingParams, StructuredOutputsParams
from vllm.structured_output import StructuredOutputError

try:
    import jsonschema_rs      # installed with schemathesis (requirements-dev.txt)
except ImportError:           # pragma: no cover
    jsonschema_rs = None

# every string bounded (enum), so that even a random model closes the object
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "enum": ["ann", "bob", "carol"]},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                             "maximum": 9},
                                  "maxItems": 3}},
          "required": ["name", "age", "ok", "tags"]}
JSON_SPEC = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
REGEX = r"[a-c]{2,5}-\d{1,3}(\.\d)?"
CHOICES = ["yes", "no", 'say "hi"', "back\\slash", "naïve ☃"]
# (1,x,2) style tuples; the equivalent Python regex checks the output
EBNF = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x" | "yy"'
EBNF_RE = r"\((?:[0-9]|x|yy)(?:,(?:[0-9]|x|yy))*\)"
SAMPLING = {"greedy": dict(temperature=0.0), "seeded": dict(temperature=1.0, seed=11)}


@pytest.fixture(scope="module")
def llm(tiny_llama_bytes):
    return LLM(tiny_llama_bytes, num_gpu_blocks_override=128, max_model_len=512)


def _clean(llm):
    eng = llm.llm_engine
    eng.check_invariants()
    assert not eng.requests
    assert eng.kv.bm.num_free_blocks == eng.kv.bm.num_blocks


def _gen(llm, prompts, so=None, **kw):
    kw.setdefault("max_tokens", 128)
    return llm.generate(prompts, SamplingParams(structured_outputs=so, **kw), use_tqdm=False)


def _check_schema(text):
    obj = json.loads(text)
    if jsonschema_rs is not None:
        jsonschema_rs.validate(SCHEMA, obj)
    assert obj["name"] in ("ann", "bob", "carol") and isinstance(obj["ok"], bool)
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 120
    assert len(obj["tags"]) <= 3 and set(obj) == {"name", "age", "ok", "tags"}
    return obj


def _texts(outs):
    comps = [c for o in outs for c in o.outputs]
    assert all(c.finish_reason == "stop" for c in comps), [(c.text, c.finish_reason)
                                                           for c in comps]
    return [c.text for c in comps]


# ---------------------------------------------------------------- parameters

def test_params_validation():
    assert GuidedDecodingParams is StructuredOutputsParams
    assert StructuredOutputsParams(regex="a+").kind == "regex"
    for bad, word in [({}, "exactly one"), (dict(regex="a", choice=["a"]), "exactly one"),
                      (dict(json="{not json"), "json"), (dict(json=3), "json"),
                      (dict(choice=[]), "choice"), (dict(choice=["a", 1]), "choice"),
                      (dict(grammar=""), "grammar"), (dict(json_object=False), "exactly one")]:
        with pytest.raises(ValueError, match=word):
            StructuredOutputsParams(**bad)
    so = StructuredOutputsParams(choice=("a", "b"))
    assert so.choice == ["a", "b"]
    p = SamplingParams(guided_decoding=so)          # upstream's older keyword
    assert p.structured_outputs is so and p.guided_decoding is so
    with pytest.raises(ValueError, match="guided_decoding"):
        SamplingParams(guided_decoding=so, structured_outputs=StructuredOutputsParams(regex="a"))
    for ids in ([], [-1], [1.5], [True]):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=ids)
    assert SamplingParams(allowed_token_ids=(3, 4)).allowed_token_ids == [3, 4]


# ---------------------------------------------------------------- every kind of spec

@pytest.mark.parametrize("mode", SAMPLING)
def test_json_schema(llm, mode):
    outs = _gen(llm, ["Hello", "w1"], JSON_SPEC, n=3, **SAMPLING[mode])
    objs = [_check_schema(t) for t in _texts(outs)]
    if mode == "seeded":        # samples differ: the mask restricts, it does not decide
        assert len({json.dumps(o) for o in objs}) > 1
    _clean(llm)


@pytest.mark.parametrize("mode", SAMPLING)
def test_json_object(llm, mode):
    # the random model writes long strings: a bias on '"' and '}' closes them sooner ('"' the
    # stronger: inside a string both are legal, and equal biases left the choice to the last
    # bits of the logits, which differ between kernel paths); only the grammar makes it JSON
    tok = llm.get_tokenizer()
    bias = {tok.convert_tokens_to_ids('"'): 8.0, tok.convert_tokens_to_ids("}"): 5.0}
    so = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    outs = _gen(llm, ["Hello", "w1"], so, n=3, logit_bias=bias, max_tokens=256,
                **SAMPLING[mode])
    assert all(isinstance(json.loads(t), dict) for t in _texts(outs))
    _clean(llm)


@pytest.mark.parametrize("mode", SAMPLING)
def test_regex(llm, mode):
    texts = _texts(_gen(llm, ["Hello", "xyz"], StructuredOutputsParams(regex=REGEX), n=3,
                        **SAMPLING[mode]))
    assert all(re.fullmatch(REGEX, t) for t in texts), texts
    _clean(llm)


@pytest.mark.parametrize("mode", SAMPLING)
def test_choice(llm, mode):
    # quotes, a backslash and non-ASCII text: the choice grammar escapes them
    outs = _gen(llm, ["Hello", "abc", "q"], StructuredOutputsParams(choice=CHOICES), n=3,
                **SAMPLING[mode])
    texts = _texts(outs)
    assert set(texts) <= set(CHOICES), texts
    if mode == "seeded":
        assert len(set(texts)) > 1
    _clean(llm)


@pytest.mark.parametrize("mode", SAMPLING)
def test_ebnf_grammar(llm, mode):
    texts = _texts(_gen(llm, ["Hello", "w1"], StructuredOutputsParams(grammar=EBNF), n=3,
                        **SAMPLING[mode]))
    assert all(re.fullmatch(EBNF_RE, t) for t in texts), texts
    _clean(llm)


@pytest.mark.parametrize("mode", SAMPLING)
def test_allowed_token_ids(llm, mode):
    allowed = llm.get_tokenizer().encode("abc 123")
    outs = _gen(llm, ["Hello", "w1"], None, n=3, max_tokens=24, ignore_eos=True,
                allowed_token_ids=allowed, **SAMPLING[mode])
    for c in (c for o in outs for c in o.outputs):
        assert len(c.token_ids) == 24 and set(c.token_ids) <= set(allowed)
    _clean(llm)


def test_allowed_token_ids_out_of_vocabulary(llm):
    vocab = llm.llm_engine.model.config.vocab_size
    with pytest.raises(ValueError, match="out of vocabulary") as e:
        _gen(llm, "Hello", allowed_token_ids=[5, vocab])
    assert "out-of-vocab" in str(e.value)           # upstream's wording
    _clean(llm)


def test_specs_per_prompt_and_mixed_batch(llm):
    """A list of params (one spec per prompt, one unconstrained) in one batch: each row gets
    its own mask and only its own; the unconstrained row equals its run alone."""
    free = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = llm.generate("w1", free, use_tqdm=False)[0].outputs[0].token_ids
    params = [SamplingParams(temperature=0, max_tokens=128, structured_outputs=so)
              for so in (JSON_SPEC, StructuredOutputsParams(regex=REGEX))]
    outs = llm.generate(["Hello", "w1", "abc"], [params[0], free, params[1]], use_tqdm=False)
    _check_schema(outs[0].outputs[0].text)
    assert outs[1].outputs[0].token_ids == alone
    assert re.fullmatch(REGEX, outs[2].outputs[0].text)
    _clean(llm)


def test_logprobs_see_the_grammar_not_allowed_token_ids(llm):
    """As upstream: its runner masks the grammar before the sampler reads raw logprobs, and
    allowed_token_ids is applied after them (an upstream choice we keep)."""
    tok = llm.get_tokenizer()
    first = {tok.encode(c)[0] for c in CHOICES}
    out = _gen(llm, "Hello", StructuredOutputsParams(choice=CHOICES), temperature=0,
               logprobs=10)[0].outputs[0]
    lp0 = out.logprobs[0]
    assert {t for t, lp in lp0.items() if lp.logprob > float("-inf")} == first
    allowed = tok.encode("abc")
    out = _gen(llm, "Hello", None, temperature=0, logprobs=10, max_tokens=3,
               allowed_token_ids=allowed)[0].outputs[0]
    assert out.token_ids[0] in allowed
    assert any(t not in allowed and lp.logprob > float("-inf")
               for t, lp in out.logprobs[0].items())
    _clean(llm)


def test_stop_string_with_grammar(llm):
    so = StructuredOutputsParams(choice=["yes please", "no thanks"])
    outs = _gen(llm, ["Hello", "abc"], so, n=3, stop=[" "], **SAMPLING["seeded"])
    for c in (c for o in outs for c in o.outputs):
        assert c.text in ("yes", "no") and c.finish_reason == "stop" and c.stop_reason == " "
    _clean(llm)


def test_terminated_grammar_stops_under_ignore_eos(llm):
    eos = llm.get_tokenizer().eos_token_id
    out = _gen(llm, "Hello", StructuredOutputsParams(choice=["yes", "no"]), temperature=0,
               ignore_eos=True)[0].outputs[0]
    # the grammar allows only EOS once complete; accepting it terminates the grammar
    assert out.text in ("yes", "no") and out.token_ids[-1] == eos
    assert out.finish_reason == "stop" and out.stop_reason is None
    _clean(llm)


# ---------------------------------------------------------------- compile cache and errors

def test_compile_cache(llm):
    cache = llm.llm_engine.structured_output
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}
    before = cache.num_compiles
    for spec in (schema, json.dumps(schema, indent=2)):       # same schema, other spelling
        _gen(llm, "Hello", StructuredOutputsParams(json=spec, disable_any_whitespace=True),
             n=3, max_tokens=32)
    assert cache.num_compiles == before + 1                   # once for 2 requests x 3 samples
    cache.validate(StructuredOutputsParams(json=schema))     # any whitespace: another grammar
    assert cache.num_compiles == before + 2
    _clean(llm)


@pytest.mark.parametrize("field, spec", [
    ("json", {"type": "object", "properties": {"a": {"type": "no-such-type"}}}),
    ("regex", "(unclosed"),
    ("grammar", 'root ::= undefined_rule'),
])
def test_invalid_spec_leaves_no_state(llm, field, spec):
    so = StructuredOutputsParams(**{field: spec})
    with pytest.raises(StructuredOutputError) as e:
        llm.llm_engine.structured_output.validate(so)
    assert e.value.field == field and isinstance(e.value, ValueError)
    good = SamplingParams(max_tokens=4)
    with pytest.raises(StructuredOutputError) as e:     # the first prompt is withdrawn too
        llm.generate(["Hello", "w1"], [good, SamplingParams(structured_outputs=so)],
                     use_tqdm=False)
    assert e.value.field == field
    _clean(llm)


# ---------------------------------------------------------------- beside KV management

@pytest.mark.parametrize("reclamation", RECLAMATION_MODES)
def test_grammar_with_every_eviction_policy(tiny_llama_bytes, reclamation):
    """Every policy (one request each, in one batch) evicts down to 16 live tokens while the
    JSON is written: the grammar follows the output tokens, not the KV."""
    llm = LLM(tiny_llama_bytes, num_gpu_blocks_override=64, max_model_len=256, block_size=4,
              kv_eviction_policy="h2o", kv_min_tokens=0, kv_budget_tokens=16,
              kv_reclamation=reclamation, kv_frag_threshold=0.0, kv_check_invariants=True)
    policies = [p for p in policy_names() if p != "none"]
    prompt = "Write the record of a person as JSON please: "
    outs = llm.generate([prompt] * len(policies),
                        SamplingParams(temperature=0.8, seed=5, max_tokens=128,
                                       structured_outputs=JSON_SPEC),
                        use_tqdm=False, kv_eviction=[KVEvictionParams(policy=p)
                                                     for p in policies])
    for o in outs:
        _check_schema(_texts([o])[0])
        assert o.kv_stats.get("evicted_tokens", 0) > 0
    stats = llm.get_kv_stats()
    if reclamation != "none":      # the KV really moved under the grammar's sequences
        assert stats["relocated_tokens"] + stats["hole_slots_reused"] > 0
    _clean(llm)


def test_grammar_survives_preemption(tiny_llama_bytes):
    """A pool too small for the batch preempts by recompute; the re-prefilled sequences keep
    their grammar state and give what an unpressed engine gives."""
    prompts = [f"Record number {i} as JSON: " for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=128, structured_outputs=JSON_SPEC)
    roomy = LLM(tiny_llama_bytes, num_gpu_blocks_override=128, max_model_len=256)
    ref = [o.outputs[0].text for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = LLM(tiny_llama_bytes, num_gpu_blocks_override=14, block_size=8, max_model_len=256)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert _texts(outs) == ref
    for t in ref:
        _check_schema(t)
    _clean(tight)


# ---------------------------------------------------------------- the sampler alone

def test_sampler_masks_only_grammar_rows(llm):
    eng = llm.llm_engine
    sampler = Sampler()
    logits = torch.randn(3, eng.model.config.vocab_size)
    plain = SamplingParams(temperature=0)
    rows = [SamplingRow(plain, None, 0, 2) for _ in range(3)]
    expected = logits.argmax(dim=1).tolist()
    assert sampler(logits.clone(), rows).token_ids == expected
    assert sampler.bitmask is None           # no grammar row: nothing allocated, nothing run
    grammar = eng.structured_output.new_grammar(StructuredOutputsParams(choice=["yes", "no"]))
    rows[1] = SamplingRow(plain, None, 0, 2, grammar=grammar)
    out = sampler(logits.clone(), rows).token_ids
    tok = llm.get_tokenizer()
    assert out[0] == expected[0] and out[2] == expected[2]
    assert out[1] in (tok.encode("yes")[0], tok.encode("no")[0])
