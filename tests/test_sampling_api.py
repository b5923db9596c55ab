"""The offline API's sampling features through the whole engine, and its input validation."""
import pytest

from vllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, num_gpu_blocks_override=128, max_model_len=256)


def _clean(llm):
    eng = llm.llm_engine
    eng.check_invariants()
    assert eng.kv.bm.num_free_blocks == eng.kv.bm.num_blocks
    assert not eng.requests


def test_string_prompts_and_text(llm):
    outs = llm.generate(["w5 w9 w13", "w100 w7"], SamplingParams(temperature=0, max_tokens=5,
                                                                  ignore_eos=True), use_tqdm=True)
    for o in outs:
        assert len(o.outputs[0].token_ids) == 5 and o.outputs[0].finish_reason == "length"
        assert o.outputs[0].text == llm.get_tokenizer().decode(o.outputs[0].token_ids)
    _clean(llm)


def test_n_samples_seeded_are_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=123, max_tokens=8, ignore_eos=True)
    a = llm.generate("w5 w6 w7", params, use_tqdm=False)[0]
    b = llm.generate("w5 w6 w7", params, use_tqdm=False)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    _clean(llm)


def test_seeded_request_same_alone_and_in_batch(llm):
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True)
    alone = llm.generate("w20 w21", seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)] * 3
    batch = llm.generate(["w1 w2 w3", "w20 w21", "w30", "w40 w41"], [others[0], seeded] + others[1:],
                         use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone


def test_stop_token_ids_and_strings(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = llm.generate("w5 w9 w13", greedy, use_tqdm=False)[0].outputs[0]
    stop_id = ref.token_ids[4]
    first = ref.token_ids.index(stop_id)
    out = llm.generate("w5 w9 w13", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                   stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.token_ids[:first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id
    # as upstream: the stop token's text is left out unless include_stop_str_in_output
    tok = llm.get_tokenizer()
    assert out.outputs[0].text == tok.decode(ref.token_ids[:first])
    kept = llm.generate("w5 w9 w13", SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id],
        include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == tok.decode(ref.token_ids[:first + 1])
    word = tok.decode([stop_id])
    out = llm.generate("w5 w9 w13", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                   stop=[word]), use_tqdm=False)[0].outputs[0]
    assert out.stop_reason == word and word not in out.text
    assert out.text == ref.text[:ref.text.index(word)]
    _clean(llm)


def test_min_tokens_and_eos(llm):
    eos = llm.get_tokenizer().eos_token_id
    out = llm.generate("w5", SamplingParams(temperature=0, max_tokens=20, min_tokens=6,
                                            stop_token_ids=list(range(3, 512))),
                       use_tqdm=False)[0].outputs[0]
    # the first 6 tokens avoid every stop id and eos; the first stop id after that ends it
    assert set(out.token_ids[:6]) <= {0, 1} and out.finish_reason == "stop"
    assert len(out.token_ids) >= 7 and out.token_ids[-1] >= 3 and eos not in out.token_ids


def test_logprobs_and_prompt_logprobs(llm):
    out = llm.generate("w5 w9 w13 w40", SamplingParams(temperature=0, max_tokens=4, logprobs=3,
                                                       prompt_logprobs=2, ignore_eos=True),
                       use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 4
    for tok, lp in zip(c.token_ids, c.logprobs):
        assert tok in lp and lp[tok].rank == 1 and len(lp) == 3   # greedy token is the top-1
    assert c.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in
                                                     zip(c.token_ids, c.logprobs)))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 4
    for tok, lp in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert tok in lp


@pytest.mark.parametrize("prompt,match", [
    ("", "empty"),
    ({"prompt_token_ids": [5] * 300}, "maximum model length"),
    ({"prompt_token_ids": [5, 99999]}, "out of vocabulary"),
])
def test_bad_prompts_raise_and_leave_no_state(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["w5 w6", prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    _clean(llm)


def test_prompt_larger_than_pool_is_rejected(tiny_llama):
    small = LLM(tiny_llama, num_gpu_blocks_override=4, block_size=8)
    with pytest.raises(ValueError, match="KV blocks"):
        small.generate({"prompt_token_ids": [5] * 40}, SamplingParams(max_tokens=2), use_tqdm=False)
    _clean(small)


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0), dict(top_k=-5),
                                    dict(max_tokens=0), dict(n=0), dict(min_p=2),
                                    dict(min_tokens=5, max_tokens=2)])
def test_bad_sampling_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_sequence_that_outgrows_the_pool_finishes_as_kv_exhausted(tiny_llama):
    small = LLM(tiny_llama, num_gpu_blocks_override=3, block_size=8)
    out = small.generate({"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=50,
                                                                        ignore_eos=True),
                         use_tqdm=False)[0]
    # 24 slots hold the prompt and 14 outputs; the 15th is sampled but never needs KV. The
    # reason is not "length": max_tokens was not reached, the pool ran out.
    assert out.outputs[0].finish_reason == "kv_cache_exhausted"
    assert len(out.outputs[0].token_ids) == 15
    assert out.kv_stats["blocks_at_finish"] == 3 and out.kv_stats["live_tokens"] == 24
    _clean(small)


def test_chat_continue_final_message(llm):
    from tests.server_utils import CHAT_TEMPLATE
    msgs = [{"role": "user", "content": "w9"}, {"role": "assistant", "content": "w11 w12"}]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.chat(msgs, params, use_tqdm=False, chat_template=CHAT_TEMPLATE,
                   add_generation_prompt=False, continue_final_message=True)[0]
    # the prompt ends inside the assistant's message: no end-of-turn word (w4) after it
    assert out.prompt.rstrip().endswith("w11 w12")
    assert out.outputs[0].token_ids == llm.generate(
        {"prompt_token_ids": out.prompt_token_ids}, params, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="continue_final_message"):   # upstream's rule
        llm.chat(msgs, params, chat_template=CHAT_TEMPLATE, continue_final_message=True)
    _clean(llm)
