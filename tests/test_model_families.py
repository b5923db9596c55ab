"""Model families beyond the Llama layer (Qwen3, Gemma 3) and sliding windows (Mistral's
`sliding_window`, Gemma's per-layer types): greedy tokens identical to transformers in float32
on tiny random checkpoints whose every norm weight is randomized (a missing multiply or a
missing (1 + w) fails), windows small and prompts longer than them."""
import pytest
import torch

from tests.conftest import COMMON, FAMILIES, _tokenizer, hf_greedy, random_prompts
from vllm import LLM, SamplingParams
from vllm.config import EVICTION_POLICIES
from vllm.kernels import ops

MAX_NEW = 24


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, seed=11, lo=20, hi=50)       # every prompt longer than a window


@pytest.fixture(scope="module")
def references(family_models, prompts):
    return {f: hf_greedy(path, prompts, MAX_NEW) for f, path in family_models.items()}


def _generate(model_dir, prompts, params=None, **kwargs):
    llm = LLM(model_dir, **kwargs)
    params = params or SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.check_invariants()
    assert llm.llm_engine.kv.bm.num_free_blocks == llm.llm_engine.kv.bm.num_blocks
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("family", FAMILIES)
def test_batch1_matches_transformers(family_models, prompts, references, family):
    got, _ = _generate(family_models[family], prompts[:1])
    assert got == references[family][:1]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunked,prefix", [(False, False), (True, False), (True, True)])
def test_mixed_batch_matches_transformers(family_models, prompts, references, family, chunked,
                                          prefix):
    kwargs = dict(enable_prefix_caching=prefix, num_gpu_blocks_override=256)
    if chunked:
        kwargs.update(max_num_batched_tokens=16)       # multi-chunk prompts (masked chunks)
    else:
        kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=1024,
                      max_model_len=1024)
    got, _ = _generate(family_models[family], prompts, **kwargs)
    assert got == references[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_prefix_hits_give_the_tokens_of_a_miss(family_models, family):
    base = random_prompts(1, seed=7, lo=40, hi=41)[0]
    prompts = [base + [5 + i, 9, 11] for i in range(3)]
    ref = hf_greedy(family_models[family], prompts, MAX_NEW)
    llm = LLM(family_models[family], enable_prefix_caching=True, num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == ref
    assert llm.llm_engine.kv.bm.pool.num_free == llm.llm_engine.kv.bm.num_blocks


@pytest.mark.parametrize("family", ["gemma3", "mistral-w12"])
def test_preemption_matches_transformers(family_models, prompts, references, family):
    got, llm = _generate(family_models[family], prompts, num_gpu_blocks_override=14,
                         block_size=8)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert got == references[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_backend_matches_transformers(family_models, prompts, references, family):
    with ops.forced_backend("torch"):
        got, _ = _generate(family_models[family], prompts, num_gpu_blocks_override=256)
    assert got == references[family]


@pytest.mark.parametrize("family", ["gemma3", "mistral-w12"])
def test_budget_above_the_length_gives_the_tokens_of_no_policy(family_models, prompts,
                                                                references, family):
    got, llm = _generate(family_models[family], prompts, num_gpu_blocks_override=256,
                         kv_eviction_policy="h2o", kv_budget_tokens=512, kv_min_tokens=0)
    assert got == references[family]
    assert llm.llm_engine.get_kv_stats()["evicted_tokens"] == 0


@pytest.mark.parametrize("family", ["gemma3", "mistral-w12"])
@pytest.mark.parametrize("policy", [p for p in EVICTION_POLICIES if p != "none"])
def test_naive_evict_equals_vtoken(family_models, prompts, family, policy):
    """Eviction on a model with sliding layers: vToken only changes where bytes live."""
    outs = {}
    for mode in ("none", "vtoken"):
        outs[mode], llm = _generate(family_models[family], prompts, block_size=8,
                                    num_gpu_blocks_override=256, kv_eviction_policy=policy,
                                    kv_budget_tokens=24, kv_min_tokens=0, kv_reclamation=mode,
                                    kv_check_invariants=True)
        assert llm.llm_engine.get_kv_stats()["evicted_tokens"] > 0
    assert outs["none"] == outs["vtoken"]


def test_full_layers_alone_feed_the_statistics(family_models):
    """Gemma 3's sliding layers add no decode mass: every scored row sums to the full layers'
    count times the heads (each layer-head's probabilities sum to one)."""
    from vllm.model_executor.layers.attention import attention_specs, scores_from
    llm = LLM(family_models["gemma3"], num_gpu_blocks_override=64)
    cfg = llm.llm_engine.model.config
    specs = attention_specs(cfg)
    assert scores_from(specs) == [s.sliding_window is None for s in specs]
    assert [s.sliding_window for s in specs] == [8, 8, None, 8, 8, None]
    assert llm.llm_engine.kv.eviction.num_layer_heads == 2 * cfg.num_attention_heads


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_dummy_weights_from_config_alone(family_models, family):
    got, llm = _generate(family_models[family], random_prompts(2, seed=3), load_format="dummy",
                         num_gpu_blocks_override=64)
    assert all(len(t) == MAX_NEW for t in got)


def test_windowed_decode_views_worked_example():
    from vllm.attention.backend import AttentionMetadata
    meta = AttentionMetadata(slot_mapping=torch.tensor([4, 3]), num_decodes=2,
                             decode_views=torch.tensor([[5, 9, 7, 4], [8, 3, -1, -1]]),
                             decode_lens=torch.tensor([4, 2]),
                             decode_mass=torch.zeros(2, 4), window_skip=torch.tensor([2, 0]))
    win = meta.for_layer(2, scores=True)
    assert win.decode_views.tolist() == [[7, 4], [8, 3]] and win.decode_lens.tolist() == [2, 2]
    assert meta.for_layer(2, scores=True) is win and meta.for_layer(None, True) is meta
    win.decode_mass += torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    meta.fold_window_mass()
    assert meta.decode_mass.tolist() == [[0, 0, 0.25, 0.75], [0.5, 0.5, 0, 0]]
    assert meta.for_layer(2, scores=False).decode_mass is None


def test_layer_types_the_engine_cannot_run_are_errors():
    from types import SimpleNamespace
    from vllm.model_executor.layers.attention import attention_specs
    with pytest.raises(ValueError, match="chunked_attention"):
        attention_specs(SimpleNamespace(num_hidden_layers=2, sliding_window=None,
                                        layer_types=["full_attention", "chunked_attention"]))
    with pytest.raises(ValueError, match="sliding_window"):
        attention_specs(SimpleNamespace(num_hidden_layers=1, sliding_window=None,
                                        layer_types=["sliding_attention"]))


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    import transformers
    cfg = transformers.LlamaConfig(**COMMON, num_hidden_layers=1)
    cfg.architectures = ["FalconForCausalLM"]
    cfg.save_pretrained(tmp_path)
    _tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="Gemma3ForCausalLM"):
        LLM(str(tmp_path), load_format="dummy")


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_tensor_parallel_matches_one_process(family_models, prompts, references, family):
    """TP = 2 (heads 4, KV heads 2 divide): per-head norms whole on every rank, Gemma's
    post-attention / post-feedforward norms after the all-reduce; eviction on, vToken."""
    from tests.test_tensor_parallel import EVICT, run
    one, _ = run(family_models[family], 1, kv_eviction_policy="h2o", **EVICT)
    two, stats = run(family_models[family], 2, kv_eviction_policy="h2o", **EVICT)
    assert two == one and stats["evicted_tokens"] > 0
    got, _ = _generate(family_models[family], prompts, tensor_parallel_size=2)
    assert got == references[family]
