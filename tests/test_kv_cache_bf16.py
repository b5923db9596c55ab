"""--kv-cache-dtype bfloat16 (CPU): writes equal torch's float32 -> bf16 cast bit for bit (the
C writer on every variant this CPU runs, and the torch path), attention over bf16 K/V on every C
variant and the torch path matches a float64 reference of the bf16 values, and the engine end
to end: prefix caching on equals off, logits close to the float32 cache's. On CUDA the flag names a bf16 model's own cache.
Relocation's bytes, the fused decode layer, the pool's size (2x the blocks of float32) and
every policy x reclamation mode:
tests/test_kv_cache_dtype.py."""
import pytest
import torch

from tests.conftest import random_prompts
from tests.kernel_refs import decode_reference, paged_scene, rel_err
from tests.test_kv_cache_dtype import cpu_built, generate, prompt_log_probs
from vllm import LLM
from vllm.kernels import ops
from vllm.kernels import cpu_kernels
from vllm.attention import kv_quant

BF16 = torch.bfloat16


def hard_values(n_random=4000, seed=0) -> torch.Tensor:
    """Ties between neighbouring bf16 values (round to even), points just off them, bf16
    subnormals, values that round past the largest finite bf16 (-> inf), +-inf, NaN, random."""
    g = torch.Generator().manual_seed(seed)
    rand = torch.randn(n_random, generator=g) * torch.exp(torch.randn(n_random, generator=g) * 6)
    grid = rand.bfloat16().float()
    step = grid.abs() * 2.0 ** -8                             # half a bf16 unit, about
    bits = grid.view(torch.int32)
    tie = (bits + 0x8000).view(torch.float32)                 # exactly halfway to the next bf16
    big = float(torch.finfo(BF16).max)
    extra = torch.tensor([0.0, -0.0, big, big * 1.004, -big * 1.01, 1e-40, -1e-39,
                          float("inf"), -float("inf"), float("nan")])
    return torch.cat([rand, tie, tie + step * 1e-3, tie - step * 1e-3, extra])


def bf16_bits(x: torch.Tensor) -> torch.Tensor:
    return x.to(BF16).view(torch.int16)


def test_torch_write_equals_torch_cast():
    vals = hard_values()
    kvh, d = 2, 16
    t = len(vals) // (2 * kvh * d)
    k, v = vals[:2 * t * kvh * d].view(2, t, kvh, d)
    cache = torch.zeros(t + 3, 2, kvh, d, dtype=BF16)
    slots = torch.randperm(t + 3)[:t]
    slots[0] = -1                                            # padding: no write
    ops.write_kv(cache, slots, k, v, backend="torch")
    keep = slots >= 0
    got = cache.view(torch.int16)[slots[keep]]
    assert torch.equal(got[:, 0], bf16_bits(k[keep])) and torch.equal(got[:, 1], bf16_bits(v[keep]))
    back = kv_quant.gather(cache, slots[keep])               # widened exactly to float32
    assert back.dtype == torch.float32 and torch.equal(back, cache[slots[keep]].float())


