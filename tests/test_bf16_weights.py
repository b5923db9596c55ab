"""bf16 weights on the CPU: --dtype bfloat16 (and --dtype auto on a bf16 checkpoint, where the
kernels win) keeps every GEMM weight in bf16 (BF16Linear: the float32 C GEMM on bf16 panels,
widened exactly), with float32 activations and accumulation; a GGUF's BF16 tensors run the same
way. The KV cache is bf16 by default then (--kv-cache-dtype auto, as upstream); with a float32
KV cache the math is float32 on the bf16 values, so greedy tokens equal transformers' float32
run of the same bf16 checkpoint."""
import pytest
import torch

from conftest import build_tiny_model, hf_greedy, random_prompts
from vllm import LLM, SamplingParams
from vllm.kernels import quant_kernels

pytestmark = pytest.mark.skipif(not quant_kernels.available(), reason="no C compiler")


@pytest.fixture(scope="module")
def bf16_models(tmp_path_factory):
    """The tiny Llama, Mistral and Qwen2 (tied head, q/k/v biases) saved in bfloat16."""
    import transformers
    root = tmp_path_factory.mktemp("bf16")
    out = {}
    for arch in ("llama", "mistral", "qwen2"):
        src = build_tiny_model(str(root / f"{arch}-f32"), arch, seed=3)
        model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
        model.save_pretrained(str(root / arch))
        transformers.AutoTokenizer.from_pretrained(src).save_pretrained(str(root / arch))
        out[arch] = str(root / arch)
    return out


def _model(llm):
    return llm.llm_engine.model_executor.driver_worker.model


def _greedy(llm, prompts, n=12, **kwargs):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kwargs)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_bfloat16_keeps_gemms_in_bf16_and_matches_transformers(bf16_models, arch):
    """Every GEMM (and the tied or untied LM head) is a BF16Linear, the C decode layer runs its
    bf16 panels; with a float32 KV cache, greedy tokens equal transformers' float32 run of the
    same bf16 weights, for prompts of ragged lengths batched together."""
    from vllm.model_executor.bf16_linear import BF16Linear

    llm = LLM(model=bf16_models[arch], dtype="bfloat16", num_gpu_blocks_override=128,
              kv_cache_dtype="float32")
    model = _model(llm)
    assert llm.llm_engine.model_config.dtype == "float32"
    for layer in model.layers:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            assert isinstance(lin, BF16Linear) and lin.packed.dtype == torch.bfloat16
        assert layer.fused is not None and layer.fused.bf16 == 1
    assert isinstance(model.lm_head, BF16Linear)
    assert llm.llm_engine.model_executor.driver_worker.kv_dtype == torch.float32
    prompts = random_prompts(6, seed=5)
    got = [o.outputs[0].token_ids for o in _greedy(llm, prompts)]
    assert got == hf_greedy(bf16_models[arch], prompts, 12)


