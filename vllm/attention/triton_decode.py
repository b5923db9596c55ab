"""Triton decode attention over the paged KV cache, read through each request's slot list.

Each program serves one KV head kh of request b and its G = H / KVH query heads together:

    q        [B, H, D]                   scale folded in before the dot products
    slots    [B, Lmax]  slots[b, :lens[b]] is b's attention view (live slots, logical order);
                        entries past lens[b], and negative slots, are padding and never read
    kv_cache [S, 2, KVH, D]              K = kv_cache[slot, 0, kh], V = kv_cache[slot, 1, kh]
    out      [B, H, D]                   q's dtype
    mass     [B, Lmax]  optional: += attention probability of each key summed over all heads

One split (grid (B, KVH), `_decode_kernel`): an online softmax; with mass, a first pass finds
each head's max and normalizer and a second pass emits final p = exp(s - m) / l and out.

Split-K (flash decoding; grid (B, KVH, splits)) for long views and small batches, where (B, KVH)
alone would leave most SMs idle. Split i of row b covers max(ceil(tiles_b / splits), min_tiles)
whole BLOCK_N tiles of b's own length (min_tiles: MIN_TILES, or 1 when num_splits is forced):

    lens[b] 300, BLOCK_N 32 -> 10 tiles; 4 splits, min_tiles 1 -> 3 tiles (96 keys) each:
    split 0: keys [0, 96)  1: [96, 192)  2: [192, 288)  3: [288, 300)
    same with min_tiles 4 -> 4 tiles each: [0, 128)  [128, 256)  [256, 300)  (empty)

  1. `_split_kernel`   per split: partial max m, sum l, unnormalized acc -> fp32 scratch
                       ml [B, H, splits, 2], acc [B, H, splits, D] (H = KVH x G, kh-major)
  2. `_reduce_kernel`  per (b, h): rescale splits to the global max, out = sum acc / sum l;
                       with mass also the global (m, l) of each head -> stats [B, H, 2]
  3. `_mass_kernel`    only with mass: per split, K only, p = exp(s - m) / l summed over kh's
                       heads -> part [B, KVH, Lmax]; then mass[:, :Lmax] += part.sum(1).
                       A plain store and a sum, not atomics: the result does not depend on
                       scheduling, so eager and graph replays evict the same tokens.

The number of splits depends on shapes only (B, KVH, Lmax = slots.shape[1], the SM count) and
each split's range is computed on the device from lens, so nothing syncs with the host and
CUDA graphs replay with any lens. Rows shorter than Lmax leave their last splits empty.
Everything is computed in fp32 (inputs loaded in their dtype, cast before tl.dot; ieee
precision, no tf32). On CPU it runs under TRITON_INTERPRET=1 (set before triton is imported);
tests only.
"""
import functools
from typing import Optional

import torch
import triton
import triton.language as tl

MIN_TILES = 4          # BLOCK_N tiles per split at least, so a split's fixed costs stay small
WAVES = 4              # programs per SM that the split heuristic aims for on CUDA
CPU_PROGRAMS = 4       # the interpreter's target: ~1 ms per program instance


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
def _load_q(q_ptr, b, kh, stride_qb, stride_qh, scale,
            G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """kh's G query heads of request b, scaled, fp32 [BLOCK_G, BLOCK_D]; rows past G are 0."""
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    q_off = b * stride_qb + (kh * G + g[:, None]) * stride_qh + d[None, :]
    q_mask = (g[:, None] < G) & (d[None, :] < D)
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0).to(tl.float32) * scale
    return q, q_off, q_mask


@triton.jit
def _softmax_pass(q, kv_ptr, slots_row, start, end, kh, stride_slot, stride_kv, stride_head,
                  D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, WITH_V: tl.constexpr):
    """Online softmax over keys [start, end): max m, sum l, unnormalized acc (if WITH_V)."""
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for n0 in range(start, end, BLOCK_N):
        s, v, n = _tile(q, kv_ptr, slots_row, n0, end, kh, stride_slot, stride_kv,
                        stride_head, D, BLOCK_N, BLOCK_D, WITH_V)
        m_new = tl.maximum(m, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)   # no key yet: exp(-inf - 0) = 0
        alpha = tl.exp(m - m_ref)
        p = tl.exp(s - m_ref[:, None])
        l = l * alpha + tl.sum(p, 1)
        if WITH_V:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_new
    return m, l, acc


