"""--kv-cache-dtype fp8 on the CUDA path, proven on CPU under TRITON_INTERPRET=1: the Triton KV
write quantizes bit for bit as kv_quant.quantize (torch's cast of the clamped value); the Triton
decode kernels (one split, split-K + reduce, attention mass) over e4m3fn / e5m2 K/V match a
float64 reference of the dequantized values, reading the scales from device memory (a scale
change after launch set-up, as --calculate-kv-scales makes after CUDA graph capture, is seen);
the torch prefill gather dequantizes in the queries' dtype; relocation moves fp8 bytes exactly
(Triton, and the CUDA library's byte layout); an engine run with every write and decode on
Triton. Compiled for sm_90: tests/test_triton_sm90.py."""
import json
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():   # before any triton kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.conftest import random_prompts  # noqa: E402
from tests.kernel_refs import (decode_reference, moves, paged_scene, rel_err,  # noqa: E402
                               same_fp8_codes)
from tests.test_kv_cache_dtype import hard_values  # noqa: E402
from vllm.kernels import ops  # noqa: E402
from vllm.kernels import cuda_kernels  # noqa: E402
from vllm.attention import kv_quant
from vllm.kernels import triton_decode, triton_relocate  # noqa: E402
from vllm.kernels.triton_write_kv import write_kv as triton_write_kv  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors need the interpreter; tests/gpu runs on CUDA")


def registered(shape, dtype, k_scale=1.0, v_scale=1.0, calculate=False):
    """A one-layer fp8 cache [1, *shape] with its scales registered."""
    cache = torch.zeros(1, *shape, dtype=dtype)
    kv_quant.register(cache, calculate)
    if not calculate:
        kv_quant.set_scales(cache, [k_scale], [v_scale])
    return cache


# ---- write_kv ------------------------------------------------------------------------------------
@interpreted
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
def test_write_kv_bytes_equal_quantize(dtype, src):
    """Every finite value, midpoints (ties to even), points just off them, subnormals, values
    past the largest (saturate), +-inf and NaN; bf16 K/V as the CUDA model computes them;
    padding slots and the slots nobody wrote keep their bytes."""
    special = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf")])
    vals = torch.cat([special, hard_values(dtype, n_random=1000)]).to(src)
    kvh, d = 2, 16
    t = len(vals) // (2 * kvh * d)
    k = vals[:t * kvh * d].view(t, kvh, d)
    v = vals[t * kvh * d:2 * t * kvh * d].view(t, kvh, d)
    for k_scale, v_scale in ((1.0, 1.0), (0.37, 3.0)):
        cache = registered((t + 4, 2, kvh, d), dtype, k_scale, v_scale)
        kv_quant.bytes_(cache).fill_(0x55)
        slots = torch.randperm(t + 4, generator=torch.Generator().manual_seed(t))[:t]
        slots[1] = -1
        triton_write_kv(cache[0], slots, k, v, kv_quant.scale_row(cache[0]))
        keep = slots >= 0
        got = kv_quant.bytes_(cache[0])[slots[keep]]
        want_k = kv_quant.quantize(k[keep], k_scale, dtype).view(torch.uint8)
        want_v = kv_quant.quantize(v[keep], v_scale, dtype).view(torch.uint8)
        assert same_fp8_codes(got[:, 0], want_k, dtype), k_scale
        assert same_fp8_codes(got[:, 1], want_v, dtype), k_scale
        untouched = torch.ones(t + 4, dtype=torch.bool)
        untouched[slots[keep]] = False
        assert kv_quant.bytes_(cache[0])[untouched].eq(0x55).all()


