"""Model families beyond the Llama layer (Qwen3, Gemma 3) and sliding windows (Mistral's
`sliding_window`, Gemma's per-layer types): greedy tokens identical to transformers in float32
on tiny random checkpoints whose every norm weight is randomized (a missing multiply or a
missing (1 + w) fails), windows small and prompts longer than them."""
import numpy as np
import pytest
import torch

from tests.conftest import COMMON, FAMILIES, _tokenizer, greedy_checked, hf_greedy, random_prompts
from vllm import LLM, SamplingParams
from vllm.core.eviction import policy_names
from vllm.kernels import ops

MAX_NEW = 24


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, seed=11, lo=20, hi=50)       # every prompt longer than a window


@pytest.fixture(scope="module")
def references(family_models, prompts):
    return {f: hf_greedy(path, prompts, MAX_NEW) for f, path in family_models.items()}


def _generate(model_dir, prompts, params=None, **kwargs):
    return greedy_checked(model_dir, prompts, MAX_NEW, params, **kwargs)


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
    assert llm.get_kv_stats()["prefix_cache_hit_blocks"] > 0   # hybrid: the windows' too


@pytest.mark.parametrize("family,blocks", [("gemma3", 18), ("mistral-w12", 14)])
def test_preemption_matches_transformers(family_models, prompts, references, family, blocks):
    """A pool too small for the batch (Gemma's blocks hold its 2 full layers' pages, its
    sliding windows 2 x 2 blocks a request)."""
    got, llm = _generate(family_models[family], prompts, num_gpu_blocks_override=blocks,
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
@pytest.mark.parametrize("policy", [p for p in policy_names() if p != "none"])
def test_naive_evict_equals_vtoken(family_models, prompts, family, policy):
    """Eviction on a model with sliding layers: vToken (and its hole-filling mode) only
    changes where bytes live."""
    outs = {}
    for mode in ("none", "vtoken", "vtoken-fill"):
        outs[mode], llm = _generate(family_models[family], prompts, block_size=8,
                                    num_gpu_blocks_override=256, kv_eviction_policy=policy,
                                    kv_budget_tokens=24, kv_min_tokens=0, kv_reclamation=mode,
                                    kv_check_invariants=True)
        assert llm.llm_engine.get_kv_stats()["evicted_tokens"] > 0
    assert outs["none"] == outs["vtoken"] == outs["vtoken-fill"]


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


def test_hybrid_decode_in_c_runs_layers_of_one_kind_together(family_models, prompts, references,
                                                             monkeypatch):
    """A decode step in C on Gemma 3 (layers s s F s s F; KV tensors 0 1 0 0 1 1 as KVGroups lays
    them out) is one decode_layers call per run of layers of one kind on consecutive tensors:
    [0, 1], [2], [3, 4], [5]; the tokens stay transformers'."""
    from vllm.kernels import cpu_kernels
    llm = LLM(family_models["gemma3"], num_gpu_blocks_override=64)
    model = llm.llm_engine.model_executor.driver_worker.model
    if model.plan is None or any(layer.fused is None for layer in model.layers):
        pytest.skip("no C decode layer on this machine")
    assert model.kv_groups.layer_tensor == (0, 1, 0, 0, 1, 1)
    model.plan.decode_layer = [True] * len(model.plan.decode_layer)
    calls = []
    decode_layers = cpu_kernels.decode_layers
    monkeypatch.setattr(cpu_kernels, "decode_layers", lambda layers, x, *a: calls.append(
        (len(layers), a[3].shape[0])) or decode_layers(layers, x, *a))
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == references["gemma3"][:1]
    assert calls == [(2, 2), (1, 1), (2, 2), (1, 1)] * (MAX_NEW - 1)


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


# ---- hybrid KV groups (layers/attention.py KVGroups, core/sliding_window_blocks.py) -----------
def test_kv_groups_worked_example():
    import transformers
    from vllm.model_executor.layers.attention import ONE_KV_GROUP_ATTR, kv_groups
    cfg = transformers.Gemma3TextConfig(num_hidden_layers=18, sliding_window=512)
    g = kv_groups(cfg)
    assert (g.num_tensors, g.num_sliding_groups, g.window) == (3, 5, 512)
    assert [i for i, k in enumerate(g.layer_group) if k == 0] == [5, 11, 17]
    assert [g.layer_tensor[i] for i in (5, 11, 17)] == [0, 1, 2]
    assert [i for i, k in enumerate(g.layer_group) if k == 2] == [3, 4, 6]
    # every tensor holds one layer of every group: no two layers of a group share one
    for k in range(6):
        tensors = [t for t, kk in zip(g.layer_tensor, g.layer_group) if kk == k]
        assert sorted(tensors) == list(range(3))
    setattr(cfg, ONE_KV_GROUP_ATTR, True)
    assert kv_groups(cfg).num_tensors == 18 and not kv_groups(cfg).hybrid
    mistral = transformers.MistralConfig(num_hidden_layers=4, sliding_window=12)
    assert not kv_groups(mistral).hybrid          # all sliding: one group, windowed views


def test_sliding_window_blocks_worked_example():
    from vllm.core.block_pool import BlockPool
    from vllm.core.sliding_window_blocks import SlidingWindowBlocks
    pool = BlockPool(32)
    sw = SlidingWindowBlocks(pool, block_size=4, window=8, num_groups=2)
    assert sw.blocks_needed("a", 0, 14) == 4 * 2
    sw.allocate("a", 0, 14)                       # a 14-token prompt chunk: ids 0..13
    assert sw.num_blocks_of("a") == 4 and pool.num_free == 32 - 8
    slots = sw.slots("a", np.array([0, 5, 13]))
    assert slots.shape == (3, 2) and (slots % 4 == np.array([[0], [1], [1]])).all()
    sw.release_behind("a", 14)                    # next query 14 sees ids >= 7: block 0 goes
    assert sw.num_blocks_of("a") == 3 and pool.num_free == 32 - 6
    for pos in range(14, 40):                     # decode: never more than ceil(8 / 4) + 1
        sw.allocate("a", pos, 1)
        sw.release_behind("a", pos + 1)
        assert sw.num_blocks_of("a") <= sw.max_blocks_per_request() == 3
        sw.check_invariants("a", pos + 1)
    sw.free("a")
    assert pool.num_free == 32 and sw.held == 0


def test_hybrid_sliding_blocks_stay_bounded_every_step(family_models):
    """Gemma 3 (window 8, block 4): every step, every running request holds at most
    ceil(W / B) + 1 blocks per sliding subgroup once decoding, none behind its window; the
    pool's accounting counts both groups; the tokens are transformers'."""
    llm = LLM(family_models["gemma3"], block_size=4, num_gpu_blocks_override=256,
              kv_check_invariants=True)
    eng = llm.llm_engine
    sw = eng.kv.sliding
    assert sw is not None and sw.num_groups == 2 and sw.window == 8
    assert eng.model_executor.driver_worker.kv_caches.shape[0] == 2      # g = 2 full layers
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = random_prompts(3, seed=4, lo=20, hi=40)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), {"prompt_token_ids": p}, params)
    peak = 0
    while eng.has_unfinished_requests():
        eng.step()
        eng.check_invariants()
        for seq in eng.kv.seqs.values():
            if seq.num_computed_tokens > len(seq.prompt_token_ids):
                assert sw.num_blocks_of(seq.seq_id) <= sw.max_blocks_per_request()
            peak = max(peak, sw.num_blocks_of(seq.seq_id))
        assert eng.get_kv_stats()["sliding_window_blocks"] == sw.held
    assert sw.held == 0 and eng.kv.bm.num_free_blocks == eng.kv.bm.num_blocks
    assert peak == sw.max_blocks_per_request()         # the bound is reached, never passed


