"""The Triton relocation fallback (vllm/kernels/triton_relocate.py) against torch on CPU, under
TRITON_INTERPRET=1: its grid goes over (moves x layer chunks), and every layer count (below, at
and off the chunk), row size (one tile, several tiles, 1-word rows), dtype and a strided cache
(a gap between layers) copies bit-exactly; fp8 caches (--kv-cache-dtype) too, NaN codes
included (more in tests/test_triton_fp8.py). On CUDA: tests/gpu/test_gpu_kernels.py."""
import os

import pytest
import torch

if not torch.cuda.is_available():   # before any triton kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from vllm.kernels import ops  # noqa: E402
from vllm.kernels import triton_relocate  # noqa: E402
from tests.kernel_refs import moves  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU tensors need the interpreter; tests/gpu runs on CUDA")


def check(layers, slots, kvh, d, dtype, n, layer_pad=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        full = torch.randn(layers, slots + layer_pad, 2, kvh, d, generator=g).to(dtype)
        full[0, 1] = float("nan")                   # bits are copied, NaN payloads too
    else:
        full = torch.randint(0, 255, (layers, slots + layer_pad, 2, kvh, d), generator=g,
                             dtype=dtype)
    kv, gap = full[:, :slots], full[:, slots:].clone()
    src, dst = moves(slots, n, seed=seed + 1)
    ref = kv.clone()
    ops.relocate_kv(ref, src, dst, backend="torch")
    triton_relocate.relocate_kv(kv, src, dst)
    assert torch.equal(kv.contiguous().view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(full[:, slots:].view(torch.uint8), gap.view(torch.uint8))   # untouched


@pytest.mark.parametrize("layers", [1, 2, 7, 8, 9, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_layer_count_and_dtype(layers, dtype):
    check(layers, 32, 2, 8, dtype, 6, seed=layers)


@pytest.mark.parametrize("kvh,d,dtype", [(1, 3, torch.bfloat16),     # 12-byte rows: int32 words
                                         (1, 1, torch.float16),      # one 4-byte word per row
                                         (1, 1, torch.uint8),        # 2-byte rows: int16
                                         (1, 3, torch.float8_e5m2),  # 6-byte rows: int16
                                         (8, 64, torch.float8_e4m3fn),   # 1 KB: int64 words
                                         (8, 128, torch.float32)])   # 1024 words: two tiles
def test_row_sizes(kvh, d, dtype):
    check(9, 16, kvh, d, dtype, 3)


@pytest.mark.parametrize("layer_pad", [1, 5])
def test_strided_cache(layer_pad):
    """A gap between layers (a view of a larger cache): copied right, nothing outside the view
    written."""
    check(10, 24, 2, 4, torch.float16, 5, layer_pad=layer_pad, seed=layer_pad)


def test_grid_is_moves_by_layer_chunks(monkeypatch):
    """One program per (move, 8-layer chunk), not one per move walking every layer."""
    grids = []
    kernel = triton_relocate._relocate_kernel

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]
    monkeypatch.setattr(triton_relocate, "_relocate_kernel", Recorder())
    kv = torch.randn(32, 16, 2, 1, 8)
    src, dst = moves(16, 5, seed=4)
    ref = kv.clone()
    ops.relocate_kv(ref, src, dst, backend="torch")
    triton_relocate.relocate_kv(kv, src, dst)
    assert grids == [(5, 4)] and torch.equal(kv, ref)
    assert triton_relocate.launch_shape(300, 13, 512) == ((300, 2), 512)
    assert triton_relocate.launch_shape(7, 3, 3) == ((7, 1), 4)
    assert triton_relocate.launch_shape(7, 1, 1) == ((7, 1), 2)        # no 1-wide tiles
    for moves_, layers, row in [(1, 32, 4096), (9, 80, 100), (2, 5, 1)]:
        (m, chunks), block = triton_relocate.launch_shape(moves_, layers, row)
        chunk = triton_relocate.LAYER_CHUNK
        assert m == moves_ and chunks * chunk >= layers > (chunks - 1) * chunk
        assert chunk * block <= triton_relocate.MAX_TILE


def test_empty_batch_is_a_no_op():
    kv = torch.randn(3, 8, 2, 1, 4)
    before = kv.clone()
    triton_relocate.relocate_kv(kv, torch.tensor([], dtype=torch.int64),
                                torch.tensor([], dtype=torch.int64))
    assert torch.equal(kv, before)