@interpreted
def test_write_kv_strided_rows_through_the_dispatch_point():
    """K/V as strided views of a QKV projection, through ops.write_kv(backend="triton"): the
    same bytes as the torch write."""
    qkv = torch.randn(7, 4, 2, 16, dtype=torch.bfloat16) * 5
    slots = torch.tensor([3, -1, 0, 9, 5, -1, 2])
    caches = [registered((10, 2, 2, 16), torch.float8_e5m2, 0.5, 2.0) for _ in range(2)]
    ops.write_kv(caches[0][0], slots, qkv[:, 1], qkv[:, 3], backend="triton")
    ops.write_kv(caches[1][0], slots, qkv[:, 1], qkv[:, 3], backend="torch")
    assert torch.equal(kv_quant.bytes_(caches[0]), kv_quant.bytes_(caches[1]))
    assert kv_quant.bytes_(caches[0])[0, [1, 4, 6, 7, 8]].eq(0).all()


@interpreted
def test_calculated_scales_set_at_the_first_real_write():
    """--calculate-kv-scales on the Triton path: a write of padding only (a graph's warm-up)
    leaves the layer uncalibrated; the first real write sets the scales in the device row the
    kernels read (its address unchanged) and quantizes with them."""
    cache = registered((8, 2, 1, 16), torch.float8_e4m3fn, calculate=True)
    row = kv_quant.scale_row(cache[0])
    address = row.data_ptr()
    k, v = torch.randn(3, 1, 16) * 40, torch.randn(3, 1, 16) / 50
    ops.write_kv(cache[0], torch.full((3,), -1), k, v, backend="triton")
    assert kv_quant.needs_calibration(cache[0]) and row.tolist() == [1.0] * 4
    ops.write_kv(cache[0], torch.tensor([4, -1, 1]), k, v, backend="triton")
    assert not kv_quant.needs_calibration(cache[0])
    k_scale, v_scale = kv_quant.layer_scales(cache[0])
    assert k_scale == pytest.approx(float(k[[0, 2]].abs().max()) / 224, rel=1e-6)
    assert v_scale == pytest.approx(float(v[[0, 2]].abs().max()) / 224, rel=1e-6)
    assert row.tolist() == [k_scale, v_scale, kv_quant.inverse(k_scale),
                            kv_quant.inverse(v_scale)]
    assert kv_quant.scale_row(cache[0]).data_ptr() == address
    got = kv_quant.bytes_(cache[0])[[4, 1]]
    assert torch.equal(got[:, 0], kv_quant.quantize(k[[0, 2]], k_scale, cache.dtype)
                       .view(torch.uint8))
    assert torch.equal(got[:, 1], kv_quant.quantize(v[[0, 2]], v_scale, cache.dtype)
                       .view(torch.uint8))


# ---- decode attention ----------------------------------------------------------------------------
def fp8_scene(lens, h, kvh, d, dtype, q_dtype, seed, k_scale=0.7, v_scale=1.9):
    """paged_scene's K/V (x3) written quantized into a registered one-layer fp8 cache -> (cache,
    the dequantized float32 values, slots, lens, q)."""
    kv, slots, lens_t = paged_scene(lens, kvh, d, seed=seed, num_blocks=48)
    cache = registered(kv.shape, dtype, k_scale, v_scale)
    every = torch.arange(kv.shape[0])
    kv_quant.write(cache[0], every, kv[:, 0] * 3, kv[:, 1] * 3)
    deq = kv_quant.gather(cache[0], every)
    q = torch.randn(len(lens), h, d, generator=torch.Generator().manual_seed(seed)).to(q_dtype)
    return cache, deq, slots, lens_t, q


@interpreted
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("with_mass", [False, True])
def test_decode_over_fp8_matches_float64_reference(dtype, q_dtype, num_splits, with_mass):
    """Groups of 3 (a padded query-head row), a row of 0 keys, empty splits. bf16 queries run
    the tensor-core path's numerics (bf16 operands, p in bf16, fp32 accumulation)."""
    lens = [5, 37, 0, 64]
    cache, deq, slots, lens_t, q = fp8_scene(lens, 6, 2, 16, dtype, q_dtype, seed=len(lens))
    assert deq.abs().max() > 2                                 # scales applied, not all zero
    ref_out, ref_mass = decode_reference(q, deq, slots, lens_t, 0.25)
    mass = torch.ones(slots.shape) if with_mass else None
    out = triton_decode.decode_attention(q, cache[0], slots, lens_t, 0.25, mass,
                                         num_splits=num_splits)
    tol = 1e-5 if q_dtype == torch.float32 else 2e-2
    assert out.dtype == q_dtype and rel_err(out, ref_out) < tol
    assert out[2].eq(0).all()                                  # no keys: zeros, not NaN
    if with_mass:
        assert rel_err(mass - 1, ref_mass) < tol


