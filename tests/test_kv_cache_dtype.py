"""--kv-cache-dtype fp8 (CPU): quantized writes equal torch's own fp8 cast, every C variant this
CPU runs widens each of the 256 bytes exactly as torch does, attention over fp8 K/V on every C
variant (and the torch path) matches a float64 reference of the dequantized values, relocation
moves the bytes exactly, and the engine end to end: every policy and reclamation mode
token-identical on the same fp8 config, 4x the blocks of float32, greedy tokens close to the
float32 cache's."""
import numpy as np
import pytest
import torch

from tests.conftest import random_prompts
from tests.kernel_refs import decode_reference, paged_scene, rel_err
from vllm import LLM, SamplingParams
from vllm.kernels import ops
from vllm.kernels import cpu_kernels
from vllm.attention import kv_quant

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
cpu_built = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler")


def torch_cast(x: torch.Tensor, scale: float, dtype) -> torch.Tensor:
    """What the cache must hold: torch's cast of x * (1 / scale) clamped to the finite range."""
    m = float(torch.finfo(dtype).max)
    return (x * kv_quant.inverse(scale)).clamp(-m, m).to(dtype).view(torch.uint8)


def hard_values(dtype, n_random=4000, seed=0) -> torch.Tensor:
    """Every finite value of the format, the midpoints between neighbours (ties: round to even),
    points just off them, subnormals, zeros, values past the largest (saturate), random ones."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    finite = codes[torch.isfinite(codes)].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    m = float(torch.finfo(dtype).max)
    g = torch.Generator().manual_seed(seed)
    extra = torch.tensor([0.0, -0.0, m * 1.01, -m * 1.5, 1e30, -1e30, 1e-30, -1e-30])
    rand = torch.randn(n_random, generator=g) * torch.exp(torch.randn(n_random, generator=g) * 4)
    vals = torch.cat([finite, mids, mids * (1 + 1e-6), mids * (1 - 1e-6), extra, rand])
    return vals.float()


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("scale", [1.0, 0.37, 3.0])
def test_torch_write_equals_torch_cast_and_reads_back(dtype, scale):
    vals = hard_values(dtype)
    kvh, d = 2, 16
    t = len(vals) // (kvh * d) // 2
    k = vals[:t * kvh * d].view(t, kvh, d)
    v = vals[t * kvh * d:2 * t * kvh * d].view(t, kvh, d)
    cache = torch.zeros(1, t + 3, 2, kvh, d, dtype=dtype)
    kv_quant.register(cache)
    kv_quant.set_scales(cache, [scale], [scale * 2])
    slots = torch.randperm(t + 3)[:t]
    slots[0] = -1                                            # padding: no write
    ops.write_kv(cache[0], slots, k, v)
    keep = slots >= 0
    got = cache[0].view(torch.uint8)[slots[keep]]
    assert torch.equal(got[:, 0], torch_cast(k[keep], scale, dtype))
    assert torch.equal(got[:, 1], torch_cast(v[keep], scale * 2, dtype))
    # reads dequantize with the layer's scales
    back = kv_quant.gather(cache[0], slots[keep])
    assert torch.equal(back[:, 0], got[:, 0].view(dtype).float() * np.float32(scale))


@cpu_built
@pytest.mark.parametrize("dtype", FP8)
def test_c_write_equals_torch_cast(isa, dtype):
    """The C quantizer (rope_write_kv, keys not spread) against torch's cast, bit for bit: cos 1, sin 0 leaves
    K as computed, so every hard value reaches the quantizer unchanged; then a real rotation
    against the float32 kernel's rotated values cast by torch."""
    kvh, d, h = 2, 16, 2
    vals = hard_values(dtype)
    t = len(vals) // (2 * kvh * d)
    kv_part = vals[:t * 2 * kvh * d].view(t, 2 * kvh * d)
    qkv = torch.cat([torch.randn(t, h * d), kv_part], dim=1)
    for scale_k, scale_v, rotate in ((1.0, 1.0, False), (0.37, 3.0, False), (0.5, 0.25, True)):
        if rotate:
            qkv = torch.randn(t, (h + 2 * kvh) * d) * 30
            ang = torch.rand(t, d // 2) * 6.28
            cos, sin = torch.cos(ang).repeat(1, 2), torch.sin(ang).repeat(1, 2)
        else:
            cos, sin = torch.ones(t, d), torch.zeros(t, d)
        slots = torch.randperm(t + 5)[:t]
        slots[3] = -1
        ref32 = torch.zeros(t + 5, 2, kvh, d)
        cpu_kernels.rope_write_kv(qkv, cos, sin, slots, ref32, h)
        stacked = torch.zeros(1, t + 5, 2, kvh, d, dtype=dtype)
        kv_quant.register(stacked)
        kv_quant.set_scales(stacked, [scale_k], [scale_v])
        q = cpu_kernels.rope_write_kv(qkv, cos, sin, slots, stacked[0], h, spread=False)
        q32 = cpu_kernels.rope_write_kv(qkv, cos, sin, slots, torch.zeros_like(ref32), h)
        assert torch.equal(q, q32)
        keep = slots[slots >= 0]
        got = stacked[0].view(torch.uint8)[keep]
        assert torch.equal(got[:, 0], torch_cast(ref32[keep, 0], scale_k, dtype)), (scale_k, rotate)
        assert torch.equal(got[:, 1], torch_cast(ref32[keep, 1], scale_v, dtype)), (scale_v, rotate)
        untouched = torch.ones(t + 5, dtype=torch.bool)
        untouched[keep] = False
        assert not stacked[0].view(torch.uint8)[untouched].any()


@cpu_built
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("d", [16, 48, 64])
def test_c_spread_keys_equal_torch_spread(isa, dtype, d):
    """An fp8 cache's writer spreads q and k (kv_quant.spread: head dim 48 in blocks of 16):
    the C path's q and stored K bytes are torch's spread of the float32 kernel's rotated values,
    bit for bit (the same butterflies in the same order); V is stored as computed; q.k, key
    norms and the cosine between two keys are unchanged to float32 rounding."""
    kvh, h, t = 2, 4, 40
    g = torch.Generator().manual_seed(d)
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g) * 3
    qkv[:, h * d:(h + kvh) * d:7] *= 20                      # a few large key channels
    ang = torch.rand(t, d // 2, generator=g) * 6.28
    cos, sin = torch.cos(ang).repeat(1, 2), torch.sin(ang).repeat(1, 2)
    slots = torch.randperm(t + 4, generator=g)[:t]
    ref32 = torch.zeros(t + 4, 2, kvh, d)
    q32 = cpu_kernels.rope_write_kv(qkv, cos, sin, slots, ref32, h)
    cache = torch.zeros(1, t + 4, 2, kvh, d, dtype=dtype)
    kv_quant.register(cache)
    kv_quant.set_scales(cache, [0.5], [2.0])
    assert kv_quant.spreads(cache[0]) and not kv_quant.spreads(ref32)
    q = cpu_kernels.rope_write_kv(qkv, cos, sin, slots, cache[0], h)
    k_spread = kv_quant.spread(ref32[slots, 0])
    assert torch.equal(q, kv_quant.spread(q32))
    got = cache[0].view(torch.uint8)[slots]
    assert torch.equal(got[:, 0], torch_cast(k_spread, 0.5, dtype))
    assert torch.equal(got[:, 1], torch_cast(ref32[slots, 1], 2.0, dtype))
    k32 = ref32[slots, 0]                                    # [t, KVH, D]
    scores32 = torch.einsum("thd,skd->thsk", q32.double(), k32.double())
    scores = torch.einsum("thd,skd->thsk", q.double(), k_spread.double())
    assert float((scores - scores32).abs().max()) < 1e-4 * float(scores32.abs().max())
    torch.testing.assert_close(k_spread.norm(dim=-1), k32.norm(dim=-1), rtol=1e-5, atol=1e-5)
    cos_sim = torch.nn.functional.cosine_similarity
    torch.testing.assert_close(cos_sim(k_spread[:-1], k_spread[1:], dim=-1),
                               cos_sim(k32[:-1], k32[1:], dim=-1), rtol=1e-5, atol=1e-5)


def test_spread_is_the_signed_hadamard_rotation():
    """spread() against H S x built in float64: signs from the documented hash, H Sylvester's
    Hadamard / sqrt(B), per block of B = D & -D; x in bf16 comes back in bf16."""
    def hadamard(n):
        m = torch.ones(1, 1, dtype=torch.float64)
        while m.shape[0] < n:
            m = torch.cat([torch.cat([m, m], 1), torch.cat([m, -m], 1)], 0)
        return m / n ** 0.5

    for d, b in ((64, 64), (96, 32), (80, 16)):
        x = torch.randn(7, 3, d, dtype=torch.float64)
        signs = []
        for i in range(d):
            u = i + 1
            u ^= u >> 16
            u = (u * 0x85EBCA6B) & 0xFFFFFFFF
            u ^= u >> 13
            u = (u * 0xC2B2AE35) & 0xFFFFFFFF
            u ^= u >> 16
            signs.append(-1.0 if u & 1 else 1.0)
        sx = (x * torch.tensor(signs, dtype=torch.float64)).view(7, 3, d // b, b)
        ref = (sx @ hadamard(b)).view(7, 3, d)
        torch.testing.assert_close(kv_quant.spread(x.float()).double(), ref, rtol=0, atol=1e-5)
        matrix = kv_quant.spread_butterflies(torch.eye(d))     # CUDA's form: x @ M
        torch.testing.assert_close((x.float() @ matrix).double(), ref, rtol=0, atol=1e-5)
    assert kv_quant.spread(torch.randn(2, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16


def finite_codes(dtype) -> torch.Tensor:
    """Every byte whose torch value is finite (e4m3fn: all but the NaNs 0x7f / 0xff, which
    writes never store since they saturate)."""
    codes = torch.arange(256, dtype=torch.uint8)
    return codes[torch.isfinite(codes.view(dtype).float())]


@cpu_built
@pytest.mark.parametrize("dtype", FP8)
def test_c_fp8_widening_is_exact_for_every_byte(isa, dtype):
    """The C widening (F16C halves on avx2 / avx512, bit moves elsewhere) against torch's own
    fp8 -> float32 for all 256 bytes: finite ones bit for bit (subnormals, -0 included), e5m2's
    infinities and NaNs as such."""
    codes = torch.arange(256, dtype=torch.uint8)
    ref = codes.view(dtype).float()
    got = cpu_kernels.fp8_to_float(codes, dtype)
    finite = torch.isfinite(ref)
    assert torch.equal(got[finite].view(torch.int32), ref[finite].view(torch.int32))
    nan, inf = torch.isnan(ref), torch.isinf(ref)
    if dtype == torch.float8_e5m2:
        assert torch.isnan(got[nan]).all() and torch.equal(got[inf], ref[inf])
    else:                       # e4m3fn's NaN bytes read as finite values: never stored
        assert nan.sum() == 2 and torch.isfinite(got[nan]).all()


@cpu_built
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("v_scale", [1.0, 0.37])
def test_c_attention_reads_every_fp8_value_exactly(isa, dtype, v_scale):
    """One key per request: its probability is exactly 1, so the output is the key's V as the
    kernel reads it, which must be torch's dequantized value (byte value * v_scale, one float
    rounding) for every finite byte; the e4m3 unit 2^8 folded into the output is exact."""
    codes = finite_codes(dtype)
    d = 64
    codes = torch.cat([codes, codes[:(-len(codes)) % d]])          # whole rows of D values
    rows = len(codes) // d
    cache = torch.zeros(1, rows + 1, 2, 1, d, dtype=dtype)
    kv_quant.register(cache)
    kv_quant.set_scales(cache, [0.5], [v_scale])
    cache.view(torch.uint8)[0, 1:, 1, 0] = codes.view(rows, d)      # V of slots 1 .. rows
    slots = torch.arange(1, rows + 1)[:, None]
    q = torch.randn(rows, 3, d)           # 3 query heads a KV head: avx2's one-pass fp8 values
    out = ops.decode_attention(q, cache[0], slots, torch.ones(rows, dtype=torch.int64), 0.125,
                               backend="cpu")
    expect = codes.view(dtype).float() * np.float32(v_scale)
    for h in range(3):
        assert torch.equal(out[:, h].reshape(-1), expect)


@cpu_built
@pytest.mark.parametrize("dtype", FP8)
def test_c_attention_over_every_fp8_key_matches_float64_reference(isa, dtype):
    """Keys that hold every finite byte (in shuffled order) against a float64 reference of the
    dequantized cache: the widened K and the unit folded into the score scale."""
    g = torch.Generator().manual_seed(5)
    codes = finite_codes(dtype)
    kvh, d, h, n = 2, 64, 6, 40
    k, v = codes[torch.randint(0, len(codes), (2, n, kvh, d), generator=g)]
    k.view(-1)[:len(codes)] = codes[torch.randperm(len(codes), generator=g)]
    top = float(torch.finfo(dtype).max)
    cache = torch.zeros(1, n, 2, kvh, d, dtype=dtype)
    kv_quant.register(cache)
    kv_quant.set_scales(cache, [4 / top], [1.3])                  # |K| <= 4
    cache.view(torch.uint8)[0] = torch.stack([k, v], dim=1)
    deq = kv_quant.gather(cache[0], torch.arange(n))
    slots = torch.stack([torch.randperm(n, generator=g), torch.randperm(n, generator=g)])
    lens = torch.tensor([n, n - 7])
    q = torch.randn(2, h, d, generator=g)
    ref_out, ref_mass = decode_reference(q, deq, slots, lens, 0.25)
    mass = torch.zeros(slots.shape)
    out = ops.decode_attention(q, cache[0], slots, lens, 0.25, mass, backend="cpu")
    assert rel_err(out, ref_out) < 1e-5 and rel_err(mass, ref_mass) < 1e-5


def fp8_scene(lens, kvh, d, seed, dtype, k_scale, v_scale, num_blocks=100):
    """paged_scene's K/V quantized into a registered one-layer fp8 cache -> (cache view [S, 2,
    KVH, D], the dequantized float32 values, slots, lens)."""
    kv, slots, lens_t = paged_scene(lens, kvh, d, seed=seed, num_blocks=num_blocks, pad=-1)
    kv = kv * 3
    stacked = torch.zeros(1, *kv.shape, dtype=dtype)
    kv_quant.register(stacked)
    kv_quant.set_scales(stacked, [k_scale], [v_scale])
    all_slots = torch.arange(kv.shape[0])
    ops.write_kv(stacked[0], all_slots, kv[:, 0], kv[:, 1])
    deq = kv_quant.gather(stacked[0], all_slots)
    return stacked, deq, slots, lens_t


@cpu_built
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("h,kvh,d", [(4, 2, 16), (9, 3, 64), (14, 2, 128), (2, 2, 16),
                                     (5, 1, 32)])          # G = 2 3 7 1 5: score_heads' cases
def test_c_decode_over_fp8_matches_float64_reference(isa, dtype, h, kvh, d):
    lens = [5, 37, 1, 90, 0]
    stacked, deq, slots, lens_t = fp8_scene(lens, kvh, d, h + d, dtype, 0.7, 1.9)
    assert deq.abs().max() > 1.5                              # scales applied, not all zero
    q = torch.randn(len(lens), h, d, generator=torch.Generator().manual_seed(3))
    ref_out, ref_mass = decode_reference(q, deq, slots, lens_t, 0.25)
    mass = torch.ones(slots.shape)
    out = ops.decode_attention(q, stacked[0], slots, lens_t, 0.25, mass, backend="cpu")
    assert rel_err(out, ref_out) < 1e-5
    assert rel_err(mass - 1, ref_mass) < 1e-5
    assert torch.equal(out[4], torch.zeros(h, d))


@pytest.mark.parametrize("dtype", FP8)
def test_torch_decode_and_prefill_over_fp8_match_reference(dtype):
    from tests.kernel_refs import prefill_reference
    from tests.kernel_refs import prefill_meta
    from vllm.attention.backend import PrefillSpan, paged_attention
    h, kvh, d = 6, 2, 16
    lens = [5, 37, 20]
    stacked, deq, slots, lens_t = fp8_scene(lens, kvh, d, 4, dtype, 0.5, 2.0)
    q = torch.randn(len(lens), h, d, generator=torch.Generator().manual_seed(1))
    ref_out, ref_mass = decode_reference(q, deq, slots, lens_t, 0.25)
    mass = torch.zeros(slots.shape)
    out = ops.decode_attention(q, stacked[0], slots, lens_t, 0.25, mass, backend="torch")
    assert rel_err(out, ref_out) < 1e-5 and rel_err(mass, ref_mass) < 1e-5
    view = slots[1, :37]
    qp = torch.randn(7, h, d)
    got = paged_attention(qp, stacked[0], prefill_meta([PrefillSpan(0, 7, view, None)]), 0.25,
                          prefill_path="span")
    mask = torch.ones(7, 37, dtype=torch.bool).tril(30)
    ref = prefill_reference(qp.transpose(0, 1), deq[view, 0].transpose(0, 1),
                            deq[view, 1].transpose(0, 1), mask, 0.25).transpose(0, 1)
    assert rel_err(got, ref) < 1e-5


@cpu_built
@pytest.mark.parametrize("dtype", FP8 + [torch.bfloat16])
def test_fused_decode_layer_over_narrow_caches(isa, dtype, monkeypatch):
    """The fused C decode layer on an fp8 or bf16 cache: the new token's K/V are written exactly
    as rope_write_kv would, and the output is the per-op C path's over the same cache."""
    from tests.test_kernels import _forced_plan, _layer_scene
    from vllm.model_executor.models.llama import DecoderLayer, Rotary
    cfg, w, x, positions, kv32, meta = _layer_scene(m=4, context=40)
    kvh, d = cfg.num_key_value_heads, cfg.head_dim
    plan = _forced_plan(monkeypatch, "c", {(64, 128): 1, (64, 64): 1, (64, 192): 1, (96, 64): 1},
                        (4, kvh, d))
    layer = DecoderLayer(cfg, w, "l", plan)
    if layer.fused is None:
        pytest.skip("no fused layer for these shapes")
    rotary = Rotary(d, 128, 10000.0, {"rope_type": "default"}, torch.float32)
    cos, sin = rotary.cos[positions], rotary.sin[positions]
    caches = []
    for _ in range(2):
        c = torch.zeros(1, *kv32.shape, dtype=dtype)
        if kv_quant.is_fp8(c):
            kv_quant.register(c)
            kv_quant.set_scales(c, [0.6], [1.7])
            kv_quant.bytes_(c)[0] = kv_quant.quantize(kv32, 1.0, dtype).view(torch.uint8)
        else:
            c[0] = kv32
        caches.append(c)
    fused = cpu_kernels.decode_layer(layer.fused, x.clone(), cos, sin, meta.slot_mapping,
                                     caches[0][0], meta.decode_views, meta.decode_lens, None,
                                     cpu_kernels.decode_scratch(layer.fused, 4, meta.decode_views))
    per_op = layer(x.clone(), cos, sin, rotary, caches[1][0], meta)
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    assert rel_err(fused, per_op) < 1e-4


@pytest.mark.parametrize("dtype", FP8 + [torch.bfloat16])
@pytest.mark.parametrize("backend", [None, "torch"])
def test_relocation_moves_cache_bytes_exactly(dtype, backend):
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (3, 64, 2, 2, 16), dtype=torch.uint8, generator=g)
    kv = raw.clone().view(dtype)
    perm = torch.randperm(64, generator=g)
    src, dst = perm[:20], perm[20:40]
    ops.relocate_kv(kv, src, dst, backend)
    expect = raw.clone()
    expect[:, dst] = raw[:, src]
    assert torch.equal(kv.view(torch.uint8), expect)


def test_bad_kv_cache_dtype_is_a_clear_error():
    from vllm.config import CacheConfig
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        CacheConfig(kv_cache_dtype="int8")
    assert CacheConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"


# ---- end to end on the tiny model -----------------------------------------------------------
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
POLICIES = ["h2o", "snapkv", "tova", "knorm", "keydiff", "streamingllm"]


def generate(model, prompts, params=GREEDY, **kwargs):
    kwargs.setdefault("kv_check_invariants", True)
    kwargs.setdefault("kv_min_tokens", 0)
    kwargs.setdefault("num_gpu_blocks_override", 256)
    llm = LLM(model, **kwargs)
    eng = llm.llm_engine
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
        eng.check_invariants()
    assert eng.kv.bm.num_free_blocks == eng.kv.bm.num_blocks
    return llm, [outs[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))], outs


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(5, seed=7, lo=60, hi=140)


@pytest.mark.parametrize("kv_dtype", ["fp8", "bfloat16"])
@pytest.mark.parametrize("policy", POLICIES)
def test_engine_naive_and_vtoken_token_identical(tiny_llama, prompts, policy, kv_dtype):
    kw = dict(kv_cache_dtype=kv_dtype, kv_eviction_policy=policy, kv_eviction_ratio=0.5)
    llm, naive, _ = generate(tiny_llama, prompts, kv_reclamation="none", **kw)
    assert llm.llm_engine.kv_caches.dtype == kv_quant.cache_dtype(kv_dtype, torch.float32)
    vllm_, vtok, outs = generate(tiny_llama, prompts, kv_reclamation="vtoken",
                                 kv_frag_threshold=0.0, **kw)
    _, fill, _ = generate(tiny_llama, prompts, kv_reclamation="vtoken-fill",
                          kv_frag_threshold=0.0, **kw)
    assert vtok == naive and fill == naive
    assert all(o.kv_stats["evicted_tokens"] > 0 for o in outs.values())


@pytest.mark.parametrize("kv_dtype,elem", [("fp8_e5m2", 1), ("bfloat16", 2)])
def test_pool_holds_more_blocks_in_the_same_bytes(tiny_llama, kv_dtype, elem):
    """--kv-cache-memory is bytes: 4 / elem times float32's blocks (fp8 4x, bf16 2x)."""
    from vllm.engine.llm_engine import LLMEngine
    from vllm.engine.arg_utils import EngineArgs
    n = {}
    for dtype, size in (("auto", 4), (kv_dtype, elem)):
        eng = LLMEngine(EngineArgs(model=tiny_llama, kv_cache_dtype=dtype,
                                   kv_cache_memory=3 << 20))
        n[dtype] = eng.kv.num_blocks
        assert eng.kv_caches.element_size() == size
    assert abs(n[kv_dtype] - 4 // elem * n["auto"]) < 4


@pytest.mark.parametrize("kv_dtype,calculate", [("fp8", False), ("fp8", True)])
def test_fp8_greedy_tokens_close_to_fp32(tiny_llama, kv_dtype, calculate):
    """Tolerance: the first greedy token equals the float32 cache's on at least 16 of 24 prompts
    (measured, prompt seeds 3 / 4: 21-22 / 17-20 of 24, keys spread or not). Longer runs diverge
    early on the tiny random model: its next-token distributions are nearly flat (entropy ~5.1
    nats of ln 512 = 6.2), so any perturbation of K/V flips near-ties;
    test_fp8_logits_close_to_fp32 bounds the difference itself."""
    ps = random_prompts(24, seed=3, lo=20, hi=80)
    _, ref, _ = generate(tiny_llama, ps)
    llm, got, _ = generate(tiny_llama, ps, kv_cache_dtype=kv_dtype, calculate_kv_scales=calculate)
    assert sum(a[0] == b[0] for a, b in zip(got, ref)) >= 16, (got, ref)
    if calculate:
        s = kv_quant.scales_of(llm.llm_engine.kv_caches)
        assert (s != 1.0).all() and torch.isfinite(s).all()


def prompt_log_probs(model, ids, dtype, calculate=False) -> torch.Tensor:
    """float64 log-probabilities of every next token of prompt ids, the model prefilling into a
    fresh KV cache of `dtype` (fp8: registered, scales calculated or 1.0)."""
    from vllm.attention.backend import AttentionMetadata, PrefillSpan
    cfg, t = model.config, len(ids)
    kv = torch.zeros(cfg.num_hidden_layers, t, 2, model.num_kv_heads, cfg.head_dim, dtype=dtype)
    if kv_quant.is_fp8(kv):
        kv_quant.register(kv, calculate)
    meta = AttentionMetadata(slot_mapping=torch.arange(t), num_decodes=0,
                             decode_views=torch.full((0, 1), -1),
                             decode_lens=torch.zeros(0, dtype=torch.int64),
                             prefills=[PrefillSpan(0, t, torch.arange(t), None)])
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(t), kv, meta)
        return torch.log_softmax(model.compute_logits(hidden).double(), -1)


def test_fp8_logits_close_to_fp32(tiny_llama):
    """Every prompt position's next-token distribution with an fp8 cache against the float32
    cache's: mean KL(fp32 || fp8) per position < 0.03 nats for e4m3 (measured 0.007-0.018),
    < 0.1 for e5m2 (measured 0.035-0.056); top-1 agreement >= 65% for e4m3 (measured 72-88%)."""
    model = LLM(tiny_llama, num_gpu_blocks_override=16).llm_engine.worker.model

    def log_probs(ids, dtype, calculate=False):
        return prompt_log_probs(model, ids, dtype, calculate)

    for p in random_prompts(4, seed=3, lo=20, hi=80):
        ref = log_probs(p, torch.float32)
        for dtype, calculate, bound in ((torch.float8_e4m3fn, False, 0.03),
                                        (torch.float8_e4m3fn, True, 0.03),
                                        (torch.float8_e5m2, False, 0.1)):
            lp = log_probs(p, dtype, calculate)
            kl = (ref.exp() * (ref - lp)).sum(-1)
            assert kl.mean() < bound, (dtype, calculate, kl.mean())
            if dtype == torch.float8_e4m3fn:
                assert (ref.argmax(-1) == lp.argmax(-1)).double().mean() >= 0.65