def test_one_kv_group_gives_the_same_tokens(family_models, prompts, references):
    """--disable-hybrid-kv-cache-manager: every layer full-size in one group, windows as view
    conditions; prefix caching takes hits again; the same tokens. Its KV costs 6 layers a
    token where the hybrid groups cost the 2 full layers' (and a window's worth per request)."""
    got, llm = _generate(family_models["gemma3"], prompts, num_gpu_blocks_override=256,
                         disable_hybrid_kv_cache_manager=True)
    assert got == references["gemma3"]
    assert llm.llm_engine.kv.sliding is None
    one = llm.get_kv_stats()["kv_bytes_per_token"]
    _, hybrid = _generate(family_models["gemma3"], prompts[:1], num_gpu_blocks_override=256)
    assert hybrid.get_kv_stats()["kv_bytes_per_token"] * 3 == one


def test_gemma3_multimodal_checkpoint_runs_its_text_model(tmp_path):
    """Gemma3ForConditionalGeneration (4B and up): the engine runs the text model, its
    weights read from under language_model (the vision tower never read); tokens equal
    transformers' multimodal model on text-only prompts."""
    import transformers
    from tests.conftest import _randomize_norms
    torch.manual_seed(3)
    text = dict(COMMON, num_hidden_layers=6, head_dim=32, sliding_window=8,
                query_pre_attn_scalar=24)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=5, boi_token_index=6, eoi_token_index=7)
    model = transformers.Gemma3ForConditionalGeneration(cfg)
    _randomize_norms(model.model.language_model, 0.0)
    with torch.no_grad():
        model.model.language_model.embed_tokens.weight.mul_(0.1)
    model.save_pretrained(tmp_path)
    _tokenizer().save_pretrained(tmp_path)
    prompts = random_prompts(3, seed=9, lo=15, hi=30)
    ref = hf_greedy(str(tmp_path), prompts, MAX_NEW)
    got, llm = _generate(str(tmp_path), prompts, num_gpu_blocks_override=128)
    assert got == ref
    assert llm.llm_engine.model_config.hf_config.architectures == ["Gemma3ForCausalLM"]


