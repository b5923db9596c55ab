"""--load-format simulate: synthetic attention statistics shaped like the real backend's, and the
real KV plane (Naive-Evict vs vToken) driven by them."""
import numpy as np
import pytest
import torch
import transformers

from vllm import LLM, SamplingParams
from vllm.attention.backend import AttentionMetadata, PrefillSpan
from vllm.model_executor.models.simulated import SimulatedModel

LAYERS, HEADS = 2, 4


def _config(path=None):
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                   num_key_value_heads=2, max_position_embeddings=4096)
    if path is not None:
        cfg.save_pretrained(path)
    return cfg


def test_config_gets_head_dim():
    cfg = _config()
    cfg.head_dim = None
    model = SimulatedModel(cfg, seed=0)
    assert model.config.head_dim == 8 and model.num_layers == LAYERS


def test_statistics_are_shaped_and_normalised_like_the_backend():
    model = SimulatedModel(_config(), seed=1)
    cache = torch.zeros(1, 64, 2, 1, 1)
    # two decodes (views of 5 and 3 keys) then one prefill chunk of 4 queries over 10 keys
    prefill_view = torch.arange(44, 54)
    positions = torch.tensor([7, 2] + list(range(6, 10)))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([21, 40, 50, 51, 52, 53]), num_decodes=2,
        decode_views=torch.tensor([[3, 9, 12, 20, 21], [30, 31, 40, -1, -1]]),
        decode_lens=torch.tensor([5, 3]),
        prefills=[PrefillSpan(2, 6, prefill_view, None, colsum=torch.zeros(10))],
        decode_mass=torch.zeros(2, 5))
    # earlier tokens' K/V as a previous step would have written them
    cache[0, :, 0, 0, 0] = torch.rand(64) + 0.1
    cache[0, :, 1, 0, 0] = torch.arange(64).float()
    model(torch.arange(6) + 3, positions, cache, meta)
    lh = LAYERS * HEADS
    assert meta.decode_mass.dtype == torch.float32 and meta.decode_mass.shape == (2, 5)
    assert torch.allclose(meta.decode_mass.sum(1), torch.full((2,), float(lh)))
    assert (meta.decode_mass[1, 3:] == 0).all() and (meta.decode_mass[:, :3] > 0).all()
    # prefill: each query's probabilities over the keys it sees sum to one per layer-head
    colsum = meta.prefills[0].colsum
    assert colsum.shape == (10,) and torch.isclose(colsum.sum(), torch.tensor(4.0 * lh))
    w = cache[0, prefill_view, 0, 0, 0].double()
    mask = torch.ones(4, 10, dtype=torch.bool).tril(6)
    dense = (w * mask) / (w * mask).sum(1, keepdim=True)
    assert torch.allclose(colsum.double(), dense.sum(0) * lh, rtol=1e-5)
    # the same span with an explicit mask (chunked prefill / evicted keys) gives the same sums
    meta2 = AttentionMetadata(torch.tensor([50, 51, 52, 53]), 0,
                              torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                              [PrefillSpan(0, 4, prefill_view, mask, colsum=torch.zeros(10))])
    model(torch.arange(5, 9), torch.arange(6, 10), cache, meta2)     # same tokens, same K/V
    assert torch.allclose(meta2.prefills[0].colsum, colsum, rtol=1e-5)
    # only the last query votes (TOVA's window): its row of the dense probabilities
    meta3 = AttentionMetadata(torch.tensor([50, 51, 52, 53]), 0,
                              torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                              [PrefillSpan(0, 4, prefill_view, mask, torch.zeros(10), 3)])
    model(torch.arange(5, 9), torch.arange(6, 10), cache, meta3)
    assert torch.allclose(meta3.prefills[0].colsum.double(), dense[3] * lh, rtol=1e-5)


def test_importance_is_heavy_tailed_and_seeded():
    a, b = SimulatedModel(_config(), seed=3), SimulatedModel(_config(), seed=3)
    assert torch.equal(a.importance, b.importance)
    w = a.importance
    top = w.sort(descending=True).values[: len(w) // 100].sum() / w.sum()
    assert top > 0.1        # the top 1% of keys hold over a tenth of the mass


@pytest.fixture(scope="module")
def sim_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("simcfg"))
    _config(path)
    return path


