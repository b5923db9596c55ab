"""Triton decode attention over the paged KV cache, read through each request's slot list.

Each attention program serves one KV head kh of request b and its G = H / KVH query heads:

    q        [B, H, D]                   out [B, H, D] in q's dtype
    slots    [B, Lmax]  slots[b, :lens[b]] is b's attention view (live slots, logical order);
                        entries past lens[b], and negative slots, are padding and never read
    kv_cache [S, 2, KVH, D]              K = kv_cache[slot, 0, kh], V = kv_cache[slot, 1, kh]
    mass     [B, >= Lmax] optional: += attention probability of each key summed over all heads
    kv_scale fp8 caches: the layer's float32 (k, v, 1/k, 1/v) in device memory (kv_quant.scale_row)
    sinks    [H] float32 optional: each query head's learned sink logit (gpt-oss), a key with no
             value: one more term of the softmax's max and sum (HAS_SINKS)

Dot products: bf16/fp16 caches run both dots (q K^T and p V) on tensor cores (mma) with fp32
accumulation, p cast to the cache dtype; an fp32 cache keeps exact fp32 FMA dots
(input_precision "ieee", no tf32), which the float64 interpreter tests and the fp32 runs
compared token for token against transformers rely on. Softmax statistics are always fp32.

An fp8 cache (e4m3fn / e5m2, --kv-cache-dtype) is dequantized in registers: K and V tiles are
converted to q's dtype (exact: every fp8 value is a bf16/fp16/fp32 value), so the dots run as
for a cache of q's dtype (tensor cores for bf16/fp16), and the per-layer scales are folded in
where they cost one multiply: k_scale into the softmax scale (s = (q . k8) * scale * k_scale),
v_scale into the output (out = acc * v_scale / l; split partials carry it already). The scales
are loaded from kv_scale, never passed as Python floats: CUDA graphs captured at start-up read
the values --calculate-kv-scales sets at the first prefill.
The query-head block is G rounded up to a power of two, nothing more: the pinned Triton's
tl.dot takes M < 16 on tensor cores (its NVIDIA min_dot_size is M, N >= 1, K >= 16; the
m16n8k16 instruction pads the rows itself), so the softmax, q and acc hold only the group's
rows. Block sizes, warps and pipelining come from `_config` (shapes and dtypes only); no kernel
spills at head_dim 64/128 and 1/4/8 query heads per KV head, bf16 or fp32, over a cache of that
dtype or fp8 (tests/test_triton_sm90.py compiles them for sm_90 as the JIT specializes them,
and checks).

One split (grid (B, KVH), `_decode_kernel`): an online softmax over the row's keys, started
from the sink (m = s_h, l = exp(s_h - m) = 1, acc = 0) where there is one, else from no key yet
(m = -inf, l = 0).

Split-K (flash decoding; grid (B, KVH, splits)) for long views and small batches, where (B, KVH)
alone would leave most SMs idle. Split i of row b covers max(ceil(tiles_b / splits), min_tiles)
whole BLOCK_N tiles of b's own length (min_tiles: MIN_TILES, or 1 when num_splits is forced):

    lens[b] 300, BLOCK_N 32 -> 10 tiles; 4 splits, min_tiles 1 -> 3 tiles (96 keys) each:
    split 0: keys [0, 96)  1: [96, 192)  2: [192, 288)  3: [288, 300)
    same with min_tiles 4 -> 4 tiles each: [0, 128)  [128, 256)  [256, 300)  (empty)

  1. `_split_kernel`   per split: partial max m, sum l, unnormalized acc -> fp32 scratch
                       ml [B, H, splits, 2], acc [B, H, splits, D] (H = KVH x G, kh-major)
  2. `_reduce_kernel`  per (b, h): rescale splits to the global max, out = sum acc / sum l,
                       over the splits in chunks of REDUCE_CHUNK (registers do not grow with
                       the split count); with mass also each head's global (m, l) -> stats.
                       The sink joins here, once, as one more term of the max and the sum
                       (the splits' partials never include it)

With mass, the attention kernels also leave each head's (m, l) in stats [B, H, 2] (the sink
counted in both: the mass is the real keys' probabilities, a row's sum < 1), then

  3. `_mass_kernel`    grid (B, mass splits): K only, p = exp(s - m) / l summed over every head
                       of every KV head, added to mass[b, key] for keys < lens[b] only: the
                       grid's ranges and loops stop at each row's live length, so its cost does
                       not grow with Lmax (the views' width, max_model_len in CUDA graphs). Each
                       key has one owner program, which sums the heads in a fixed order: no
                       atomics, the result does not depend on scheduling.

Split counts (`num_splits_for`, through `decode_plan`) depend on shapes only: the batch
rounded up to a power of two, KVH, the views' capacity (max(slots.stride(0), Lmax): the
engine's views are row slices of InputBuffers.view_slots [max_seqs, max_model_len], in eager
steps and CUDA graph buckets alike) and the SM count. Never lens, never the step's width:
nothing syncs with the host, graphs replay with any lens, and an eager step and the graph
bucket it would replay (the smallest capture size >= B, whose next power of two is B's) pick
the same splits and block sizes, so their sums run in the same order. Rows shorter than the
capacity leave their last splits empty (programs that exit at once).
On CPU it runs under TRITON_INTERPRET=1 (set before triton is imported); tests only.
"""
import functools
import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from vllm.attention import kv_quant

