"""Attention over the paged KV cache, read through each request's attention view. Every kernel
is reached through vllm/kernels/ops.py (the one dispatch point): decode on the C kernel (CPU),
Triton (CUDA) or torch; prefill on xformers or SDPA; the cache write on Triton or torch.

Prefill on CUDA runs the step's spans as one batched call (AttentionMetadata.prefill_batches):
xformers' block-diagonal causal bias for spans without an explicit mask when xformers is
installed; spans with a mask (continued chunks, evicted keys), or every span without xformers,
in one padded SDPA call. On CPU spans run one by one (the tuned path; prefill_path="batched"
runs the batched one, for tests). A layer with attention sinks (gpt-oss) passes them to every
path; its batched prefill is the one padded SDPA call (prefill_batches_torch).

Statistics never change the arithmetic of attention: a span that collects column sums (or a
decode step that collects mass) gets its output from the very call it would get without them,
and the statistics are computed beside it (a tiled second pass over the scored queries), so a
request whose policy has evicted nothing yet produces the tokens of --kv-eviction-policy none.

The KV cache of one layer is a flat array of slots:

    kv_cache[layer]   [num_slots, 2, num_kv_heads, head_dim]     slot = block * block_size + offset
                                 ^ 0 = K, 1 = V (one row holds both, so one gather reads both)

An fp8 cache (--kv-cache-dtype fp8, CPU; vllm/attention/kv_quant.py) holds each value as one
byte, x / scale per layer for K and for V: writes quantize, the C decode kernels dequantize in
registers, the torch paths (prefill, decode fallback) dequantize what they gather.

Attention never derives slots from positions: every request reads through its attention view,
the live slots in logical order that the model runner built from the token table. All metadata
lives on the cache's device.
"""
import functools
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from vllm.kernels import ops
from vllm.attention import kv_quant

QUERY_TILE = 256   # prefill queries per tile when column sums are collected


