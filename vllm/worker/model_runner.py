"""ModelRunner: the one place that turns a step input into model inputs, on one rank.

The StepInput (worker/step_input.py) carries this step's tokens, positions and write slots, and
each row's attention view as a delta that the runner's ViewStore applies. The runner lays them
into the persistent InputBuffers (decode rows) and PrefillSpans (prompt chunks), runs the model,
computes the logits the engine asked for and hands the step's attention statistics back as
plain arrays (RowStats).

All metadata is built on the cache's device. On CUDA nothing here waits for the device: uploads
are non-blocking copies from pinned memory, and the step's attention statistics (decode mass,
prefill column sums) travel back in one non-blocking copy that execute() starts and
step_stats() reads.
"""
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch

from vllm.kernels.ops import to_device
from vllm.attention import kv_quant
from vllm.attention.backend import AttentionMetadata, PrefillSpan
from vllm.worker.cuda_graph_runner import CudaGraphRunner
from vllm.worker.input_buffers import InputBuffers
from vllm.worker.relocation import RelocationExecutor
from vllm.worker.step_input import KEY_STATISTICS, NO_COLUMN_SUMS, StepInput, needs_mask
from vllm.worker.step_output import RowStats
from vllm.worker.view_store import ViewStore


@dataclass
class ModelInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    step: StepInput
    views: List[np.ndarray]    # each row's attention view (slots), in row order
    host_stats: Optional[Tuple[torch.Tensor, torch.cuda.Event]] = None  # CUDA: pinned copy


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: torch.Tensor, max_tokens: int,
                 max_seqs: int, max_model_len: int, window: Optional[int] = None):
        """window: the sliding window of a hybrid model's sliding subgroups (their views are
        built from StepInput.sliding_*), else None."""
        self.model = model
        self.window = window
        self.kv_caches = kv_caches
        self.device = kv_caches.device
        self.views = ViewStore()
        # persistent inputs, rewritten in place every step (what CUDA graph replay needs)
        self.buffers = InputBuffers(max_tokens, max_seqs, max_model_len, kv_caches.device)
        self.graphs: Optional[CudaGraphRunner] = None    # decode-only steps (CUDA, not eager)

    # ---- model step ---------------------------------------------------------------------------
    def prepare_inputs(self, step: StepInput) -> ModelInput:
        views = self.views.update(step)
        b = step.num_decodes
        drop_lens = step.view_drop_lens[:b]
        self.buffers.update(step.input_ids, step.positions, step.slot_mapping, views[:b],
                            step.view_handles[:b], step.view_keep[:b], drop_lens,
                            step.view_drops[:int(drop_lens.sum())])
        input_ids, positions, slot_mapping, decode_views, view_lens = self.buffers.step_inputs()
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, num_decodes=b, decode_views=decode_views,
            decode_lens=view_lens, prefills=self._prefill_spans(step, views[b:]))
        if step.decode_mass:
            meta.decode_mass = torch.zeros(decode_views.shape, dtype=torch.float32,
                                           device=self.device)
        if len(step.window_skip):
            meta.window_skip = to_device(step.window_skip, self.device)
        if step.sliding_views.size:
            meta.sliding = self._sliding_metas(step)
        return ModelInput(input_ids=input_ids, positions=positions, meta=meta, step=step,
                          views=views)

    def _prefill_spans(self, step: StepInput, views: List[np.ndarray]) -> List[PrefillSpan]:
        b, spans = step.num_decodes, []
        if not views:
            return spans
        starts = np.cumsum(step.num_new) - step.num_new
        masked = 0                   # next unread entry of step.mask_view_ids
        for j, slots in enumerate(views):
            start, n = int(starts[b + j]), int(step.num_new[b + j])
            computed = int(step.positions[start])     # a chunk's first logical id
            ids = None
            if needs_mask(computed, n, len(slots)):
                ids = step.mask_view_ids[masked:masked + len(slots)]
                masked += len(slots)
            span = self._prefill_span(start, n, computed, ids, slots)
            first = int(step.colsum_from[j])
            if first != NO_COLUMN_SUMS:
                span.colsum = torch.zeros(len(slots), device=self.device)
                span.colsum_from = first
            spans.append(span)
        return spans

    def _prefill_span(self, start: int, n: int, computed: int, view_ids: Optional[np.ndarray],
                      view_slots: np.ndarray) -> PrefillSpan:
        """view_ids are read only where needs_mask()."""
        slots = to_device(view_slots.astype(np.int64, copy=False), self.device)
        mask = ids = None
        if needs_mask(computed, n, len(view_slots)):
            # query at logical id p sees live keys with id <= p
            ids = to_device(view_ids.astype(np.int64, copy=False), self.device)
            q_ids = torch.arange(computed, computed + n, device=self.device)
            mask = ids[None, :] <= q_ids[:, None]
        return PrefillSpan(start, start + n, slots, mask, first_id=computed, key_ids=ids)

    def _sliding_metas(self, step: StepInput) -> List[AttentionMetadata]:
        """Per sliding subgroup, its metadata: the new tokens' slots in its blocks, decode rows'
        views over their windows ([B, Wmax], -1 padded), prompt chunks' spans masked to the
        window on logical ids (the views are contiguous ids from sliding_first)."""
        lens, first, b = step.sliding_lens, step.sliding_first, step.num_decodes
        starts = np.cumsum(lens) - lens
        width = max(int(lens[:b].max()) if b else 1, 1)
        cols = np.arange(width)
        valid = cols[None, :] < lens[:b, None]
        at = np.where(valid, starts[:b, None] + cols[None, :], 0)
        tok_starts = np.cumsum(step.num_new) - step.num_new
        dev, metas = self.device, []
        for k in range(step.sliding_views.shape[1]):
            views = np.ascontiguousarray(step.sliding_views[:, k])
            spans = []
            for j in range(b, step.num_rows):
                s0, n = int(tok_starts[j]), int(step.num_new[j])
                lo, ln = int(first[j]), int(lens[j])
                span = PrefillSpan(s0, s0 + n, to_device(views[starts[j]:starts[j] + ln], dev),
                                   None, first_id=int(step.positions[s0]),
                                   key_ids=torch.arange(lo, lo + ln, device=dev))
                spans.append(span.windowed(self.window, scores=False))
            metas.append(AttentionMetadata(
                slot_mapping=to_device(np.ascontiguousarray(step.sliding_slot_mapping[:, k]),
                                       dev),
                num_decodes=b, decode_views=to_device(np.where(valid, views[at], -1), dev),
                decode_lens=to_device(np.ascontiguousarray(lens[:b]), dev), prefills=spans))
        return metas

    def compute_logits(self, hidden: torch.Tensor, step: StepInput):
        """-> (logits of step.sample_indices, logits of step.prompt_logit_spans or None). In a
        decode-only step the sampled rows are the first ones: a slice, no gather. With tensor
        parallelism every rank computes its vocabulary shard and only rank 0 gets logits."""
        idx, logits, prompt = step.sample_indices, None, None
        if len(idx):
            rows = slice(0, len(idx)) if idx[-1] == len(idx) - 1 else to_device(idx, self.device)
            logits = self.model.compute_logits(hidden[rows])
        if len(step.prompt_logit_spans):   # span by span, as a request's own chunk would be
            spans = [self.model.compute_logits(hidden[s:s + n])
                     for s, n in step.prompt_logit_spans.tolist()]
            prompt = torch.cat(spans) if spans[0] is not None else None
        return logits, prompt

    @torch.inference_mode()
    def execute(self, inp: ModelInput,
                relocation: Optional[RelocationExecutor] = None) -> torch.Tensor:
        if self.graphs is not None and self.graphs.accepts(inp):
            hidden = self.graphs.run(inp, relocation)
        else:
            hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta)
            inp.meta.fold_window_mass()
        if self.device.type == "cuda":
            inp.host_stats = self._start_stats_copy(inp.meta)
        return hidden

    @staticmethod
    def _start_stats_copy(meta: AttentionMetadata):
        """One non-blocking copy of the step's decode mass and column sums into pinned memory."""
        parts = [meta.decode_mass] if meta.decode_mass is not None else []
        parts += [s.colsum for s in meta.prefills if s.colsum is not None]
        if not parts:
            return None
        flat = torch.cat([p.reshape(-1) for p in parts])
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done

    def _host_stats(self, inp: ModelInput):
        """(decode mass [B, Lmax] or None, per prefill span its column sums or None), numpy."""
        meta = inp.meta
        if inp.host_stats is None:     # CPU (or nothing collected): the tensors are host memory
            mass = None if meta.decode_mass is None else meta.decode_mass.numpy()
            return mass, [None if s.colsum is None else s.colsum.numpy() for s in meta.prefills]
        host, done = inp.host_stats
        done.synchronize()             # the step's forward has finished: its one host sync
        flat, at, mass, colsums = host.numpy(), 0, None, []
        if meta.decode_mass is not None:      # same order as _start_stats_copy
            at = meta.decode_mass.numel()
            mass = flat[:at].reshape(meta.decode_mass.shape)
        for s in meta.prefills:
            n = 0 if s.colsum is None else s.colsum.numel()
            colsums.append(None if s.colsum is None else flat[at:at + n])
            at += n
        return mass, colsums

    def step_stats(self, inp: ModelInput) -> List[RowStats]:
        """The step's attention statistics per row, as numpy arrays by view position."""
        mass, colsums = self._host_stats(inp)
        step, b, rows = inp.step, inp.step.num_decodes, []
        for i, (view, code) in enumerate(zip(inp.views, step.key_statistic.tolist())):
            scores = None
            if i < b and mass is not None:
                scores = mass[i, :len(view)]
            elif i >= b:
                scores = colsums[i - b]
            keys = self._key_statistic(view, KEY_STATISTICS[code - 1]) if code else None
            rows.append(RowStats(scores, keys))
        return rows

    def _key_statistic(self, view_slots: np.ndarray, kind: str) -> np.ndarray:
        """Per view token, mean over layers and KV heads: "norm" ||k||, "similarity" cos(k, anchor)
        with the anchor the mean of the view's unit keys (KeyDiff), or "value_norm" ||v||. A model
        with synthetic statistics (--load-format simulate) gives its own."""
        slots = to_device(view_slots.astype(np.int64, copy=False), self.device)
        synthetic = getattr(self.model, "synthetic_key_statistic", None)
        if synthetic is not None:
            return synthetic(self.kv_caches, slots, kind)
        kv = 1 if kind == "value_norm" else 0                        # V or K
        x = self.kv_caches[:, slots, kv].float()                     # [layers, n, KVH, D]
        if kv_quant.is_fp8(self.kv_caches):     # dequantized: each layer's K (or V) scale
            x *= kv_quant.scales_of(self.kv_caches)[:, kv].to(x.device).view(-1, 1, 1, 1)
        norms = x.norm(dim=-1, keepdim=True)                         # [layers, n, KVH, 1]
        if kind != "similarity":
            return norms.mean(dim=(0, 2)).flatten().cpu().numpy()
        unit = x / norms.clamp_min(1e-12)
        anchor = unit.mean(dim=1, keepdim=True)
        anchor = anchor / anchor.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return (unit * anchor).sum(dim=-1).mean(dim=(0, 2)).cpu().numpy()