@triton.jit
def _split_range(n_keys, split, num_splits, min_tiles, BLOCK_N: tl.constexpr):
    """Keys [start, end) of `split`: whole tiles of the row's own length, min_tiles at least."""
    tiles = tl.cdiv(n_keys, BLOCK_N)
    per = tl.maximum(tl.cdiv(tiles, num_splits), min_tiles) * BLOCK_N
    start = split * per
    return start, tl.minimum(start + per, n_keys)


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
    q, q_off, q_mask = _load_q(q_ptr, b, kh, stride_qb, stride_qh, scale, G, D, BLOCK_G, BLOCK_D)
    m, l, acc = _softmax_pass(q, kv_ptr, slots_row, 0, n_keys, kh, stride_slot, stride_kv,
                              stride_head, D, BLOCK_G, BLOCK_N, BLOCK_D, not WANT_MASS)
    m = tl.where(m == float("-inf"), 0.0, m)
    l = tl.where(l > 0, l, 1.0)
    if WANT_MASS:   # second pass: final probabilities, their per-key sum over this kh's heads
        g_real = (tl.arange(0, BLOCK_G) < G).to(tl.float32)
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


@triton.jit
def _split_kernel(q_ptr, kv_ptr, slots_ptr, lens_ptr, ml_ptr, acc_ptr, scale, min_tiles,
                  stride_qb, stride_qh, stride_sb, stride_slot, stride_kv, stride_head,
                  G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    n_keys = tl.load(lens_ptr + b).to(tl.int32)
    start, end = _split_range(n_keys, split, num_splits, min_tiles, BLOCK_N)
    q, q_off, q_mask = _load_q(q_ptr, b, kh, stride_qb, stride_qh, scale, G, D, BLOCK_G, BLOCK_D)
    m, l, acc = _softmax_pass(q, kv_ptr, slots_ptr + b * stride_sb, start, end, kh, stride_slot,
                              stride_kv, stride_head, D, BLOCK_G, BLOCK_N, BLOCK_D, True)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    row = ((b * tl.num_programs(1) + kh) * G + g) * num_splits + split     # [B, H, splits]
    tl.store(ml_ptr + row * 2, m, mask=g < G)          # an empty split: m = -inf, l = 0, acc = 0
    tl.store(ml_ptr + row * 2 + 1, l, mask=g < G)
    tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=q_mask)


@triton.jit
def _reduce_kernel(ml_ptr, acc_ptr, out_ptr, stats_ptr, num_splits, stride_ob, stride_oh,
                   D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                   WANT_STATS: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    head = b * tl.num_programs(1) + h
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    row = head * num_splits + s
    m = tl.load(ml_ptr + row * 2, mask=s < num_splits, other=float("-inf"))
    l = tl.load(ml_ptr + row * 2 + 1, mask=s < num_splits, other=0.0)
    m_all = tl.max(m, 0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)       # a row without keys
    w = tl.exp(m - m_all)                                       # 0 for empty splits
    l_all = tl.sum(w * l, 0)
    l_all = tl.where(l_all > 0, l_all, 1.0)
    mask = (s[:, None] < num_splits) & (d[None, :] < D)
    acc = tl.load(acc_ptr + row[:, None] * D + d[None, :], mask=mask, other=0.0)
    out = tl.sum(acc * w[:, None], 0) / l_all
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < D)
    if WANT_STATS:
        tl.store(stats_ptr + head * 2, m_all)
        tl.store(stats_ptr + head * 2 + 1, l_all)


