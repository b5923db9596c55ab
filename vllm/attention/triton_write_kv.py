"""Triton KV write: this step's K/V rows into their cache slots; a slot < 0 writes nothing.

One program per token t, storing all of its KV heads:

    k, v      [T, KVH, D]           (strided views of the QKV projection; rows need not be dense)
    kv_cache  [S, 2, KVH, D]        kv_cache[slot[t], 0] = k[t], kv_cache[slot[t], 1] = v[t]

Padding (slot -1) is a masked store, so there is no host check and the launch is
CUDA-graph capturable. On CPU it runs under TRITON_INTERPRET=1 (tests only).
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, stride_kt, stride_kh, stride_vt,
                     stride_vh, stride_slot, stride_kv, stride_head,
                     KVH: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < KVH) & (d < D) & (slot >= 0)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    dst = cache_ptr + slot * stride_slot + h * stride_head + d
    tl.store(dst, k, mask=mask)
    tl.store(dst + stride_kv, v, mask=mask)


def write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    t, kvh, d = k.shape
    if t == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and kv_cache.stride(3) == 1 \
        and slot_mapping.stride(0) == 1
    _write_kv_kernel[(t,)](
        k, v, kv_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        KVH=kvh, D=d, BLOCK_H=triton.next_power_of_2(kvh), BLOCK_D=triton.next_power_of_2(d))