@interpreted
@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_reads_the_scales_from_device_memory(num_splits):
    """The row handed to the kernels is read at run time: set_scales after the row was taken
    (what --calculate-kv-scales does after CUDA graphs captured it) changes the output to the
    new scales' reference."""
    lens = [20, 9]
    cache, _, slots, lens_t, q = fp8_scene(lens, 4, 1, 16, torch.float8_e4m3fn, torch.float32,
                                           seed=2)
    row = kv_quant.scale_row(cache[0])
    kv_quant.set_scales(cache, [0.2], [5.0])
    every = torch.arange(cache.shape[1])
    deq = kv_quant.gather(cache[0], every)
    assert deq[:, 1].abs().max() > 5 * deq[:, 0].abs().max()      # scales 25x apart
    ref_out, ref_mass = decode_reference(q, deq, slots, lens_t, 0.3)
    mass = torch.zeros(slots.shape)
    out = triton_decode.decode_attention(q, cache[0], slots, lens_t, 0.3, mass,
                                         num_splits=num_splits, kv_scale=row)
    assert rel_err(out, ref_out) < 1e-5 and rel_err(mass, ref_mass) < 1e-5


@interpreted
def test_default_heuristic_and_dispatch_point_over_fp8():
    """ops.decode_attention(backend="triton") with the split heuristic (a long row splits on the
    interpreter) on an fp16-query e5m2 cache; every layer of a stacked cache reads its own
    scales."""
    lens = [300, 45]
    kv, slots, lens_t = paged_scene(lens, 1, 16, seed=7, num_blocks=140)
    stacked = torch.zeros(2, *kv.shape, dtype=torch.float8_e5m2)
    kv_quant.register(stacked)
    kv_quant.set_scales(stacked, [0.5, 0.05], [2.0, 0.2])
    every = torch.arange(kv.shape[0])
    q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1)).half()
    for layer in range(2):
        kv_quant.write(stacked[layer], every, kv[:, 0], kv[:, 1] * 3)
        deq = kv_quant.gather(stacked[layer], every)
        ref_out, ref_mass = decode_reference(q, deq, slots, lens_t, 0.25)
        mass = torch.zeros(slots.shape)
        out = ops.decode_attention(q, stacked[layer], slots, lens_t, 0.25, mass,
                                   backend="triton")
        assert rel_err(out, ref_out) < 5e-3 and rel_err(mass, ref_mass) < 5e-3, layer


# ---- prefill's gather ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_prefill_gather_dequantizes_in_the_queries_dtype(dtype, q_dtype):
    """What the torch prefill paths (SDPA, xformers) read on CUDA: fp8 -> q's dtype exactly,
    then one rounding of x * scale computed in float32."""
    cache = registered((40, 2, 2, 8), dtype, 0.37, 3.1)
    g = torch.Generator().manual_seed(0)
    kv_quant.bytes_(cache)[:] = torch.randint(0, 256, cache.shape, dtype=torch.uint8,
                                              generator=g)
    kv_quant.bytes_(cache)[~torch.isfinite(cache.float())] = 0           # no NaN / inf codes
    slots = torch.tensor([7, 0, 39, 7, 12])
    got = kv_quant.gather(cache[0], slots, q_dtype)
    scales = torch.tensor([0.37, 3.1], dtype=torch.float32).view(1, 2, 1, 1)
    want = (cache[0][slots].float() * scales).to(q_dtype)
    assert got.dtype == q_dtype and torch.equal(got, want)