@triton.jit
def _mass_kernel(q_ptr, kv_ptr, slots_ptr, lens_ptr, stats_ptr, part_ptr, scale, min_tiles,
                 stride_qb, stride_qh, stride_sb, stride_slot, stride_kv, stride_head,
                 stride_pb, stride_ph,
                 G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    split = tl.program_id(2)
    n_keys = tl.load(lens_ptr + b).to(tl.int32)
    start, end = _split_range(n_keys, split, tl.num_programs(2), min_tiles, BLOCK_N)
    q, q_off, q_mask = _load_q(q_ptr, b, kh, stride_qb, stride_qh, scale, G, D, BLOCK_G, BLOCK_D)
    g = tl.arange(0, BLOCK_G)
    head = (b * tl.num_programs(1) + kh) * G + g
    m = tl.load(stats_ptr + head * 2, mask=g < G, other=0.0)
    l = tl.load(stats_ptr + head * 2 + 1, mask=g < G, other=1.0)
    g_real = (g < G).to(tl.float32)
    slots_row = slots_ptr + b * stride_sb
    for n0 in range(start, end, BLOCK_N):
        s, v, n = _tile(q, kv_ptr, slots_row, n0, end, kh, stride_slot, stride_kv, stride_head,
                        D, BLOCK_N, BLOCK_D, False)
        p = tl.exp(s - m[:, None]) / l[:, None]
        mass = tl.sum(p * g_real[:, None], 0)
        tl.store(part_ptr + b * stride_pb + kh * stride_ph + n, mass, mask=n < end)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_splits_for(b: int, kvh: int, lmax: int, block_n: int, device: torch.device) -> int:
    """Splits per (request, KV head): enough programs for WAVES per SM (CPU_PROGRAMS in the
    interpreter), each over MIN_TILES tiles at least. Shapes only: no lens, no host sync.

        H200 (132 SMs), B 1, KVH 8, Lmax 8192, BLOCK_N 32 -> min(528 // 8, 256 // 4) = 64
        same at B 64 -> 1 (512 programs already)
    """
    target = WAVES * _sm_count(device) if device.type == "cuda" else CPU_PROGRAMS
    most = max(1, triton.cdiv(lmax, block_n) // MIN_TILES)
    return max(1, min(most, target // (b * kvh)))


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                     lens: torch.Tensor, scale: float, mass: Optional[torch.Tensor] = None,
                     num_splits: Optional[int] = None) -> torch.Tensor:
    """See the module docstring; `mass` (float32 [B, >= Lmax]) is accumulated in place.
    num_splits forces the split count (tests), with splits as even as whole tiles allow."""
    b, h, d = q.shape
    kvh = kv_cache.shape[2]
    assert h % kvh == 0 and kv_cache.stride(3) == 1 and q.stride(2) == 1
    g = h // kvh
    out = torch.empty_like(q)
    lmax = slots.shape[1]
    block_n = 16 if lmax <= 16 else 32
    min_tiles = 1 if num_splits else MIN_TILES
    splits = num_splits or num_splits_for(b, kvh, lmax, block_n, q.device)
    # per-KV-head partial mass; zeros, because positions past a request's length are never written
    part = torch.zeros(b, kvh, lmax, dtype=torch.float32, device=q.device) if mass is not None \
        else out   # unused placeholder pointer when no mass is wanted
    consts = dict(G=g, D=d, BLOCK_G=max(16, triton.next_power_of_2(g)), BLOCK_N=block_n,
                  BLOCK_D=max(16, triton.next_power_of_2(d)))
    kv_strides = (slots.stride(0), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2))
    if splits == 1:
        _decode_kernel[(b, kvh)](
            q, kv_cache, slots, lens, out, part, scale, q.stride(0), q.stride(1), *kv_strides,
            part.stride(0), part.stride(1) if mass is not None else 0,
            WANT_MASS=mass is not None, **consts)
    else:
        _split_decode(q, kv_cache, slots, lens, scale, out, part if mass is not None else None,
                      splits, min_tiles, kv_strides, consts)
    if mass is not None:
        mass[:, :lmax] += part.sum(1)
    return out


def _split_decode(q, kv_cache, slots, lens, scale, out, part, splits, min_tiles, kv_strides,
                  consts):
    b, h, d = q.shape
    kvh = kv_cache.shape[2]
    ml = torch.empty(b, h, splits, 2, dtype=torch.float32, device=q.device)
    acc = torch.empty(b, h, splits, d, dtype=torch.float32, device=q.device)
    _split_kernel[(b, kvh, splits)](q, kv_cache, slots, lens, ml, acc, scale, min_tiles,
                                    q.stride(0), q.stride(1), *kv_strides, **consts)
    stats = torch.empty(b, h, 2, dtype=torch.float32, device=q.device) if part is not None \
        else ml   # unused placeholder pointer when no mass is wanted
    _reduce_kernel[(b, h)](ml, acc, out, stats, splits, out.stride(0), out.stride(1), D=d,
                           BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=consts["BLOCK_D"],
                           WANT_STATS=part is not None)
    if part is not None:
        _mass_kernel[(b, kvh, splits)](q, kv_cache, slots, lens, stats, part, scale, min_tiles,
                                       q.stride(0), q.stride(1), *kv_strides, part.stride(0),
                                       part.stride(1), **consts)