@torch.inference_mode()
def profile_forward(model: torch.nn.Module, num_tokens: int, max_model_len: int,
                    num_seqs: int) -> int:
    """The largest steps the scheduler can send, then logits for num_seqs rows, on a scratch
    cache: what sizing the KV pool measures the peak memory of. Returns the scratch cache's bytes
    (the pool is not an activation). Two kinds of step, each once plain and once collecting column
    sums as an evicting request does:

        first chunks     num_tokens prompt tokens in spans of at most max_model_len (causal)
        continued chunk  q = min(num_tokens, max_model_len) queries at the end of a view of
                         max_model_len keys (masked: a later chunk of a long prompt builds
                         [q, max_model_len] per-layer buffers), the other num_tokens - q tokens
                         as first chunks

    The scratch cache holds max(num_tokens, max_model_len + num_tokens - q) slots."""
    cfg, dev = model.config, model.embed.device
    q = min(num_tokens, max_model_len)
    kv = torch.zeros(cfg.num_hidden_layers, max(num_tokens, max_model_len + num_tokens - q), 2,
                     model.num_kv_heads, cfg.head_dim, dtype=model.embed.dtype, device=dev)
    for step in profile_steps(num_tokens, max_model_len, dev):
        for colsum in (False, True):
            spans = [PrefillSpan(s.q_start, s.q_end, s.kv_slots, s.mask,
                                 torch.zeros(len(s.kv_slots), device=dev) if colsum else None)
                     for s in step["spans"]]
            meta = AttentionMetadata(
                slot_mapping=step["slot_mapping"], num_decodes=0,
                decode_views=torch.full((0, 1), -1, dtype=torch.int64, device=dev),
                decode_lens=torch.zeros(0, dtype=torch.int64, device=dev), prefills=spans)
            hidden = model(torch.zeros(num_tokens, dtype=torch.int64, device=dev),
                           step["positions"], kv, meta)
            torch.softmax(model.compute_logits(hidden[:num_seqs]), dim=-1)
            del hidden, meta, spans
    return kv.numel() * kv.element_size()