MIN_TILES = 4          # BLOCK_N tiles per split at least, so a split's fixed costs stay small
WAVES = 4              # programs per SM that the split heuristic aims for on CUDA
CPU_PROGRAMS = 4       # the interpreter's target: ~1 ms per program instance
REDUCE_CHUNK = 16      # splits the reduce kernel holds in registers at once
# the interpreter's tl.dot multiplies bf16 operands' raw uint16 bits: upcast them there
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _dot(a, b):
    """a @ b, fp32 accumulator: tensor cores for 16-bit inputs, exact FMA for fp32."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    elif _INTERPRETED and a.dtype == tl.bfloat16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, out_dtype=tl.float32)


@triton.jit
def _dequant(x, dtype):
    """A loaded K/V tile in the dots' dtype (an fp8 tile exactly: fp8 is a subset of each).
    The interpreter goes through fp32: its direct e5m2 -> fp16 cast loses subnormals."""
    if x.dtype.is_fp8() and _INTERPRETED:
        return x.to(tl.float32).to(dtype)
    else:
        return x.to(dtype)


@triton.jit
def _fp8_scales(kv_ptr, kv_scale_ptr, scale):
    """(softmax scale with k_scale folded in, v_scale): an fp8 cache's from device memory."""
    if kv_ptr.dtype.element_ty.is_fp8():
        return scale * tl.load(kv_scale_ptr), tl.load(kv_scale_ptr + 1)
    else:
        return scale, 1.0


