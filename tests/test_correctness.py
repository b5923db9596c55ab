"""Greedy outputs token-identical to transformers for tiny random Llama, Mistral and Qwen2."""
import pytest
import torch

from tests.conftest import greedy_checked, hf_greedy, random_prompts
from vllm import LLM, SamplingParams
from vllm.kernels import ops

MAX_NEW = 24


def _generate(model_dir, prompts, **kwargs):
    return greedy_checked(model_dir, prompts, MAX_NEW, **kwargs)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(8, seed=1, lo=5, hi=60)


@pytest.fixture(scope="module")
def references(tiny_models, prompts):
    return {arch: hf_greedy(path, prompts, MAX_NEW) for arch, path in tiny_models.items()}


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_batch1_matches_transformers(tiny_models, prompts, references, arch):
    got, _ = _generate(tiny_models[arch], prompts[:1])
    assert got == references[arch][:1]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("chunked,prefix", [(False, False), (True, False), (True, True)])
def test_mixed_batch_matches_transformers(tiny_models, prompts, references, arch, chunked, prefix):
    kwargs = dict(enable_prefix_caching=prefix, num_gpu_blocks_override=256)
    if chunked:
        kwargs.update(max_num_batched_tokens=16)   # forces multi-chunk prompts
    else:
        kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=1024,
                      max_model_len=1024)
    got, llm = _generate(tiny_models[arch], prompts, **kwargs)
    assert got == references[arch]
    # the C decode kernels ran where they can be built (head_dim 16, float32)
    assert (llm.llm_engine.model.layers[0].qkv.packed is not None) == ops.cpu_kernels_enabled()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_torch_fallback_matches_transformers(tiny_models, prompts, references, arch):
    """Without the C decode kernels (no compiler, or VLLM_KERNEL_BACKEND=torch): same tokens."""
    with ops.forced_backend("torch"):
        llm_got, llm = _generate(tiny_models[arch], prompts, num_gpu_blocks_override=256)
    assert all(layer.qkv.packed is None for layer in llm.llm_engine.model.layers)
    assert llm_got == references[arch]


def test_shared_prefix_hits_cache_and_matches(tiny_llama):
    base = random_prompts(1, seed=7, lo=40, hi=41)[0]
    prompts = [base + [5 + i, 9, 11] for i in range(4)]
    ref = hf_greedy(tiny_llama, prompts, MAX_NEW)
    llm = LLM(tiny_llama, enable_prefix_caching=True, num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == ref
    bm = llm.llm_engine.kv.bm
    assert bm.pool.num_free == bm.num_blocks


def test_forced_preemption_matches_transformers(tiny_llama, prompts, references):
    # 8 prompts of up to 60 tokens + 24 new tokens need ~40 blocks; 12 forces preemption.
    got, llm = _generate(tiny_llama, prompts, num_gpu_blocks_override=12, block_size=8)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert got == references["llama"]


def test_prompt_logits_match_transformers(tiny_models):
    import transformers
    prompt = random_prompts(1, seed=3, lo=30, hi=31)[0]
    for arch, path in tiny_models.items():
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
        llm = LLM(path, num_gpu_blocks_override=32, max_num_batched_tokens=8)
        out = llm.generate({"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        got = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], prompt[1:])]
        want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        assert torch.allclose(torch.tensor(got), want, atol=1e-4), arch


def test_repetition_penalty_matches_transformers(tiny_llama, prompts):
    """Greedy with repetition_penalty (over prompt + output, as transformers applies it)."""
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    refs = []
    with torch.no_grad():
        for p in prompts[:4]:
            g = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                            do_sample=False, repetition_penalty=1.3, pad_token_id=0)
            refs.append(g[0, len(p):].tolist())
    llm = LLM(tiny_llama)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                            repetition_penalty=1.3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs
    plain = llm.generate([{"prompt_token_ids": prompts[0]}],
                         SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
                         use_tqdm=False)
    assert plain[0].outputs[0].token_ids != refs[0]          # the penalty changed something


def test_load_format_dummy_runs_a_config_only_model(tmp_path):
    """--load-format dummy: seeded random weights from config.json alone (no weights, no
    tokenizer), token-identical to transformers running the same state dict."""
    import json
    import transformers
    from vllm.model_executor.model_loader import dummy_state_dict
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256,
                                   initializer_range=0.2)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    prompt = [5, 17, 42, 99, 7, 250]
    llm = LLM(str(tmp_path), load_format="dummy", seed=3, num_gpu_blocks_override=16)
    got = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    hf = transformers.LlamaForCausalLM(cfg)
    missing, _ = hf.load_state_dict(dummy_state_dict(cfg, seed=3), strict=False)
    assert missing in ([], ["lm_head.weight"])     # tied heads come from the embedding
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                          min_new_tokens=12)[0, len(prompt):].tolist()
    assert got == ref
    other = LLM(str(tmp_path), load_format="dummy", seed=4, num_gpu_blocks_override=16)
    assert json.loads((tmp_path / "config.json").read_text())["hidden_size"] == 64
    assert not torch.equal(other.llm_engine.model.embed, llm.llm_engine.model.embed)


def test_bfloat16_matches_transformers_in_bfloat16(tiny_llama):
    """The bf16 path (what --dtype auto picks on a GPU) on CPU, without the C kernels (which run
    --dtype bfloat16 in float32 on bf16 weights: test_bf16_weights.py): greedy tokens equal
    transformers running the same checkpoint in bf16."""
    import transformers
    ps = random_prompts(3, seed=1, lo=10, hi=30)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with ops.forced_backend("torch"):
        llm = LLM(tiny_llama, dtype="bfloat16", num_gpu_blocks_override=64)
    assert llm.llm_engine.kv_caches.dtype == torch.bfloat16
    got = [o.outputs[0].token_ids
           for o in llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = [hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                           min_new_tokens=8)[0, len(p):].tolist() for p in ps]
    assert got == ref
