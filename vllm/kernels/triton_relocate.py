"""Triton relocation kernel: kv_caches[:, dst[i]] = kv_caches[:, src[i]] for all layers, one launch.

The fallback where the CUDA kernel (vllm/kernels/cuda_kernels.py) cannot load. Its grid, like the CUDA
kernel's, goes over (moves x layer chunks): program (i, c) copies move i's row in the
LAYER_CHUNK layers c * LAYER_CHUNK ..., all chunk rows loaded as one [LAYER_CHUNK, BLOCK] tile
before any store, so each program has LAYER_CHUNK independent row reads in flight and a
32-layer cache is 4 programs per move, not one program walking 32 layers in turn.

The cache is copied as raw bits (viewed as the widest integer that divides a slot's row), so
fp32, fp16, bf16 and fp8 caches (ops.relocate_kv passes an fp8 cache as its uint8 view) copy
exactly, NaN payloads included:

    kv_caches  [L, S, 2, KVH, D]  --view-->  words [L, S, ROW]    ROW = 2*KVH*D*elem / word
    program (i, c): for l in chunk c: words[l, dst[i]] = words[l, src[i]]

Offsets are int64 (a large cache's layer stride times a layer index passes 2**31 words).
On CPU it runs under TRITON_INTERPRET=1 (set before triton is imported); tests only.
"""
from typing import Tuple

import torch
import triton
import triton.language as tl

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.int8))
LAYER_CHUNK = 8          # layers per program (a power of two); a smaller cache masks the rest
MAX_TILE = 4096          # words per [LAYER_CHUNK, BLOCK] tile: 32 per thread at 4 warps
_CHUNK = tl.constexpr(LAYER_CHUNK)


@triton.jit
def _relocate_kernel(kv_ptr, src_ptr, dst_ptr, num_layers, layer_stride,
                     ROW: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    layers = tl.program_id(1) * _CHUNK + tl.arange(0, _CHUNK)
    src = tl.load(src_ptr + i).to(tl.int64) * ROW
    dst = tl.load(dst_ptr + i).to(tl.int64) * ROW
    base = layers.to(tl.int64)[:, None] * layer_stride          # [LAYER_CHUNK, 1] word offsets
    in_cache = (layers < num_layers)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    for start in tl.static_range(0, ROW, BLOCK):
        mask = in_cache & (start + cols < ROW)
        rows = tl.load(kv_ptr + base + src + start + cols, mask=mask)
        tl.store(kv_ptr + base + dst + start + cols, rows, mask=mask)


def _as_words(kv_caches: torch.Tensor) -> torch.Tensor:
    """[L, S, 2, KVH, D] -> [L, S, ROW] integer view of the same memory."""
    row_bytes = kv_caches[0, 0].numel() * kv_caches.element_size()
    flat = kv_caches.view(kv_caches.shape[0], kv_caches.shape[1], -1)
    for size, dtype in _WORDS:
        if row_bytes % size == 0 and flat.data_ptr() % size == 0 and \
                (flat.stride(0) * kv_caches.element_size()) % size == 0:
            return flat.view(dtype)
    raise AssertionError("unreachable: int8 always divides")


def launch_shape(num_moves: int, num_layers: int, row: int) -> Tuple[Tuple[int, int], int]:
    """(grid, BLOCK) for num_moves moves of `row`-word rows in num_layers layers."""
    block = max(2, min(triton.next_power_of_2(row), MAX_TILE // LAYER_CHUNK))   # no 1-wide tile
    return (num_moves, triton.cdiv(num_layers, LAYER_CHUNK)), block


def relocate_kv(kv_caches: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    assert kv_caches[0, 0].is_contiguous() and kv_caches.stride(1) == kv_caches[0, 0].numel(), \
        "relocate_kv: every slot's K/V row must be contiguous"
    if len(src) == 0:
        return
    words = _as_words(kv_caches)
    layers, row = words.shape[0], words.shape[2]
    src = src.to(device=kv_caches.device, dtype=torch.int64)
    dst = dst.to(device=kv_caches.device, dtype=torch.int64)
    grid, block = launch_shape(len(src), layers, row)
    _relocate_kernel[grid](words, src, dst, layers, words.stride(0), ROW=row, BLOCK=block)