@cpu_built
def test_c_write_equals_torch_cast(isa):
    """The C writer (rope_write_kv) against torch's cast, bit for bit (NaN -> 0x7fc0, ties to
    even, overflow to inf): cos 1, sin 0 leaves K as computed; then a real rotation against the
    float32 kernel's rotated values cast by torch."""
    kvh, d, h = 2, 16, 2
    vals = hard_values()
    t = len(vals) // (2 * kvh * d)
    kv_part = vals[:t * 2 * kvh * d].view(t, 2 * kvh * d)
    for rotate in (False, True):
        qkv = torch.cat([torch.randn(t, h * d), kv_part], dim=1)
        cos, sin = torch.ones(t, d), torch.zeros(t, d)
        if rotate:
            qkv = torch.randn(t, (h + 2 * kvh) * d) * 30
            ang = torch.rand(t, d // 2) * 6.28
            cos, sin = torch.cos(ang).repeat(1, 2), torch.sin(ang).repeat(1, 2)
        slots = torch.randperm(t + 5)[:t]
        slots[3] = -1
        ref32 = torch.zeros(t + 5, 2, kvh, d)
        q32 = cpu_kernels.rope_write_kv(qkv, cos, sin, slots, ref32, h)
        cache = torch.zeros(t + 5, 2, kvh, d, dtype=BF16)
        q = cpu_kernels.rope_write_kv(qkv, cos, sin, slots, cache, h)
        assert torch.equal(q, q32)
        keep = slots[slots >= 0]
        assert torch.equal(cache.view(torch.int16)[keep], bf16_bits(ref32[keep])), rotate
        untouched = torch.ones(t + 5, dtype=torch.bool)
        untouched[keep] = False
        assert not cache.view(torch.int16)[untouched].any()


def bf16_scene(lens, kvh, d, seed):
    """paged_scene's K/V in a bf16 cache -> (cache [S, 2, KVH, D], its values as float32,
    slots, lens)."""
    kv, slots, lens_t = paged_scene(lens, kvh, d, seed=seed, num_blocks=100, pad=-1)
    cache = (kv * 3).to(BF16)
    return cache, cache.float(), slots, lens_t


HEAD_SHAPES = [(4, 2, 16), (9, 3, 64), (14, 2, 128), (2, 2, 16), (5, 1, 32)]  # G = 2 3 7 1 5


@cpu_built
@pytest.mark.parametrize("h,kvh,d", HEAD_SHAPES)
def test_c_decode_over_bf16_matches_float64_reference(isa, h, kvh, d):
    lens = [5, 37, 1, 90, 0]
    cache, vals, slots, lens_t = bf16_scene(lens, kvh, d, h + d)
    q = torch.randn(len(lens), h, d, generator=torch.Generator().manual_seed(3))
    ref_out, ref_mass = decode_reference(q, vals, slots, lens_t, 0.25)
    mass = torch.ones(slots.shape)
    out = ops.decode_attention(q, cache, slots, lens_t, 0.25, mass, backend="cpu")
    assert rel_err(out, ref_out) < 1e-5
    assert rel_err(mass - 1, ref_mass) < 1e-5
    assert torch.equal(out[4], torch.zeros(h, d))


@cpu_built
@pytest.mark.parametrize("h,kvh,d", HEAD_SHAPES)
def test_c_decode_over_bf16_equals_float32_cache_of_the_same_values(isa, h, kvh, d):
    """Widening is exact and bf16 keys are scored up to 3 query heads at a time with the float32
    path's sums in its order, so outputs and probability mass are the float32 cache's to the bit."""
    lens = [5, 37, 1, 90, 0, 16]
    cache, vals, slots, lens_t = bf16_scene(lens, kvh, d, h * d)
    q = torch.randn(len(lens), h, d, generator=torch.Generator().manual_seed(4))
    mass, mass32 = torch.zeros(slots.shape), torch.zeros(slots.shape)
    out = ops.decode_attention(q, cache, slots, lens_t, 0.25, mass, backend="cpu")
    out32 = ops.decode_attention(q, vals, slots, lens_t, 0.25, mass32, backend="cpu")
    assert torch.equal(out, out32) and torch.equal(mass, mass32)


@cpu_built
def test_c_attention_reads_every_value_exactly(isa):
    """One key per request: its probability is exactly 1, so the output is its V as the kernel
    widens it, bit for bit the bf16 value (3 query heads a KV head: avx2's one-pass values)."""
    d, rows = 64, 40
    v = torch.randn(rows, d).mul(torch.exp(torch.randn(rows, d) * 5)).to(BF16)
    cache = torch.zeros(rows + 1, 2, 1, d, dtype=BF16)
    cache[1:, 1, 0] = v
    slots = torch.arange(1, rows + 1)[:, None]
    out = ops.decode_attention(torch.randn(rows, 3, d), cache, slots,
                               torch.ones(rows, dtype=torch.int64), 0.125, backend="cpu")
    for h in range(3):
        assert torch.equal(out[:, h], v.float())


def test_torch_decode_and_prefill_over_bf16_match_reference():
    from tests.kernel_refs import prefill_reference
    from tests.kernel_refs import prefill_meta
    from vllm.attention.backend import PrefillSpan, paged_attention
    h, kvh, d = 6, 2, 16
    cache, vals, slots, lens_t = bf16_scene([5, 37, 20], kvh, d, 4)
    q = torch.randn(3, h, d, generator=torch.Generator().manual_seed(1))
    ref_out, ref_mass = decode_reference(q, vals, slots, lens_t, 0.25)
    mass = torch.zeros(slots.shape)
    out = ops.decode_attention(q, cache, slots, lens_t, 0.25, mass, backend="torch")
    assert rel_err(out, ref_out) < 1e-5 and rel_err(mass, ref_mass) < 1e-5
    view = slots[1, :37]
    qp = torch.randn(7, h, d)
    got = paged_attention(qp, cache, prefill_meta([PrefillSpan(0, 7, view, None)]), 0.25,
                          prefill_path="span")
    mask = torch.ones(7, 37, dtype=torch.bool).tril(30)
    ref = prefill_reference(qp.transpose(0, 1), vals[view, 0].transpose(0, 1),
                            vals[view, 1].transpose(0, 1), mask, 0.25).transpose(0, 1)
    assert rel_err(got, ref) < 1e-5


def test_cuda_needs_the_models_own_dtype():
    kv_quant.check_device("bfloat16", torch.device("cpu"), torch.float32)     # CPU: any dtype
    kv_quant.check_device("float32", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="--kv-cache-dtype bfloat16.*--dtype bfloat16"):
        kv_quant.check_device("bfloat16", torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="--kv-cache-dtype float32.*--dtype float32"):
        kv_quant.check_device("float32", torch.device("cuda"), torch.bfloat16)


@pytest.mark.parametrize("given, device, model_dtype, low_bit, expect", [
    ("auto", "cpu", "float32", True, "bfloat16"),       # a GGUF or bf16 model on CPU
    ("auto", "cpu", "float32", False, "float32"),       # the float32 path
    ("auto", "cpu", "bfloat16", True, "bfloat16"),      # torch's bf16 path (tensor parallel)
    ("auto", "cuda", "bfloat16", False, "auto"),        # CUDA: the model's dtype, as before
    ("float32", "cpu", "float32", True, "float32"),     # asked for: kept
    ("fp8_e5m2", "cpu", "float32", True, "fp8_e5m2")])
def test_auto_resolves_to_the_models_precision(given, device, model_dtype, low_bit, expect):
    assert kv_quant.resolve(given, device, model_dtype, low_bit) == expect


# ---- end to end on the tiny model -----------------------------------------------------------
def test_prefix_caching_on_bf16_equals_off(tiny_llama):
    shared = random_prompts(1, seed=2, lo=64, hi=65)[0]
    ps = [shared + p for p in random_prompts(4, seed=9, lo=8, hi=30)]
    kw = dict(kv_cache_dtype="bfloat16")
    _, off, _ = generate(tiny_llama, ps, **kw)
    llm, on, _ = generate(tiny_llama, ps, enable_prefix_caching=True, **kw)
    assert on == off


def test_logits_close_to_fp32(tiny_llama):
    """Every prompt position's next-token distribution with a bf16 cache against the float32
    cache's: mean KL(fp32 || bf16) per position < 5e-4 nats (measured 3.6e-5 to 5.4e-5), top-1
    agreement >= 95% (measured 98-100%: the tiny random model's near-flat distributions flip
    near-ties; test_kv_cache_dtype.py has fp8's)."""
    model = LLM(tiny_llama, num_gpu_blocks_override=16).llm_engine.worker.model
    for p in random_prompts(4, seed=3, lo=20, hi=80):
        ref, lp = prompt_log_probs(model, p, torch.float32), prompt_log_probs(model, p, BF16)
        kl = (ref.exp() * (ref - lp)).sum(-1)
        assert kl.mean() < 5e-4, kl.mean()
        assert (ref.argmax(-1) == lp.argmax(-1)).double().mean() >= 0.95