@dataclass
class PrefillSpan:
    q_start: int
    q_end: int
    kv_slots: torch.Tensor               # [Lk] attention view (includes this chunk's tokens)
    mask: Optional[torch.Tensor]         # [q, Lk] bool (True = attend); None = plain causal
    colsum: Optional[torch.Tensor] = None  # [Lk] float32 += attention of queries >= colsum_from
    colsum_from: int = 0                 # (a policy may score with the last prompt queries only)
    first_id: int = 0                    # logical id of the span's first query
    key_ids: Optional[torch.Tensor] = None   # [Lk] logical ids of the view; None: 0 .. Lk - 1

    def windowed(self, window: int, scores: bool) -> "PrefillSpan":
        """This span as a sliding layer of window W reads it: query p sees the live keys with
        p - W < id <= p. scores: it adds to the same column sums (a model with no full layer)."""
        lk, nq = len(self.kv_slots), self.q_end - self.q_start
        dev = self.kv_slots.device
        ids = self.key_ids if self.key_ids is not None else torch.arange(lk, device=dev)
        q_ids = torch.arange(self.first_id, self.first_id + nq, device=dev)[:, None]
        mask = (ids[None, :] <= q_ids) & (ids[None, :] > q_ids - window)
        return PrefillSpan(self.q_start, self.q_end, self.kv_slots, mask,
                           self.colsum if scores else None, self.colsum_from, self.first_id,
                           self.key_ids)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor           # [T] where each new token's K/V is written
    num_decodes: int                     # the first num_decodes tokens are single-token rows
    decode_views: torch.Tensor           # [B, Lmax] int64 attention views, padding -1
    decode_lens: torch.Tensor            # [B] entries per view row
    prefills: List[PrefillSpan] = field(default_factory=list)
    decode_mass: Optional[torch.Tensor] = None       # [B, Lmax] float32 += probabilities summed
                                                     # over layers and heads; None: not collected
    # [B] leading entries of each decode row's view outside the model's sliding window (the
    # engine counts them from the token table); None: the views have no holes (timing steps)
    window_skip: Optional[torch.Tensor] = None
    # a hybrid model's sliding subgroups (layers/attention.py KVGroups): what subgroup k + 1's
    # layers read (their own slots and views over the window); None: one KV group
    sliding: Optional[List["AttentionMetadata"]] = None
    _windowed: dict = field(default_factory=dict, repr=False)   # (W, scores) -> metadata
    _window_mass: list = field(default_factory=list, repr=False)  # (mass, column index) to fold

    def for_layer(self, window: Optional[int], scores: bool,
                  group: int = 0) -> "AttentionMetadata":
        """What a layer with this sliding window (None: full attention) reads; scores: whether
        its attention adds to the eviction statistics; group: its KV group (k >= 1: sliding
        subgroup k of a hybrid model, which reads its own blocks). Built once per step."""
        if group and self.sliding is not None:
            return self.sliding[group - 1]
        if window is None:
            assert scores, "full-attention layers always feed the statistics"
            return self
        key = (window, scores)
        if key not in self._windowed:
            self._windowed[key] = self._windowed_meta(window, scores)
        return self._windowed[key]

    def _windowed_meta(self, window: int, scores: bool) -> "AttentionMetadata":
        """Decode rows read the last entries of their views: row i drops its first skip[i]
        (keys at or before its position - W), keeping at most W:

            views [[5, 9, 7, 4], [8, 3, -1, -1]], lens [4, 2], W 2, skip [2, 0]
            -> [[7, 4], [8, 3]], lens [2, 2]
        """
        views, lens = self.decode_views, self.decode_lens
        width = max(min(window, views.shape[1]), 1)
        skip = self.window_skip
        if skip is None:
            skip = (lens - window).clamp(min=0)
        cols = torch.arange(width, device=views.device)
        idx = (skip[:, None] + cols).clamp(max=max(views.shape[1] - 1, 0))
        win_lens = lens - skip
        valid = cols[None, :] < win_lens[:, None]
        win_views = torch.where(valid, views.gather(1, idx), -1) if views.numel() else \
            views.new_full((views.shape[0], width), -1)
        mass = None
        if scores and self.decode_mass is not None:
            mass = torch.zeros(win_views.shape, dtype=torch.float32, device=views.device)
            self._window_mass.append((mass, idx))
        return AttentionMetadata(
            slot_mapping=self.slot_mapping, num_decodes=self.num_decodes, decode_views=win_views,
            decode_lens=win_lens, prefills=[s.windowed(window, scores) for s in self.prefills],
            decode_mass=mass)

    def fold_window_mass(self) -> None:
        """After the forward: the sliding layers' decode mass into decode_mass, by view
        position (a model with no full-attention layer scores from them)."""
        for mass, idx in self._window_mass:
            self.decode_mass.scatter_add_(1, idx, mass)
        self._window_mass.clear()

    # The torch path's form of the views, derived once per step on first use (see
    # ops.torch_decode_view): [[5, 9], [7, -1]] -> gather [[5, 9], [7, 0]], bias [[0, 0], [0, -inf]]
    @functools.cached_property
    def decode_torch_view(self):
        return ops.torch_decode_view(self.decode_views)

    @functools.cached_property
    def prefill_batches(self) -> List[ops.PrefillBatch]:
        """The spans as at most two batched calls, built on first use (all layers share them):
        xformers takes the plain-causal spans, padded SDPA the rest."""
        spans = self.prefills
        if not spans or ops.prefill_backend(spans[0].kv_slots.device) != "xformers":
            return self.prefill_batches_torch
        groups = {"xformers": [s for s in spans if s.mask is None],
                  "torch": [s for s in spans if s.mask is not None]}
        return [_batch(g, backend) for backend, g in groups.items() if g]

    @functools.cached_property
    def prefill_batches_torch(self) -> List[ops.PrefillBatch]:
        """Every span in one padded SDPA call: what layers with sinks read (xformers' packed
        batch has no sink key)."""
        return [_batch(self.prefills, "torch")] if self.prefills else []

    @property
    def decode_slots(self) -> torch.Tensor:          # [B, Lmax], padding read as slot 0
        return self.decode_torch_view[0]

    @property
    def decode_bias(self) -> torch.Tensor:           # [B, 1, 1, Lmax] 0 real key, -inf padding
        return self.decode_torch_view[1]


def _batch(spans: List[PrefillSpan], backend: str) -> ops.PrefillBatch:
    return ops.prefill_batch([(s.q_start, s.q_end) for s in spans], [s.kv_slots for s in spans],
                             [s.mask for s in spans], backend)