@pytest.mark.parametrize("family", ["gemma3", "mistral-w12"])
def test_triton_kernels_read_the_windows(family_models, family):
    """VLLM_KERNEL_BACKEND=triton under the interpreter (tests/test_device.py's run): every
    decode and KV write goes through the Triton kernels, windows and hybrid groups included;
    tokens equal transformers (Native) and the CPU path (H2O + vToken)."""
    import json
    import os
    import subprocess
    import sys
    from tests.test_device import _TRITON_RUN, ROOT
    model = family_models[family]
    prompts = random_prompts(2, seed=3, lo=20, hi=30)
    env = dict(os.environ, TRITON_INTERPRET="1", VLLM_KERNEL_BACKEND="triton", PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, "-c", _TRITON_RUN, model, json.dumps(prompts), "8"],
                         env=env, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.split("RESULT", 1)[1])
    assert got["decode_backend"] == "triton" and got["calls"]["decode_attention"] > 0
    assert got["native"] == hf_greedy(model, prompts, 8)
    cpu = LLM(model, num_gpu_blocks_override=64, kv_eviction_policy="h2o", kv_min_tokens=0,
              block_size=4, kv_reclamation="vtoken", kv_frag_threshold=0.0)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = cpu.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert got["vtoken"] == [r.outputs[0].token_ids for r in ref]


def test_kv_cache_memory_sizes_the_pool_by_the_full_layers(family_models):
    """--kv-cache-memory on a hybrid model: a block costs its 2 full layers' pages (float32:
    2 x K/V x 2 KV heads x 32 x 4 bytes x 16 tokens), not 6 layers'."""
    page = 2 * 2 * 32 * 4 * 16
    hybrid = LLM(family_models["gemma3"], kv_cache_memory=300 * 2 * page)
    one = LLM(family_models["gemma3"], kv_cache_memory=300 * 2 * page,
              disable_hybrid_kv_cache_manager=True)
    assert hybrid.llm_engine.kv.num_blocks == 300 and one.llm_engine.kv.num_blocks == 100


def test_sliding_window_prefix_cache_worked_example():
    """W 8, B 4, two subgroups: a request's blocks cached with their hashes stay findable after
    they are freed; a hit of m blocks needs the window before position m * B cached."""
    from vllm.core.block_pool import BlockPool
    from vllm.core.sliding_window_blocks import SlidingWindowBlocks
    pool = BlockPool(32)
    sw = SlidingWindowBlocks(pool, block_size=4, window=8, num_groups=2)
    hashes = [101, 102, 103, 104]
    sw.allocate("a", 0, 16)
    sw.cache("a", hashes)
    sw.release_behind("a", 16)                    # rows 0, 1 freed, still cached
    sw.free("a")
    assert pool.num_free == 32 and int(pool.hashed.sum()) == 8
    assert sw.usable_hits(hashes, 4) == 4          # the window before 16: blocks 2, 3
    assert sw.hit_blocks_free(hashes, 4) == 4
    sw.adopt("b", hashes, 4)
    assert sw.num_blocks_of("b") == 2 and pool.num_free == 28 and sw.held == 4
    assert sw.slots("b", np.array([9, 15])).shape == (2, 2)
    sw.free("b")
    taken = pool.allocate(32)                      # everything reused: the cache is gone
    assert sw.usable_hits(hashes, 4) == 0
    pool.release(taken)