def test_bf16_logprobs_equal_float32_on_the_same_weights(bf16_models):
    """Prompt and sampled logprobs of --dtype bfloat16 within 1e-4 of --dtype float32 on the same
    bf16 checkpoint, both on a float32 KV cache (the same float32 values; only summation order
    may differ)."""
    prompts = random_prompts(3, seed=6)
    outs = {}
    for dtype in ("bfloat16", "float32"):
        llm = LLM(model=bf16_models["llama"], dtype=dtype, num_gpu_blocks_override=128,
                  kv_cache_dtype="float32")
        outs[dtype] = _greedy(llm, prompts, 8, logprobs=3, prompt_logprobs=3)
    for a, b in zip(outs["bfloat16"], outs["float32"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.prompt_logprobs[1:] + a.outputs[0].logprobs,
                        b.prompt_logprobs[1:] + b.outputs[0].logprobs):
            shared = set(x) & set(y)
            assert len(shared) >= 3
            assert max(abs(x[t].logprob - y[t].logprob) for t in shared) < 1e-4


@pytest.mark.parametrize("policy", ["h2o", "keydiff"])
def test_bf16_naive_evict_and_vtoken_identical(bf16_models, policy):
    prompts = random_prompts(3, seed=7, lo=60, hi=90)
    outs = {}
    for mode in ("none", "vtoken"):
        llm = LLM(model=bf16_models["llama"], dtype="bfloat16", num_gpu_blocks_override=128,
                  kv_eviction_policy=policy, kv_reclamation=mode, kv_frag_threshold=0.0,
                  kv_min_tokens=0, kv_budget_tokens=40, kv_check_invariants=True)
        outs[mode] = [o.outputs[0].token_ids for o in _greedy(llm, prompts, 24)]
        stats = llm.get_kv_stats()
        assert stats["evicted_tokens"] > 0
        assert mode == "none" or stats["relocation_events"] > 0
    assert outs["none"] == outs["vtoken"]


def test_c_decode_layer_on_bf16_equals_the_per_op_path(bf16_models, monkeypatch):
    """The C decode layer multiplies the same bf16 panels as BF16Linear: tokens and logprobs of
    a batch (H2O: the attention mass too) equal the op-by-op path within float32 order."""
    from vllm.model_executor import cpu_decode

    llm = LLM(model=bf16_models["qwen2"], dtype="bfloat16", num_gpu_blocks_override=128,
              kv_eviction_policy="h2o", kv_budget_tokens=24, kv_min_tokens=0)
    model = _model(llm)
    in_c = []
    c_stack = cpu_decode._c_stack
    monkeypatch.setattr(cpu_decode, "_c_stack",
                        lambda layers, tensors: in_c.append(1) or c_stack(layers, tensors))
    bands = list(model.plan.decode_layer)
    prompts = random_prompts(3, seed=8, lo=10, hi=35)
    outs = {}
    for fused in (True, False):
        model.plan.decode_layer = [fused] * len(bands)
        outs[fused] = _greedy(llm, prompts, 12, logprobs=3)
        assert (len(in_c) > 0) == fused
        in_c.clear()
    assert llm.get_kv_stats()["evicted_tokens"] > 0
    for c, op in zip(outs[True], outs[False]):
        assert c.outputs[0].token_ids == op.outputs[0].token_ids
        for a, b in zip(c.outputs[0].logprobs, op.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert max(abs(a[t].logprob - b[t].logprob) for t in a) < 1e-4


@pytest.mark.parametrize("dtype, kv_cache_dtype, expect", [
    ("auto", "auto", torch.bfloat16), ("bfloat16", "auto", torch.bfloat16),
    ("float32", "auto", torch.float32), ("bfloat16", "float32", torch.float32)])
def test_kv_cache_follows_the_weights(bf16_models, dtype, kv_cache_dtype, expect):
    """--kv-cache-dtype auto: bf16 under bf16 weights (upstream's cache for a bf16 model), float32
    under float32 weights; a dtype asked for is kept."""
    llm = LLM(model=bf16_models["llama"], dtype=dtype, kv_cache_dtype=kv_cache_dtype,
              num_gpu_blocks_override=32)
    assert llm.llm_engine.model_executor.driver_worker.kv_dtype == expect


def test_auto_on_a_float32_checkpoint_stays_float32(tiny_llama):
    from vllm.model_executor.models.llama import Linear

    llm = LLM(model=tiny_llama, num_gpu_blocks_override=64)
    model = _model(llm)
    assert isinstance(model.layers[0].qkv, Linear) and model.quant_layers is None
    assert model.layers[0].qkv.packed is None or model.layers[0].qkv.packed.dtype == torch.float32
    assert llm.llm_engine.model_executor.driver_worker.kv_dtype == torch.float32


@pytest.mark.parametrize("crossover", [4, 0, 10 ** 6])
def test_auto_on_a_bf16_checkpoint_runs_bf16_where_timed_faster(bf16_models, monkeypatch,
                                                                 crossover):
    """--dtype auto on a bf16 checkpoint: bf16 layers below the load-time crossover, float32 from
    it (a side that wins no band is dropped); tokens equal transformers' either way."""
    from vllm.model_executor.bf16_linear import BF16Linear
    from vllm.model_executor.models.llama import Linear, LlamaForCausalLM

    monkeypatch.setattr(LlamaForCausalLM, "quant_crossover", lambda self: crossover)
    llm = LLM(model=bf16_models["llama"], num_gpu_blocks_override=128, kv_cache_dtype="float32")
    model = _model(llm)
    if crossover == 4:
        assert model.quant_below == 4 and isinstance(model.layers[0].qkv, Linear)
        assert isinstance(model.quant_layers[0].qkv, BF16Linear)
    else:
        kind = BF16Linear if crossover else Linear
        assert model.quant_layers is None and isinstance(model.layers[0].qkv, kind)
        assert isinstance(model.lm_head, kind)
    prompts = random_prompts(5, seed=9)
    got = [o.outputs[0].token_ids for o in _greedy(llm, prompts)]
    assert got == hf_greedy(bf16_models["llama"], prompts, 12)


def test_auto_crossover_is_timed_on_a_bf16_model(bf16_models):
    from vllm.model_executor.cpu_decode import CROSSOVER_ROWS

    model = _model(LLM(model=bf16_models["mistral"], num_gpu_blocks_override=64))
    assert model.quant_below in (0,) + CROSSOVER_ROWS[1:]
    assert (model.quant_layers is None) == (model.quant_below == 0)


def test_bfloat16_with_tensor_parallelism_keeps_the_torch_path(bf16_models):
    """The bf16 kernels run at tensor parallel size 1; TP keeps torch's bfloat16 path (the
    resolution only, no worker processes)."""
    from transformers import AutoConfig

    from vllm.model_executor.model_loader import BF16_WEIGHTS_ATTR, resolve_cpu_dtype

    cfg = AutoConfig.from_pretrained(bf16_models["llama"])
    assert resolve_cpu_dtype("bfloat16", "cpu", cfg, 2, "none") == "bfloat16"
    assert not hasattr(cfg, BF16_WEIGHTS_ATTR)
    assert resolve_cpu_dtype("bfloat16", "cuda", cfg, 1, "none") == "bfloat16"
    assert resolve_cpu_dtype("auto", "cpu", cfg, 1, "none") == "float32"
    assert getattr(cfg, BF16_WEIGHTS_ATTR) == "auto"


def test_gguf_bf16_tensors_run_in_bf16(tmp_path, monkeypatch):
    """A GGUF whose GEMM weights are BF16 (llama-quantize's BF16): they stay bf16 under the
    default --quantization auto, tokens and logprobs as the file dequantized to float32 (both on
    the bf16 KV cache auto gives the GGUF)."""
    pytest.importorskip("gguf")
    from gguf_kquants import write_llama_gguf

    from vllm.model_executor import gguf_loader
    from vllm.model_executor.bf16_linear import BF16Linear
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.kernels.quant_kernels import BF16

    original = gguf_loader.converted_dir_for
    monkeypatch.setattr(gguf_loader, "converted_dir_for",
                        lambda path, cache_dir=None: original(path, str(tmp_path / "cache")))
    monkeypatch.setattr(LlamaForCausalLM, "quant_crossover", lambda self: 10 ** 6)
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    path = write_llama_gguf(str(tmp_path / "bf16.gguf"), seed=1,
                            layer_types=[dict.fromkeys(names, BF16)] * 2, embd=BF16, output=BF16)
    llms = {q: LLM(model=path, quantization=q, num_gpu_blocks_override=128,
                   kv_cache_dtype="bfloat16") for q in ("auto", "none")}
    model = _model(llms["auto"])
    assert isinstance(model.layers[1].down, BF16Linear) and isinstance(model.lm_head, BF16Linear)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (30, 7)]
    a, b = (_greedy(llms[q], prompts, 8, logprobs=3) for q in ("auto", "none"))
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for p, q in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert max(abs(p[t].logprob - q[t].logprob) for t in set(p) & set(q)) < 1e-4