write_kv = ops.write_kv      # the model's cache write, beside the attention that reads it


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, decode_path: Optional[str] = None,
                    prefill_path: Optional[str] = None,
                    sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [T, H, D] for this step's tokens -> [T, H, D]; their K/V are already in the cache at
    meta.slot_mapping (write_kv, or the C rotary kernel that writes them). decode_path "torch"
    keeps decode rows off the C kernel (a model's KernelPlan where torch is faster).
    prefill_path "span" or "batched"; default batched on CUDA, span by span on CPU.
    sinks: float32 [H] on q's device, this rank's query heads' learned sink logits (gpt-oss:
    one more softmax term with no value; ops' module docstring), or None."""
    assert sinks is None or (sinks.dtype == torch.float32 and sinks.shape == q.shape[1:2]
                             and sinks.device == q.device), "sinks: float32 [H] on q's device"
    out = torch.empty_like(q)
    b = meta.num_decodes
    if b:
        out[:b] = _decode(q[:b], kv_cache, meta, scale, decode_path, sinks)
    batched = (prefill_path or ("batched" if q.is_cuda else "span")) == "batched"
    for span in meta.prefills:
        if batched and span.colsum is None:
            continue
        kv = kv_quant.gather(kv_cache, span.kv_slots, q.dtype)   # [Lk, 2, KVH, D] (fp8: widened)
        qs = q[span.q_start:span.q_end]
        if not batched:
            out[span.q_start:span.q_end] = _prefill(qs, kv, span.mask, scale, sinks)
        if span.colsum is not None:
            _add_colsum(qs, kv, span, scale, sinks)
    if batched:
        for batch in meta.prefill_batches if sinks is None else meta.prefill_batches_torch:
            kv = kv_quant.gather(kv_cache, batch.kv_slots, q.dtype)     # every span's K/V, one gather
            out.index_copy_(0, batch.q_rows,
                            ops.prefill_attention_batched(q, kv, batch, scale, sinks))
    return out


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
            scale: float, path: Optional[str] = None,
            sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    which = "torch" if path == "torch" else ops.decode_backend(q)
    view = meta.decode_torch_view if which == "torch" else None
    return ops.decode_attention(q, kv_cache, meta.decode_views, meta.decode_lens, scale,
                                meta.decode_mass, backend=which, torch_view=view, sinks=sinks)


def _prefill(q: torch.Tensor, kv: torch.Tensor, mask: Optional[torch.Tensor],
             scale: float, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [q, H, D] against a span's gathered kv [Lk, 2, KVH, D] -> [q, H, D]."""
    k = kv[:, 0].transpose(0, 1)                     # [KVH, Lk, D]
    v = kv[:, 1].transpose(0, 1)
    return ops.prefill_attention(q.transpose(0, 1), k, v, mask, scale,
                                 sinks=sinks).transpose(0, 1)


def _add_colsum(q: torch.Tensor, kv: torch.Tensor, span: PrefillSpan, scale: float,
                sinks: Optional[torch.Tensor] = None) -> None:
    """span.colsum += the attention probabilities of its queries from span.colsum_from on,
    summed over queries and heads: tiled over queries, O(tile * Lk) memory per head, never the
    full Lq x Lk matrix. Beside the attention call, never instead of it. With sinks they are
    the real keys' probabilities (the sink in each denominator): a query's row sums to < 1."""
    lq, h, d = q.shape
    lk, kvh = kv.shape[0], kv.shape[2]
    first = min(span.colsum_from, lq)
    qg = q[first:].transpose(0, 1).reshape(kvh, h // kvh, lq - first, d)
    kt = kv[:, 0].permute(1, 2, 0).unsqueeze(1)      # [KVH, 1, D, Lk]
    mask = span.mask
    if mask is None:   # plain causal: query i sees keys 0..i + (Lk - Lq)
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    sink = None if sinks is None else sinks.view(kvh, h // kvh, 1, 1)
    for s in range(0, lq - first, QUERY_TILE):
        e = min(s + QUERY_TILE, lq - first)
        scores = torch.matmul(qg[:, :, s:e].float(), kt.float()) * scale
        scores.masked_fill_(~mask[first + s:first + e], float("-inf"))
        span.colsum += ops.sink_softmax(scores, sink).sum(dim=(0, 1, 2))