# ---- relocation ----------------------------------------------------------------------------------
@interpreted
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("layers,kvh,d", [(9, 2, 8), (3, 1, 1), (2, 8, 128)])
def test_triton_relocation_moves_fp8_bytes_exactly(dtype, layers, kvh, d):
    """Every byte, NaN codes included, through ops.relocate_kv(backend="triton") (the uint8
    view) and the kernel on the fp8 tensor itself; rows of 2 bytes (int16 words) to 4 KB."""
    g = torch.Generator().manual_seed(d)
    raw = torch.randint(0, 256, (layers, 24, 2, kvh, d), dtype=torch.uint8, generator=g)
    raw[:, 3] = 0x7F
    src, dst = moves(24, 6, seed=layers)
    expect = raw.clone()
    expect[:, dst] = raw[:, src]
    for run in (lambda kv: ops.relocate_kv(kv, src, dst, backend="triton"),
                lambda kv: triton_relocate.relocate_kv(kv, src, dst)):
        kv = raw.clone().view(dtype)
        run(kv)
        assert torch.equal(kv.view(torch.uint8), expect)


def test_cuda_relocation_gets_the_byte_view(monkeypatch):
    """ops.relocate_kv(backend="cuda") hands the CUDA kernel the uint8 view of an fp8 cache
    (element size 1); the byte layout the C entry point receives, replayed on the host as the
    kernel reads it, moves every byte; the prebuilt library picks 16-byte accesses for fp8 rows
    of head_dim 64 and 128."""
    seen = []
    monkeypatch.setattr(cuda_kernels, "relocate_kv", lambda kv, s, d: seen.append(kv))
    g = torch.Generator().manual_seed(3)
    raw = torch.randint(0, 256, (3, 16, 2, 2, 8), dtype=torch.uint8, generator=g)
    kv = raw.clone().view(torch.float8_e4m3fn)
    src, dst = torch.tensor([1, 7, 3]), torch.tensor([12, 0, 9])
    ops.relocate_kv(kv, src, dst, backend="cuda")
    (view,) = seen
    assert view.dtype == torch.uint8 and view.data_ptr() == kv.data_ptr()
    assert cuda_kernels.check_layout(view, require_cuda=False) == 32
    ptr, layers, slots, layer_stride, row, *_ = cuda_kernels.launch_args(view, src, dst, 0)
    assert (layers, slots, layer_stride, row) == (3, 16, 16 * 32, 32)
    mem = kv.view(torch.uint8).view(-1)
    for s, d in zip(src.tolist(), dst.tolist()):
        for layer in range(layers):
            at = ptr - kv.data_ptr() + layer * layer_stride
            mem[at + d * row:at + (d + 1) * row] = mem[at + s * row:at + (s + 1) * row].clone()
    expect = raw.clone()
    expect[:, dst] = raw[:, src]
    assert torch.equal(kv.view(torch.uint8), expect)
    lib = cuda_kernels.prebuilt_path()
    if lib is None or cuda_kernels.check_prebuilt(lib) is not None:
        pytest.skip("no current prebuilt library")
    prebuilt = cuda_kernels.PrebuiltLibrary(lib)
    for kvh, d in ((8, 128), (1, 64)):
        row = 2 * kvh * d                                   # one byte per element
        assert prebuilt.vector_bytes(1 << 20, 4096 * row, row) == 16


# ---- which devices run it -----------------------------------------------------------------------
def test_device_check(monkeypatch):
    """fp8 on CPU and on CUDA from sm_80; e4m3 from sm_89 (Triton has no e4m3fn before Ada);
    anything else a ValueError naming the flag."""
    cuda = torch.device("cuda")
    for flag in ("auto", "fp8_e4m3", "fp8_e5m2"):
        kv_quant.check_device(flag, torch.device("cpu"))
    kv_quant.check_device("auto", cuda)                # asks the GPU nothing
    for capability, runs in (((9, 0), ("fp8", "fp8_e4m3", "fp8_e5m2")),
                             ((8, 9), ("fp8", "fp8_e4m3", "fp8_e5m2")),
                             ((8, 0), ("fp8_e5m2",)), ((7, 5), ())):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability)
        for flag in ("fp8", "fp8_e4m3", "fp8_e5m2"):
            if flag in runs:
                kv_quant.check_device(flag, cuda)
            else:
                with pytest.raises(ValueError, match=f"--kv-cache-dtype {flag}: sm_"):
                    kv_quant.check_device(flag, cuda)
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8_e5m2: .* not mps"):
        kv_quant.check_device("fp8_e5m2", torch.device("mps"))


