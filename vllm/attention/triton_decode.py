"""Triton decode attention over the paged KV cache, read through each request's slot list.

One program per (request b, KV head kh) serves the kh's G = H / KVH query heads together:

    q        [B, H, D]                   scale folded in before the dot products
    slots    [B, Lmax]  slots[b, :lens[b]] is b's attention view (live slots, logical order);
                        entries past lens[b], and negative slots, are padding and never read
    kv_cache [S, 2, KVH, D]              K = kv_cache[slot, 0, kh], V = kv_cache[slot, 1, kh]
    out      [B, H, D]
    mass     [B, Lmax]  optional: += attention probability of each key summed over all heads

Without mass: one pass with an online softmax. With mass the probabilities must be final, so a
first pass finds each head's max and normalizer and a second pass emits p = exp(s - m) / l.
Everything is computed in fp32 (inputs cast before tl.dot; ieee precision, no tf32).
On CPU it runs under TRITON_INTERPRET=1 (set before triton is imported); tests only.
"""
from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _tile(q, kv_ptr, slots_row, n0, n_keys, kh, stride_slot, stride_kv, stride_head,
          D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, LOAD_V: tl.constexpr):
    """Scores [BLOCK_G, BLOCK_N] of keys n0.. (-inf for padding), their V [BLOCK_N, BLOCK_D]."""
    n = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    slot = tl.load(slots_row + n, mask=n < n_keys, other=-1).to(tl.int64)
    valid = (n < n_keys) & (slot >= 0)
    rows = kv_ptr + slot[:, None] * stride_slot + kh * stride_head + d[None, :]
    mask = valid[:, None] & (d[None, :] < D)
    k = tl.load(rows, mask=mask, other=0.0).to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision="ieee")
    s = tl.where(valid[None, :], s, float("-inf"))
    v = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    if LOAD_V:
        v = tl.load(rows + stride_kv, mask=mask, other=0.0).to(tl.float32)
    return s, v, n


@triton.jit
def _decode_kernel(q_ptr, kv_ptr, slots_ptr, lens_ptr, out_ptr, mass_ptr, scale,
                   stride_qb, stride_qh, stride_sb, stride_slot, stride_kv, stride_head,
                   stride_mb, stride_mh,
                   G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WANT_MASS: tl.constexpr):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    n_keys = tl.load(lens_ptr + b).to(tl.int32)
    slots_row = slots_ptr + b * stride_sb
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    q_off = b * stride_qb + (kh * G + g[:, None]) * stride_qh + d[None, :]
    q_mask = (g[:, None] < G) & (d[None, :] < D)
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0).to(tl.float32) * scale
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for n0 in range(0, n_keys, BLOCK_N):
        s, v, n = _tile(q, kv_ptr, slots_row, n0, n_keys, kh, stride_slot, stride_kv,
                        stride_head, D, BLOCK_N, BLOCK_D, not WANT_MASS)
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        if not WANT_MASS:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_new
    l = tl.where(l > 0, l, 1.0)
    if WANT_MASS:   # second pass: final probabilities, their per-key sum over this kh's heads
        g_real = (g < G).to(tl.float32)
        for n0 in range(0, n_keys, BLOCK_N):
            s, v, n = _tile(q, kv_ptr, slots_row, n0, n_keys, kh, stride_slot, stride_kv,
                            stride_head, D, BLOCK_N, BLOCK_D, True)
            p = tl.exp(s - m[:, None]) / l[:, None]
            acc += tl.dot(p, v, input_precision="ieee")
            mass = tl.sum(p * g_real[:, None], 0)
            tl.store(mass_ptr + b * stride_mb + kh * stride_mh + n, mass, mask=n < n_keys)
    else:
        acc = acc / l[:, None]
    tl.store(out_ptr + q_off, acc.to(out_ptr.dtype.element_ty), mask=q_mask)


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                     lens: torch.Tensor, scale: float,
                     mass: Optional[torch.Tensor] = None) -> torch.Tensor:
    """See the module docstring; `mass` (float32 [B, >= Lmax]) is accumulated in place."""
    b, h, d = q.shape
    kvh = kv_cache.shape[2]
    assert h % kvh == 0 and kv_cache.stride(3) == 1 and q.stride(2) == 1
    g = h // kvh
    out = torch.empty_like(q)
    lmax = slots.shape[1]
    # per-KV-head partial mass; zeros, because positions past a request's length are never written
    part = torch.zeros(b, kvh, lmax, dtype=torch.float32, device=q.device) if mass is not None \
        else out   # unused placeholder pointer when no mass is wanted
    block_n = 16 if lmax <= 16 else 32
    _decode_kernel[(b, kvh)](
        q, kv_cache, slots, lens, out, part, scale,
        q.stride(0), q.stride(1), slots.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        kv_cache.stride(2), part.stride(0), part.stride(1) if mass is not None else 0,
        G=g, D=d, BLOCK_G=max(16, triton.next_power_of_2(g)), BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(d)), WANT_MASS=mass is not None)
    if mass is not None:
        mass[:, :lmax] += part.sum(1)
    return out
