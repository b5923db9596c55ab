"""Nothing evicted, nothing changed: until a request's first eviction its tokens are those of
--kv-eviction-policy none, bit for bit, for every policy, on every path a user runs.

Statistics (prefill column sums, decode attention mass) are computed beside the attention call a
request without a policy makes, never instead of it: the kernels' outputs are compared with
torch.equal, then whole engines with a floor no request reaches (scores collected every step,
nothing evicted) against Native: float32, bf16 and fp8 KV, the C kernels of every ISA build,
torch, Triton (the interpreter), a batch of ragged prompts, TP = 2, and the default model as
shipped (Q4_1 blocks, bf16 KV) on short chats with default flags.
"""
import pytest
import torch

from tests.conftest import random_prompts
from tests.kernel_refs import paged_scene, prefill_meta
from vllm import LLM, SamplingParams
from vllm.attention.backend import PrefillSpan, paged_attention
from vllm.core.eviction import policy_names
from vllm.kernels import ops

POLICIES = [p for p in policy_names() if p != "none"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
NEVER = 10 ** 6          # a floor no request reaches: every policy scores, none evicts


# ---- kernels: the output with statistics is the output without -----------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])
def test_decode_mass_leaves_the_output_bit_identical(isa, backend, dtype):
    if backend == "cpu" and not ops.cpu_kernels_enabled():
        pytest.skip("no C kernels")
    if backend == "triton" and not ops._available("triton"):
        pytest.skip("no triton")
    lens = [5, 37, 1, 20]
    kv, slots, lens_t = paged_scene(lens, 2, 64, seed=7, dtype=dtype)
    q = torch.randn(len(lens), 8, 64, generator=torch.Generator().manual_seed(3))
    plain = ops.decode_attention(q, kv, slots, lens_t, 0.125, None, backend=backend)
    mass = torch.zeros(slots.shape)
    scored = ops.decode_attention(q, kv, slots, lens_t, 0.125, mass, backend=backend)
    assert torch.equal(plain, scored)
    assert torch.allclose(mass.sum(dim=1), torch.full((len(lens),), 8.0), atol=1e-4)


def _spans(lens, kv_slots, colsum_from):
    spans, start = [], 0
    for n, slots in zip(lens, kv_slots):
        span = PrefillSpan(start, start + n, slots, None)
        if colsum_from is not None:
            span.colsum, span.colsum_from = torch.zeros(n), colsum_from
        spans.append(span)
        start += n
    return prefill_meta(spans)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["span", "batched"])
@pytest.mark.parametrize("colsum_from", [0, 29])
def test_prefill_column_sums_leave_the_output_bit_identical(path, dtype, colsum_from):
    lens = [30, 300]         # 300 queries: more than one scoring tile
    kv, slots, _ = paged_scene(lens, 2, 32, seed=5, num_blocks=200, dtype=dtype)
    kv_slots = [slots[i, :n] for i, n in enumerate(lens)]
    q = torch.randn(sum(lens), 4, 32, generator=torch.Generator().manual_seed(1))
    plain = paged_attention(q, kv, _spans(lens, kv_slots, None), 0.2, prefill_path=path)
    meta = _spans(lens, kv_slots, colsum_from)
    scored = paged_attention(q, kv, meta, 0.2, prefill_path=path)
    assert torch.equal(plain, scored)
    for span, n in zip(meta.prefills, lens):     # 4 heads x (n - colsum_from) scored queries
        assert span.colsum.sum().item() == pytest.approx(4 * (n - min(colsum_from, n)), rel=1e-5)


# ---- engines: a policy that never evicts gives Native's tokens -------------------------------
def _tokens(model, prompts, **kw):
    llm = LLM(model, num_gpu_blocks_override=256, seed=0, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert all(o.kv_stats.get("evicted_tokens", 0) == 0 for o in outs)
    return [o.outputs[0].token_ids for o in outs]


PROMPTS = random_prompts(5, seed=43, lo=5, hi=90)     # ragged, batched together


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "fp8"])
def test_every_policy_before_its_first_eviction_is_native(tiny_llama, kv_cache_dtype):
    native = _tokens(tiny_llama, PROMPTS, kv_cache_dtype=kv_cache_dtype)
    for policy in POLICIES:
        got = _tokens(tiny_llama, PROMPTS, kv_cache_dtype=kv_cache_dtype,
                      kv_eviction_policy=policy, kv_min_tokens=NEVER)
        assert got == native, policy


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_every_scored_policy_is_native_on_the_torch_and_triton_paths(tiny_llama, backend):
    if backend == "triton" and not ops._available("triton"):
        pytest.skip("no triton")
    with ops.forced_backend(backend):
        native = _tokens(tiny_llama, PROMPTS[:3])
        for policy in ("h2o", "tova", "snapkv", "scissorhands"):
            assert _tokens(tiny_llama, PROMPTS[:3], kv_eviction_policy=policy,
                           kv_min_tokens=NEVER) == native, policy


def test_scored_policies_are_native_on_every_isa_build(tiny_llama, isa):
    native = _tokens(tiny_llama, PROMPTS, kv_cache_dtype="bfloat16")
    for policy in ("h2o", "tova", "snapkv"):
        assert _tokens(tiny_llama, PROMPTS, kv_cache_dtype="bfloat16", kv_eviction_policy=policy,
                       kv_min_tokens=NEVER) == native, policy


def test_a_policy_before_its_first_eviction_is_native_at_tp2(tiny_llama):
    llms = {}
    try:
        for policy in ("none", "h2o"):
            llms[policy] = LLM(tiny_llama, tensor_parallel_size=2, num_gpu_blocks_override=64,
                               kv_eviction_policy=policy, kv_min_tokens=NEVER)
        outs = {p: [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": q} for q in PROMPTS[:3]], GREEDY, use_tqdm=False)]
            for p, llm in llms.items()}
    finally:
        for llm in llms.values():
            llm.llm_engine.shutdown()
    assert outs["h2o"] == outs["none"]


CHATS = [[{"role": "user", "content": "Translate 'thank you' into French."}],
         [{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "user", "content": "Write a haiku about autumn."}]]


@pytest.mark.default_model
def test_default_model_short_chats_are_native_under_every_policy():
    """The default model as shipped (Q4_1 blocks, bf16 KV), default flags: short chats stay
    under the default floor, so turning a policy on changes nothing."""
    llm = LLM(seed=0)
    params = SamplingParams(temperature=0, max_tokens=40)
    native = [o.outputs[0].token_ids for o in llm.chat(CHATS, params, use_tqdm=False)]
    from vllm.kv_eviction_params import KVEvictionParams
    for policy in POLICIES:
        outs = llm.chat(CHATS, params, use_tqdm=False, kv_eviction=KVEvictionParams(policy=policy))
        assert [o.outputs[0].token_ids for o in outs] == native, policy
        assert all(o.kv_stats.get("evicted_tokens", 0) == 0 for o in outs)