def profile_steps(num_tokens: int, max_model_len: int, dev) -> List[dict]:
    """profile_forward's steps (see there): each {"spans", "positions", "slot_mapping"}."""
    def first_chunks(lo: int, n: int, slot0: int):
        starts = range(lo, lo + n, max_model_len)
        ends = [min(s + max_model_len, lo + n) for s in starts]
        spans = [PrefillSpan(s, e, torch.arange(slot0 + s - lo, slot0 + e - lo, device=dev), None)
                 for s, e in zip(starts, ends)]
        pos = [torch.arange(e - s, device=dev) for s, e in zip(starts, ends)]
        return spans, pos

    spans, pos = first_chunks(0, num_tokens, 0)
    steps = [{"spans": spans, "positions": torch.cat(pos),
              "slot_mapping": torch.arange(num_tokens, device=dev)}]
    q = min(num_tokens, max_model_len)
    computed = max_model_len - q                  # the chunk's first logical id
    view = torch.arange(max_model_len, device=dev)
    q_ids = torch.arange(computed, max_model_len, device=dev)
    mask = view[None, :] <= q_ids[:, None]        # [q, max_model_len], as _prefill_span builds
    rest_spans, rest_pos = first_chunks(q, num_tokens - q, max_model_len)
    steps.append({"spans": [PrefillSpan(0, q, view, mask)] + rest_spans,
                  "positions": torch.cat([q_ids] + rest_pos),
                  "slot_mapping": torch.cat([torch.arange(computed, max_model_len, device=dev),
                                             torch.arange(max_model_len,
                                                          max_model_len + num_tokens - q,
                                                          device=dev)])})
    return steps
