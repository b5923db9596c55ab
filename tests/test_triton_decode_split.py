"""Split-K Triton decode (vllm/kernels/triton_decode.py) against the float64 reference, under
TRITON_INTERPRET=1; the split selection (shapes only: eager steps and CUDA graph buckets alike);
the mass pass bounded by each row's length. Compiled for Hopper: tests/test_triton_sm90.py."""
import os

import pytest
import torch

if not torch.cuda.is_available():   # before any triton kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from vllm.kernels import triton_decode  # noqa: E402
from tests.kernel_refs import decode_reference, paged_scene, rel_err  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors need the interpreter; tests/gpu runs on CUDA")


def _scene(h, kvh, d, lens, seed, dtype=torch.float32, num_blocks=48):
    """paged_scene with tails past lens that mix -1, 0 and real slots (all must be ignored)."""
    kv, slots, lens_t = paged_scene(lens, kvh, d, seed=seed, num_blocks=num_blocks, pad=0,
                                    dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1)
    for i, n in enumerate(lens):
        tail = torch.randint(0, kv.shape[0], (slots.shape[1] - n,), generator=g)
        tail[::2] = -1                                   # -1 in the middle of the tail
        slots[i, n:] = tail
    q = torch.randn(len(lens), h, d, generator=g).to(dtype)
    return q, kv, slots, lens_t


@interpreted
@pytest.mark.parametrize("num_splits", [1, 2, 3, 5])
@pytest.mark.parametrize("h,kvh,d", [(4, 2, 16), (8, 1, 16), (2, 2, 16), (4, 2, 24), (6, 2, 16)])
def test_split_decode_matches_reference(num_splits, h, kvh, d):
    """GQA / MQA / MHA / odd head_dim / groups of 3 (a padded row); rows of 0 keys and shorter
    than Lmax; 5 splits over at most 4 tiles (and 3 splits of 2 tiles each) leave empty
    splits."""
    lens = [0, 100, 33]
    q, kv, slots, lens_t = _scene(h, kvh, d, lens, seed=h * 10 + kvh + d, num_blocks=96)
    ref_out, ref_mass = decode_reference(q, kv, slots, lens_t, 0.3)
    start = torch.rand(len(lens), slots.shape[1] + 3)     # mass may be wider than Lmax
    mass = start.clone()
    out = triton_decode.decode_attention(q, kv, slots, lens_t, 0.3, mass, num_splits=num_splits)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert rel_err(out, ref_out) < 1e-5
    assert out[0].eq(0).all()                             # no keys: zeros, not NaN
    width = slots.shape[1]
    assert rel_err(mass[:, :width] - start[:, :width], ref_mass) < 1e-5
    assert torch.equal(mass[:, width:], start[:, width:])
    plain = triton_decode.decode_attention(q, kv, slots, lens_t, 0.3, num_splits=num_splits)
    assert rel_err(plain, ref_out) < 1e-5


@interpreted
def test_default_split_heuristic_on_the_interpreter():
    """Without num_splits the interpreter still splits a long row (MIN_TILES tiles per split);
    the short row fits in its first split."""
    lens = [300, 45]
    q, kv, slots, lens_t = _scene(4, 1, 16, lens, seed=7, num_blocks=140)
    assert triton_decode.num_splits_for(2, 1, 300, 32, q.device) == 2
    ref_out, ref_mass = decode_reference(q, kv, slots, lens_t, 0.25)
    mass = torch.zeros(slots.shape)
    out = triton_decode.decode_attention(q, kv, slots, lens_t, 0.25, mass)
    assert rel_err(out, ref_out) < 1e-5 and rel_err(mass, ref_mass) < 1e-5


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_16bit_cache_split_decode(num_splits, dtype):
    """The tensor-core path's numerics (16-bit operands, p cast to the cache dtype, fp32
    accumulation); the interpreter upcasts bf16 operands (its dot reads their raw bits)."""
    lens = [37, 64, 5]
    q, kv, slots, lens_t = _scene(4, 2, 16, lens, seed=11, dtype=dtype)
    ref_out, ref_mass = decode_reference(q, kv, slots, lens_t, 0.25)
    mass = torch.zeros(slots.shape)
    out = triton_decode.decode_attention(q, kv, slots, lens_t, 0.25, mass, num_splits=num_splits)
    assert out.dtype == dtype
    assert rel_err(out, ref_out) < 2e-2 and rel_err(mass, ref_mass) < 2e-2


def test_split_heuristic(monkeypatch):
    """Shapes only: enough programs for WAVES per SM, at least MIN_TILES tiles per split; the
    batch counts as its next power of two, the width as the views' capacity."""
    monkeypatch.setattr(triton_decode, "_sm_count", lambda device: 132)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert triton_decode.num_splits_for(1, 8, 8192, 32, cuda) == 64
    assert triton_decode.num_splits_for(1, 8, 1024, 32, cuda) == 8        # 32 tiles / 4
    assert triton_decode.num_splits_for(16, 8, 8192, 32, cuda) == 4       # 528 // 128
    assert triton_decode.num_splits_for(9, 8, 8192, 32, cuda) == 4        # as 16
    assert triton_decode.num_splits_for(64, 8, 8192, 32, cuda) == 1
    assert triton_decode.num_splits_for(1, 8, 100, 32, cuda) == 1         # too short to split
    assert triton_decode.num_splits_for(1, 1, 32768, 32, cuda) == 256     # reduce loops: fine
    assert triton_decode.num_splits_for(1, 1, 8192, 32, cpu) == triton_decode.CPU_PROGRAMS
    wide = torch.full((4, 8192), -1)
    assert triton_decode.views_capacity(wide[:3, :300]) == 8192            # a row slice
    assert triton_decode.views_capacity(wide[:, :300].contiguous()) == 300


