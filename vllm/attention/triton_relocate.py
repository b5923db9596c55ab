"""Triton relocation kernel: kv_caches[:, dst[i]] = kv_caches[:, src[i]] for all layers, one launch.

The cache is copied as raw bits (viewed as the widest integer that divides a slot's row), so
fp32, fp16 and bf16 caches copy exactly, NaN payloads included:

    kv_caches  [L, S, 2, KVH, D]  --view-->  words [L, S, ROW]    ROW = 2*KVH*D*elem / word
    program i: for each layer l, words[l, dst[i]] = words[l, src[i]]

On CPU it runs under TRITON_INTERPRET=1 (set before triton is imported); tests only.
"""
import torch
import triton
import triton.language as tl

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.int8))


@triton.jit
def _relocate_kernel(kv_ptr, src_ptr, dst_ptr, num_layers, layer_stride,
                     ROW: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    src = tl.load(src_ptr + i).to(tl.int64) * ROW
    dst = tl.load(dst_ptr + i).to(tl.int64) * ROW
    cols = tl.arange(0, BLOCK)
    base = kv_ptr
    for _ in range(num_layers):
        for start in tl.static_range(0, ROW, BLOCK):
            mask = start + cols < ROW
            row = tl.load(base + src + start + cols, mask=mask)
            tl.store(base + dst + start + cols, row, mask=mask)
        base += layer_stride       # pointer steps: no 32-bit overflow on large caches


def _as_words(kv_caches: torch.Tensor) -> torch.Tensor:
    """[L, S, 2, KVH, D] -> [L, S, ROW] integer view of the same memory."""
    row_bytes = kv_caches[0, 0].numel() * kv_caches.element_size()
    flat = kv_caches.view(kv_caches.shape[0], kv_caches.shape[1], -1)
    for size, dtype in _WORDS:
        if row_bytes % size == 0 and flat.data_ptr() % size == 0:
            return flat.view(dtype)
    raise AssertionError("unreachable: int8 always divides")


def relocate_kv(kv_caches: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    assert kv_caches[0].is_contiguous(), "relocate_kv: each layer's cache must be contiguous"
    if len(src) == 0:
        return
    words = _as_words(kv_caches)
    row = words.shape[2]
    src = src.to(device=kv_caches.device, dtype=torch.int64)
    dst = dst.to(device=kv_caches.device, dtype=torch.int64)
    block = min(triton.next_power_of_2(row), 1024)
    _relocate_kernel[(len(src),)](words, src, dst, words.shape[0], words.stride(0),
                                  ROW=row, BLOCK=block)