# ---- an engine on the Triton path ----------------------------------------------------------------
_ENGINE_RUN = r"""
import collections, json, sys
import torch
from vllm import LLM, SamplingParams
from vllm.attention import kv_quant
from vllm.kernels import triton_decode, triton_write_kv

calls = collections.Counter()
def counted(mod, name):
    f = getattr(mod, name)
    def wrapper(*a, **k):
        calls[name + ("_fp8" if kv_quant.is_fp8(a[1] if name == "decode_attention" else a[0])
                      else "")] += 1
        return f(*a, **k)
    setattr(mod, name, wrapper)
counted(triton_decode, "decode_attention")
counted(triton_write_kv, "write_kv")
model, prompts, configs = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
out = []
for kwargs in configs:
    calls.clear()
    llm = LLM(model, num_gpu_blocks_override=64, **kwargs)
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    out.append({"tokens": [r.outputs[0].token_ids for r in res], "calls": dict(calls),
                "stats": llm.get_kv_stats(),
                "scales": kv_quant.scales_of(llm.llm_engine.kv_caches).tolist()})
print("RESULT" + json.dumps(out))
"""
CONFIGS = [dict(kv_cache_dtype="fp8_e4m3", calculate_kv_scales=True),
           dict(kv_cache_dtype="fp8_e5m2", kv_eviction_policy="h2o", kv_min_tokens=0,
                block_size=4, kv_reclamation="vtoken", kv_frag_threshold=0.0,
                kv_check_invariants=True)]


def test_engine_on_the_triton_path_equals_the_cpu_path(tiny_llama):
    """VLLM_KERNEL_BACKEND=triton under the interpreter (a subprocess): every KV write and decode
    of an fp8 engine runs the Triton kernels (e4m3 with calculated scales; e5m2 with H2O and
    vToken relocation); the greedy tokens, evictions and calculated scales equal the default
    CPU path's (float32 attention over fp8 K/V on both)."""
    prompts = random_prompts(2, seed=5, lo=20, hi=30)
    env = dict(os.environ, TRITON_INTERPRET="1", VLLM_KERNEL_BACKEND="triton", PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, "-c", _ENGINE_RUN, tiny_llama, json.dumps(prompts),
                          json.dumps(CONFIGS)], env=env, capture_output=True, text=True, cwd=ROOT,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    for kwargs, got in zip(CONFIGS, json.loads(run.stdout.split("RESULT", 1)[1])):
        check_against_the_cpu_path(tiny_llama, prompts, kwargs, got)


def check_against_the_cpu_path(model, prompts, kwargs, got):
    from vllm import LLM, SamplingParams
    assert got["calls"].get("write_kv_fp8", 0) > 0 and got["calls"].get("decode_attention_fp8")
    llm = LLM(model, num_gpu_blocks_override=64, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert got["tokens"] == [r.outputs[0].token_ids for r in ref]
    # layer 0's scales are bit-equal; later layers' inputs differ in the last bits (the CPU
    # path's packed C GEMM vs torch's matmul when the C kernels are off)
    scales = kv_quant.scales_of(llm.llm_engine.kv_caches)
    assert got["scales"][0] == scales[0].tolist()
    assert torch.allclose(torch.tensor(got["scales"]), scales, rtol=1e-5)
    if kwargs.get("calculate_kv_scales"):
        assert scales.ne(1.0).all()
    if "kv_eviction_policy" in kwargs:
        stats = llm.get_kv_stats()
        assert got["stats"]["evicted_tokens"] == stats["evicted_tokens"] > 0
        assert got["stats"]["relocation_events"] > 0