def _engine_views(max_seqs, capacity, lens):
    """The views of one decode step as the engine passes them: eager (the step's rows and width,
    InputBuffers.step_inputs) and its CUDA graph bucket (padded rows, full width)."""
    import numpy as np

    from vllm.worker.cuda_graph_runner import CudaGraphRunner, bucket_for
    from vllm.worker.input_buffers import InputBuffers
    bufs = InputBuffers(max_tokens=max_seqs, max_seqs=max_seqs, max_view_len=capacity)
    n = len(lens)
    rng = np.random.default_rng(n)
    views = [np.sort(rng.choice(4 * capacity, size, replace=False)) for size in lens]
    bufs.update(np.zeros(n, np.int64), np.arange(n), np.arange(n), views)
    eager = bufs.step_inputs()[3:]
    runner = CudaGraphRunner(None, torch.zeros(1), bufs, max_seqs)      # CPU: no capture
    bucket = bucket_for(n, runner.sizes)
    meta = runner._static_meta(bucket, want_mass=True)
    return eager, (meta.decode_views, meta.decode_lens), bucket


@pytest.mark.parametrize("capacity", [120, 2048, 8192, 32768])
@pytest.mark.parametrize("kvh", [1, 2, 8])
def test_eager_and_graph_steps_plan_alike(monkeypatch, capacity, kvh):
    """The one selection (decode_plan) gives an eager step of B rows (its own width) and the
    graph bucket it would replay (bucket rows, full width) the same splits and blocks, for
    every batch size of a 64-sequence engine."""
    monkeypatch.setattr(triton_decode, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    splits = set()
    for b in range(1, 65):
        lens = [1 + (37 * i) % min(capacity, 300) for i in range(b)]
        (e_views, _), (g_views, _), bucket = _engine_views(64, capacity, lens)
        assert e_views.shape == (b, max(lens)) and g_views.shape == (bucket, capacity)
        for dtype in (torch.bfloat16, torch.float32):
            eager = triton_decode.decode_plan(b, 4 * kvh, 128, kvh, e_views, dtype, cuda)
            graph = triton_decode.decode_plan(bucket, 4 * kvh, 128, kvh, g_views, dtype, cuda)
            assert eager == graph, (b, bucket)
            splits.add(eager.splits)
    assert capacity > 120 or splits == {1}
    assert capacity < 8192 or len(splits) > 2            # the heuristic did vary with B


@interpreted
def test_eager_and_graph_steps_compute_alike(monkeypatch):
    """Under the interpreter, with splits > 1 (CPU_PROGRAMS raised): the eager views and the
    graph bucket's give bit-identical outputs and mass for the real rows."""
    monkeypatch.setattr(triton_decode, "CPU_PROGRAMS", 32)
    lens = [300, 45, 170]
    (e_views, e_lens), (g_views, g_lens), bucket = _engine_views(4, 1024, lens)
    assert bucket == 4
    cpu = torch.device("cpu")
    plan = triton_decode.decode_plan(3, 4, 16, 1, e_views, torch.float32, cpu)
    assert plan.splits == 8 and plan.mass_splits == 8     # 32 // (4 x 1), 32 tiles / 4
    g = torch.Generator().manual_seed(5)
    kv = torch.randn(4 * 1024, 2, 1, 16, generator=g)
    q = torch.randn(bucket, 4, 16, generator=g)
    e_mass, g_mass = torch.zeros(3, e_views.shape[1]), torch.zeros(bucket, 1024)
    e_out = triton_decode.decode_attention(q[:3], kv, e_views, e_lens, 0.25, e_mass)
    g_out = triton_decode.decode_attention(q, kv, g_views, g_lens, 0.25, g_mass)
    assert torch.equal(e_out, g_out[:3])
    assert torch.equal(e_mass, g_mass[:3, :e_views.shape[1]])
    assert g_mass[:, 300:].eq(0).all() and g_out[3].eq(0).all()
    ref_out, ref_mass = decode_reference(q[:3], kv, e_views, e_lens, 0.25)
    assert rel_err(e_out, ref_out) < 1e-5 and rel_err(e_mass, ref_mass) < 1e-5


@interpreted
@pytest.mark.parametrize("num_splits", [None, 3])
def test_mass_stops_at_each_rows_length(num_splits):
    """Entries past lens[b] (a tail of real slots in the views) are never written: -0.0 stays
    -0.0 (an add of 0.0 would make it +0.0); every live entry is written."""
    lens = [70, 5, 0]
    q, kv, slots, lens_t = _scene(4, 2, 16, lens, seed=3)
    mass = torch.full((3, slots.shape[1] + 2), -0.0)
    triton_decode.decode_attention(q, kv, slots, lens_t, 0.3, mass, num_splits=num_splits)
    for i, n in enumerate(lens):
        assert torch.signbit(mass[i, n:]).all() and mass[i, n:].eq(0).all()
        assert (mass[i, :n] > 0).all()
    _, ref_mass = decode_reference(q, kv, slots, lens_t, 0.3)
    assert rel_err(mass[:, :slots.shape[1]], ref_mass) < 1e-5