def _run(sim_dir, reclamation):
    llm = LLM(sim_dir, load_format="simulate", kv_eviction_policy="h2o", kv_eviction_ratio=0.5,
              kv_min_tokens=0,
              kv_reclamation=reclamation, num_gpu_blocks_override=200, kv_check_invariants=True)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 512, n).tolist()} for n in (160, 200, 90)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=120, ignore_eos=True),
                        use_tqdm=False)
    return outs, llm.get_kv_stats()


def test_naive_evict_vs_vtoken_retained_blocks(sim_dir):
    naive, naive_stats = _run(sim_dir, "none")
    vtok, vtok_stats = _run(sim_dir, "vtoken")
    for a, b in zip(naive, vtok):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.kv_stats["evicted_tokens"] == b.kv_stats["evicted_tokens"] > 0
        assert b.kv_stats["mean_blocks"] < 0.8 * a.kv_stats["mean_blocks"]
        ideal = -(-b.kv_stats["live_tokens"] // 16)
        assert b.kv_stats["blocks_at_finish"] <= 1.5 * ideal + 1
    assert vtok_stats["relocation_events"] > 0 and naive_stats["relocation_events"] == 0
    assert vtok_stats["mean_memory_utilization"] > naive_stats["mean_memory_utilization"] + 0.15
    assert vtok_stats["blocks_used"] == naive_stats["blocks_used"] == 0


def test_learned_sinks_leave_rows_below_one():
    """gpt-oss (learned sinks): p_q(j) = w_j / (W(q) + SINK_WEIGHT), decode and prefill."""
    from vllm.model_executor.models.simulated import SINK_WEIGHT
    cfg = transformers.GptOssConfig(vocab_size=512, hidden_size=32, intermediate_size=32,
                                    num_hidden_layers=2, num_attention_heads=HEADS,
                                    num_key_value_heads=2, head_dim=8, sliding_window=16,
                                    num_local_experts=4, num_experts_per_tok=2)
    cfg.architectures = ["GptOssForCausalLM"]
    model = SimulatedModel(cfg, seed=1)
    cache = torch.zeros(1, 64, 2, 1, 1)
    cache[0, :, 0, 0, 0] = torch.rand(64) + 0.1
    cache[0, :, 1, 0, 0] = torch.arange(64).float()
    view = torch.arange(44, 54)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([21, 50, 51, 52, 53]), num_decodes=1,
        decode_views=torch.tensor([[3, 9, 12, 20, 21]]), decode_lens=torch.tensor([5]),
        prefills=[PrefillSpan(1, 5, view, None, colsum=torch.zeros(10))],
        decode_mass=torch.zeros(1, 5))
    model(torch.arange(5) + 3, torch.tensor([7, 6, 7, 8, 9]), cache, meta)
    lh = HEADS                                   # one full layer of two feeds the statistics
    assert 0 < float(meta.decode_mass.sum()) < lh
    w = cache[0, view, 0, 0, 0].double()
    mask = torch.ones(4, 10, dtype=torch.bool).tril(6)
    dense = (w * mask) / ((w * mask).sum(1, keepdim=True) + SINK_WEIGHT)
    assert torch.allclose(meta.prefills[0].colsum.double(), dense.sum(0) * lh, rtol=1e-5)
    assert float(meta.prefills[0].colsum.sum()) < 4 * lh


@pytest.mark.parametrize("arch", ["GptOssForCausalLM", "Qwen3MoeForCausalLM"])
def test_moe_shapes_simulate_from_config_alone(tmp_path, arch):
    """gpt-oss-20b's and Qwen3-30B-A3B's config.json (fewer layers): the KV plane runs, H2O
    evicts, vToken frees blocks (no weights are built)."""
    if arch == "GptOssForCausalLM":
        cfg = transformers.GptOssConfig(num_hidden_layers=4, vocab_size=201088)
    else:
        cfg = transformers.Qwen3MoeConfig(num_hidden_layers=4, hidden_size=2048, head_dim=128,
                                          num_attention_heads=32, num_key_value_heads=4,
                                          num_experts=128, num_experts_per_tok=8,
                                          moe_intermediate_size=768, vocab_size=151936)
    cfg.architectures = [arch]
    cfg.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), load_format="simulate", kv_eviction_policy="h2o",
              kv_eviction_ratio=0.5, kv_min_tokens=0, num_gpu_blocks_override=200,
              kv_check_invariants=True)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 512, n).tolist()} for n in (300, 200)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                 use_tqdm=False)
    stats = llm.get_kv_stats()
    assert stats["evicted_tokens"] > 0 and stats["blocks_reclaimed"] > 0
