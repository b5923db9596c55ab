"""Triton KV write: this step's K/V rows into their cache slots; a slot < 0 writes nothing.

One program per token t, storing all of its KV heads:

    k, v      [T, KVH, D]           (strided views of the QKV projection; rows need not be dense)
    kv_cache  [S, 2, KVH, D]        kv_cache[slot[t], 0] = k[t], kv_cache[slot[t], 1] = v[t]

An fp8 cache (e4m3fn / e5m2, vllm/attention/kv_quant.py; `_write_kv_fp8_kernel`, a float
cache `_write_kv_kernel`) stores x * (1 / scale) rounded to nearest even and saturated to the
largest finite value, with the layer's scales read from device memory (kv_quant.scale_row:
(k, v, 1/k, 1/v)), never baked into the launch, so a CUDA graph captured before
--calculate-kv-scales sets them writes with the set values. The rounding is integer
arithmetic on the float32 bits (`_fp8_bits`), the same steps compiled and under the interpreter
(whose own fp8 cast rounds half up and does not saturate), and equals torch's cast of the
clamped value bit for bit (tests/test_triton_fp8.py).

Padding (slot -1) is a masked store, so there is no host check and the launch is
CUDA-graph capturable. On CPU it runs under TRITON_INTERPRET=1 (tests only).
"""
from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_bits(x, inv, MANT: tl.constexpr, BIAS: tl.constexpr, MAX: tl.constexpr):
    """x * inv as fp8 bits (uint32 0..255): RTNE, |.| saturated to MAX, NaN -> sign | 0x7f.

    On the float32 bits a of |y| (unbiased exponent e, 24-bit significand m):
      normal fp8 (e >= 1 - BIAS): drop 23 - MANT mantissa bits, rounding half to even (a carry
          moves into the exponent), then rebias: e4m3 448.0 = 0x43e00000 -> 0x7e
      subnormal fp8: m * 2^(e - 23) in units of 2^(1 - BIAS - MANT), i.e. m >> s rounded half
          to even, s = 24 - BIAS - MANT - e (>= 21 there; capped at 31, where all of m is
          below half a unit): e4m3 2^-9 (the least subnormal) -> 0x01, 2^-10 (a tie) -> 0x00
    """
    y = x.to(tl.float32) * inv
    sign = (y.to(tl.uint32, bitcast=True) >> 24) & 0x80
    a = tl.minimum(tl.abs(y), MAX).to(tl.uint32, bitcast=True)
    e = (a >> 23).to(tl.int32) - 127
    normal = (a + ((1 << (22 - MANT)) - 1) + ((a >> (23 - MANT)) & 1)) >> (23 - MANT)
    normal -= (127 - BIAS) << MANT
    m = (a & 0x7FFFFF) | 0x800000
    s = tl.minimum(tl.maximum(24 - BIAS - MANT - e, 1), 31).to(tl.uint32)   # normal: unused
    sub = (m + (1 << (s - 1)) - 1 + ((m >> s) & 1)) >> s
    bits = tl.where(e >= 1 - BIAS, normal, sub)
    return tl.where(y != y, 0x7F, bits) | sign


@triton.jit
def _store_fp8(dst, x, inv, mask):
    """x * inv quantized into the fp8 cache at dst."""
    ty = dst.dtype.element_ty
    if ty == tl.float8e4nv:
        bits = _fp8_bits(x, inv, 3, 7, 448.0)
    else:
        tl.static_assert(ty == tl.float8e5)
        bits = _fp8_bits(x, inv, 2, 15, 57344.0)
    tl.store(dst, bits.to(tl.uint8).to(ty, bitcast=True), mask=mask)


@triton.jit
def _token_rows(k_ptr, v_ptr, cache_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                stride_slot, stride_head, KVH: tl.constexpr, D: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's token: its K and V [BLOCK_H, BLOCK_D], where its K goes, the mask."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < KVH) & (d < D) & (slot >= 0)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    return k, v, cache_ptr + slot * stride_slot + h * stride_head + d, mask


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, stride_kt, stride_kh, stride_vt,
                     stride_vh, stride_slot, stride_kv, stride_head,
                     KVH: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    k, v, dst, mask = _token_rows(k_ptr, v_ptr, cache_ptr, slot_ptr, stride_kt, stride_kh,
                                  stride_vt, stride_vh, stride_slot, stride_head, KVH, D,
                                  BLOCK_H, BLOCK_D)
    tl.store(dst, k, mask=mask)
    tl.store(dst + stride_kv, v, mask=mask)


@triton.jit
def _write_kv_fp8_kernel(k_ptr, v_ptr, cache_ptr, scale_ptr, slot_ptr, stride_kt, stride_kh,
                         stride_vt, stride_vh, stride_slot, stride_kv, stride_head,
                         KVH: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    """scale_ptr: the layer's (k, v, 1/k, 1/v), read when the kernel runs."""
    k, v, dst, mask = _token_rows(k_ptr, v_ptr, cache_ptr, slot_ptr, stride_kt, stride_kh,
                                  stride_vt, stride_vh, stride_slot, stride_head, KVH, D,
                                  BLOCK_H, BLOCK_D)
    _store_fp8(dst, k, tl.load(scale_ptr + 2), mask)
    _store_fp8(dst + stride_kv, v, tl.load(scale_ptr + 3), mask)


def write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, scales: Optional[torch.Tensor] = None) -> None:
    """scales: an fp8 cache's layer row (kv_quant.scale_row), float32 [4] on its device."""
    t, kvh, d = k.shape
    if t == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and kv_cache.stride(3) == 1 \
        and slot_mapping.stride(0) == 1
    args = (k.stride(0), k.stride(1), v.stride(0), v.stride(1), kv_cache.stride(0),
            kv_cache.stride(1), kv_cache.stride(2))
    consts = dict(KVH=kvh, D=d, BLOCK_H=triton.next_power_of_2(kvh),
                  BLOCK_D=triton.next_power_of_2(d))
    if kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        assert scales is not None and scales.dtype == torch.float32 and scales.numel() == 4, \
            "write_kv: an fp8 cache needs its scale row"
        _write_kv_fp8_kernel[(t,)](k, v, kv_cache, scales, slot_mapping, *args, **consts)
    else:
        _write_kv_kernel[(t,)](k, v, kv_cache, slot_mapping, *args, **consts)