@triton.jit
def _load_q(q_ptr, kv_ptr, b, kh, stride_qb, stride_qh,
            G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """kh's G query heads of request b in the dots' dtype (the cache's; q's own over an fp8
    cache) [BLOCK_G, BLOCK_D]; rows past G 0."""
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    q_off = b * stride_qb + (kh * G + g[:, None]) * stride_qh + d[None, :]
    q_mask = (g[:, None] < G) & (d[None, :] < D)
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
    if not kv_ptr.dtype.element_ty.is_fp8():
        q = q.to(kv_ptr.dtype.element_ty)
    return q, q_off, q_mask


@triton.jit
def _scores(q, kv_ptr, slots_row, n0, n_keys, kh, scale, stride_slot, stride_head,
            D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Scaled fp32 scores [BLOCK_G, BLOCK_N] of keys n0.. (-inf for padding), and where their
    K rows are (V rows are stride_kv further)."""
    n = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    slot = tl.load(slots_row + n, mask=n < n_keys, other=-1).to(tl.int64)
    valid = (n < n_keys) & (slot >= 0)
    rows = kv_ptr + slot[:, None] * stride_slot + kh * stride_head + d[None, :]
    mask = valid[:, None] & (d[None, :] < D)
    k = _dequant(tl.load(rows, mask=mask, other=0.0), q.dtype)
    s = _dot(q, tl.trans(k)) * scale
    return tl.where(valid[None, :], s, float("-inf")), rows, mask, n


@triton.jit
def _softmax_pass(q, kv_ptr, slots_row, start, end, kh, scale, stride_slot, stride_kv,
                  stride_head, m0, D: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Online softmax over keys [start, end): max m, sum l (relative to m), unnormalized acc.
    m0 [BLOCK_G]: where each head starts, a sink logit (a key with no value: it counts
    exp(m0 - m0) = 1 in the sum) or -inf (no key yet: the sum starts at 0)."""
    m = m0
    l = tl.where(m0 == float("-inf"), 0.0, 1.0)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for n0 in range(start, end, BLOCK_N):
        s, rows, mask, n = _scores(q, kv_ptr, slots_row, n0, end, kh, scale, stride_slot,
                                   stride_head, D, BLOCK_N, BLOCK_D)
        v = _dequant(tl.load(rows + stride_kv, mask=mask, other=0.0), q.dtype)
        m_new = tl.maximum(m, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)   # no key yet: exp(-inf - 0) = 0
        alpha = tl.exp(m - m_ref)
        p = tl.exp(s - m_ref[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v)
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
def _decode_kernel(q_ptr, kv_ptr, kv_scale_ptr, slots_ptr, lens_ptr, out_ptr, stats_ptr,
                   sinks_ptr, scale, stride_qb, stride_qh, stride_sb, stride_slot, stride_kv,
                   stride_head, G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WANT_STATS: tl.constexpr,
                   HAS_SINKS: tl.constexpr):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    n_keys = tl.load(lens_ptr + b).to(tl.int32)
    scale, v_scale = _fp8_scales(kv_ptr, kv_scale_ptr, scale)
    q, q_off, q_mask = _load_q(q_ptr, kv_ptr, b, kh, stride_qb, stride_qh, G, D, BLOCK_G,
                               BLOCK_D)
    g = tl.arange(0, BLOCK_G)
    m0 = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    if HAS_SINKS:
        m0 = tl.load(sinks_ptr + kh * G + g, mask=g < G, other=float("-inf"))
    m, l, acc = _softmax_pass(q, kv_ptr, slots_ptr + b * stride_sb, 0, n_keys, kh, scale,
                              stride_slot, stride_kv, stride_head, m0, D, BLOCK_G, BLOCK_N,
                              BLOCK_D)
    m = tl.where(m == float("-inf"), 0.0, m)          # a row without keys: zeros, not NaN
    l = tl.where(l > 0, l, 1.0)
    out = acc * (v_scale / l)[:, None]
    tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    if WANT_STATS:
        head = (b * tl.num_programs(1) + kh) * G + g
        tl.store(stats_ptr + head * 2, m, mask=g < G)
        tl.store(stats_ptr + head * 2 + 1, l, mask=g < G)


@triton.jit
def _split_kernel(q_ptr, kv_ptr, kv_scale_ptr, slots_ptr, lens_ptr, ml_ptr, acc_ptr, scale,
                  min_tiles, stride_qb, stride_qh, stride_sb, stride_slot, stride_kv, stride_head,
                  G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    n_keys = tl.load(lens_ptr + b).to(tl.int32)
    start, end = _split_range(n_keys, split, num_splits, min_tiles, BLOCK_N)
    scale, v_scale = _fp8_scales(kv_ptr, kv_scale_ptr, scale)
    q, q_off, q_mask = _load_q(q_ptr, kv_ptr, b, kh, stride_qb, stride_qh, G, D, BLOCK_G,
                               BLOCK_D)
    m, l, acc = _softmax_pass(q, kv_ptr, slots_ptr + b * stride_sb, start, end, kh, scale,
                              stride_slot, stride_kv, stride_head,
                              tl.full((BLOCK_G,), float("-inf"), tl.float32), D, BLOCK_G,
                              BLOCK_N, BLOCK_D)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    row = ((b * tl.num_programs(1) + kh) * G + g) * num_splits + split     # [B, H, splits]
    tl.store(ml_ptr + row * 2, m, mask=g < G)          # an empty split: m = -inf, l = 0, acc = 0
    tl.store(ml_ptr + row * 2 + 1, l, mask=g < G)
    tl.store(acc_ptr + row[:, None] * D + d[None, :], acc * v_scale, mask=q_mask)


@triton.jit
def _reduce_kernel(ml_ptr, acc_ptr, out_ptr, stats_ptr, sinks_ptr, num_splits, stride_ob,
                   stride_oh, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                   WANT_STATS: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Chunks of BLOCK_S splits: the global max first (ml only), then the rescaled sums. The
    sink, where there is one, is one more term of both, with no value."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    head = b * tl.num_programs(1) + h
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    base = head * num_splits
    m_max = tl.full((BLOCK_S,), float("-inf"), tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        m = tl.load(ml_ptr + (base + s0 + s) * 2, mask=s0 + s < num_splits, other=float("-inf"))
        m_max = tl.maximum(m_max, m)
    m_all = tl.max(m_max, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h)
        m_all = tl.maximum(m_all, sink)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)       # a row without keys
    l_sum = tl.zeros((BLOCK_S,), tl.float32)
    acc = tl.zeros((BLOCK_S, BLOCK_D), tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        row = base + s0 + s
        live = s0 + s < num_splits
        m = tl.load(ml_ptr + row * 2, mask=live, other=float("-inf"))
        l = tl.load(ml_ptr + row * 2 + 1, mask=live, other=0.0)
        w = tl.exp(m - m_all)                                   # 0 for empty splits
        l_sum += w * l
        mask = (live & (l > 0))[:, None] & (d[None, :] < D)    # empty splits: no loads
        acc += tl.load(acc_ptr + row[:, None] * D + d[None, :], mask=mask, other=0.0) \
            * w[:, None]
    l_all = tl.sum(l_sum, 0)
    if HAS_SINKS:
        l_all += tl.exp(sink - m_all)
    l_all = tl.where(l_all > 0, l_all, 1.0)
    out = tl.sum(acc, 0) / l_all
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < D)
    if WANT_STATS:
        tl.store(stats_ptr + head * 2, m_all)
        tl.store(stats_ptr + head * 2 + 1, l_all)


@triton.jit
def _mass_kernel(q_ptr, kv_ptr, kv_scale_ptr, slots_ptr, lens_ptr, stats_ptr, mass_ptr, scale,
                 min_tiles, num_kv_heads, stride_qb, stride_qh, stride_sb, stride_slot, stride_head,
                 stride_mb, G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """mass[b, n] += sum over all heads of exp(s - m) / l, for the keys of this split only."""
    b = tl.program_id(0)
    split = tl.program_id(1)
    n_keys = tl.load(lens_ptr + b).to(tl.int32)
    start, end = _split_range(n_keys, split, tl.num_programs(1), min_tiles, BLOCK_N)
    scale, _ = _fp8_scales(kv_ptr, kv_scale_ptr, scale)
    g = tl.arange(0, BLOCK_G)
    slots_row = slots_ptr + b * stride_sb
    for n0 in range(start, end, BLOCK_N):
        total = tl.zeros((BLOCK_N,), tl.float32)
        for kh in range(0, num_kv_heads):
            q, q_off, q_mask = _load_q(q_ptr, kv_ptr, b, kh, stride_qb, stride_qh, G, D,
                                       BLOCK_G, BLOCK_D)
            head = (b * num_kv_heads + kh) * G + g
            m = tl.load(stats_ptr + head * 2, mask=g < G, other=0.0)
            l = tl.load(stats_ptr + head * 2 + 1, mask=g < G, other=1.0)
            s, rows, mask, n = _scores(q, kv_ptr, slots_row, n0, end, kh, scale, stride_slot,
                                       stride_head, D, BLOCK_N, BLOCK_D)
            p = tl.exp(s - m[:, None]) / l[:, None]
            total += tl.sum(tl.where(g[:, None] < G, p, 0.0), 0)
        n = n0 + tl.arange(0, BLOCK_N)
        dst = mass_ptr + b * stride_mb + n
        tl.store(dst, tl.load(dst, mask=n < end, other=0.0) + total, mask=n < end)


class Config(NamedTuple):
    """Compile-time shape of one decode call (see `_config`)."""
    block_g: int
    block_n: int
    block_d: int
    num_warps: int          # every decode-path kernel
    mass_block_n: int
    num_stages: int         # the attention and mass kernels' software pipelining depth


def _config(g: int, d: int, dtype: torch.dtype,
            q_dtype: Optional[torch.dtype] = None) -> Config:
    """Block sizes from shapes and dtypes only (never lens or the step's width), chosen so that
    no kernel spills at head_dim <= 128, G <= 8 on sm_90 (tests/test_triton_sm90.py). dtype is
    the cache's, q_dtype the queries' (it matters over an fp8 cache only). Pipelining stays at
    Triton's default (3 stages) except for fp32 dots over an fp8 cache: there the prefetched,
    converted fp32 tiles need 158-255 registers (spilling at head_dim 128, G 8); one stage
    takes 40-64."""
    block_g = triton.next_power_of_2(g)
    block_d = max(16, triton.next_power_of_2(d))
    stages = 1 if kv_quant.is_fp8_dtype(dtype) and q_dtype == torch.float32 else 3
    return Config(block_g=block_g, block_n=32, block_d=block_d, num_warps=4, mass_block_n=32,
                  num_stages=stages)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_splits_for(batch: int, kvh: int, capacity: int, block_n: int,
                   device: torch.device) -> int:
    """Splits per (request, KV head) -- the one selection, for eager steps and CUDA graphs alike:
    enough programs for WAVES per SM (CPU_PROGRAMS in the interpreter), each over MIN_TILES
    tiles at least. Shapes only: batch is rounded up to a power of two (a graph bucket, the
    smallest capture size >= B, rounds to the same), capacity is the views' allocated width
    (max_model_len in the engine), never the step's lens or width; no host sync.

        H200 (132 SMs), batch 1, KVH 8, capacity 8192, BLOCK_N 32 -> min(528 // 8, 256 // 4) = 64
        batch 5 or 8 (bucket 8), KVH 8 -> 528 // 64 = 8;  batch 64 -> 1 (512 programs already)
    """
    target = WAVES * _sm_count(device) if device.type == "cuda" else CPU_PROGRAMS
    most = max(1, triton.cdiv(capacity, block_n) // MIN_TILES)
    return max(1, min(most, target // (triton.next_power_of_2(max(batch, 1)) * kvh)))


def views_capacity(slots: torch.Tensor) -> int:
    """The width the views were allocated with: a row slice of a wider buffer keeps its row
    stride (the engine's eager views are view_slots[:B, :step width], graphs' the full rows)."""
    return max(slots.shape[1], slots.stride(0))


class Plan(NamedTuple):
    config: Config
    splits: int             # attention splits per (request, KV head); 1: `_decode_kernel`
    mass_splits: int        # mass programs per request
    min_tiles: int


def decode_plan(batch: int, heads: int, head_dim: int, kvh: int, slots: torch.Tensor,
                dtype: torch.dtype, device: torch.device,
                num_splits: Optional[int] = None,
                q_dtype: Optional[torch.dtype] = None) -> Plan:
    """Everything decode_attention decides before launching, from shapes only: the same for an
    eager step and the CUDA graph bucket it would replay (tests/test_triton_decode_split.py).
    dtype: the cache's; q_dtype: the queries' (see _config)."""
    cfg = _config(heads // kvh, head_dim, dtype, q_dtype)
    capacity = views_capacity(slots)
    if num_splits:
        return Plan(cfg, num_splits, num_splits, 1)
    return Plan(cfg, num_splits_for(batch, kvh, capacity, cfg.block_n, device),
                num_splits_for(batch, 1, capacity, cfg.mass_block_n, device), MIN_TILES)


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                     lens: torch.Tensor, scale: float, mass: Optional[torch.Tensor] = None,
                     num_splits: Optional[int] = None,
                     kv_scale: Optional[torch.Tensor] = None,
                     sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """See the module docstring; `mass` (float32 [B, >= Lmax], unit stride along keys) is
    accumulated in place. num_splits forces the split count (tests), with splits as even as
    whole tiles allow. kv_scale: an fp8 cache's float32 (k, v, 1/k, 1/v) on its device
    (kv_quant.scale_row(kv_cache) when omitted). sinks: float32 [H] on q's device, or None."""
    b, h, d = q.shape
    kvh = kv_cache.shape[2]
    assert h % kvh == 0 and kv_cache.stride(3) == 1 and q.stride(2) == 1
    assert mass is None or (mass.dtype == torch.float32 and mass.stride(1) == 1)
    assert sinks is None or (sinks.dtype == torch.float32 and sinks.shape == (h,)
                             and sinks.is_contiguous())
    if kv_quant.is_fp8(kv_cache):
        assert not kv_quant.is_fp8(q), "decode_attention: q in an fp8 dtype"
        if kv_scale is None:
            kv_scale = kv_quant.scale_row(kv_cache)
        assert kv_scale.dtype == torch.float32 and kv_scale.numel() >= 2
    else:
        kv_scale = kv_cache       # placeholder pointer: a float cache has no scales
    out = torch.empty_like(q)
    cfg, splits, mass_splits, min_tiles = decode_plan(b, h, d, kvh, slots, kv_cache.dtype,
                                                      q.device, num_splits, q.dtype)
    stats = torch.empty(b, h, 2, dtype=torch.float32, device=q.device) if mass is not None \
        else out   # unused placeholder pointer when no mass is wanted
    sinks_arg = sinks if sinks is not None else out        # placeholder pointer, likewise
    attention = dict(G=h // kvh, D=d, BLOCK_G=cfg.block_g, BLOCK_D=cfg.block_d,
                     num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    kv_strides = (slots.stride(0), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2))
    if splits == 1:
        _decode_kernel[(b, kvh)](
            q, kv_cache, kv_scale, slots, lens, out, stats, sinks_arg, scale, q.stride(0),
            q.stride(1), *kv_strides, BLOCK_N=cfg.block_n, WANT_STATS=mass is not None,
            HAS_SINKS=sinks is not None, **attention)
    else:
        ml = torch.empty(b, h, splits, 2, dtype=torch.float32, device=q.device)
        acc = torch.empty(b, h, splits, d, dtype=torch.float32, device=q.device)
        _split_kernel[(b, kvh, splits)](q, kv_cache, kv_scale, slots, lens, ml, acc, scale,
                                        min_tiles, q.stride(0), q.stride(1), *kv_strides,
                                        BLOCK_N=cfg.block_n, **attention)
        _reduce_kernel[(b, h)](ml, acc, out, stats, sinks_arg, splits, out.stride(0),
                               out.stride(1), D=d, BLOCK_S=REDUCE_CHUNK, BLOCK_D=cfg.block_d,
                               WANT_STATS=mass is not None, HAS_SINKS=sinks is not None,
                               num_warps=cfg.num_warps)
    if mass is not None:
        _mass_kernel[(b, mass_splits)](q, kv_cache, kv_scale, slots, lens, stats, mass, scale,
                                       min_tiles, kvh, q.stride(0), q.stride(1), slots.stride(0),
                                       kv_cache.stride(0), kv_cache.stride(2), mass.stride(0),
                                       BLOCK_N=cfg.mass_block_n, **attention)
    return out
