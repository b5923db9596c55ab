"""ModelRunner: the one place that turns a scheduler step into model inputs.

Write slots and attention views both come from the token table, never from positions:

    positions     logical ids of this step's tokens (RoPE; they never change)
    slot_mapping  token_table slots of this step's tokens (where their K/V is written)
    views         token_table live slots, in logical order (what attention reads)

The runner is the worker side of the KV plane: it owns the relocation executor, submits the
copies that come with each scheduler output, reports completed batches, and hands the step's
attention statistics back as plain arrays (StepStats).

All metadata is built on the cache's device. On CUDA nothing here waits for the device: uploads
are non-blocking copies from pinned memory, and the step's attention statistics (decode mass,
prefill column sums) travel back in one non-blocking copy that execute() starts and
step_stats() reads after the sampler's token read has synchronized.
"""
from dataclasses import dataclass
from typing import List, Optional, Set, Tuple, Union

import numpy as np
import torch

from vllm._custom_ops import to_device
from vllm.attention.backend import AttentionMetadata, PrefillSpan
from vllm.core.reclaim.backend import CopyBatch
from vllm.core.step_stats import ScoreRequest, SeqStepStats, StepStats
from vllm.core.token_table import TokenTable
from vllm.sequence import Sequence
from vllm.worker.cuda_graph_runner import CudaGraphRunner
from vllm.worker.input_buffers import InputBuffers
from vllm.worker.relocation import RelocationExecutor
from vllm.worker.translation_cache import TranslationCache


@dataclass
class StepRow:
    seq: Sequence
    num_new: int
    start: int                 # first index of this sequence's tokens in the flat batch
    view_ids: np.ndarray       # logical ids of its attention view (aligned with the statistics)
    view_slots: np.ndarray     # their slots
    stats_row: int             # row in decode_mass (decodes) or index into prefill_colsum
    is_decode: bool

    @property
    def completes(self) -> bool:
        """After this step every known token is computed, so the next token gets sampled."""
        return self.seq.num_computed_tokens + self.num_new == self.seq.num_tokens


@dataclass
class ModelInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    rows: List[StepRow]
    scores: ScoreRequest
    host_stats: Optional[Tuple[torch.Tensor, torch.cuda.Event]] = None  # CUDA: pinned copy


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: torch.Tensor, token_table: TokenTable,
                 max_tokens: int, max_seqs: int, max_model_len: int):
        self.model = model
        self.kv_caches = kv_caches
        self.device = kv_caches.device
        self.token_table = token_table
        self.translation = TranslationCache(token_table)
        # persistent inputs, rewritten in place every step (what CUDA graph replay needs)
        self.buffers = InputBuffers(max_tokens, max_seqs, max_model_len, kv_caches.device)
        self.relocation: Optional[RelocationExecutor] = None     # set where vToken reclaims
        self.graphs: Optional[CudaGraphRunner] = None    # decode-only steps (CUDA, not eager)

    # ---- relocation copies (with the scheduler output) ----------------------------------------
    def relocate(self, copies: Optional[CopyBatch]) -> Set[int]:
        """This step's copies -> ids of batches completed since the last call (see
        RelocationExecutor.execute); nothing where vToken does not reclaim."""
        return set() if self.relocation is None else self.relocation.execute(copies)

    # ---- model step ---------------------------------------------------------------------------
    def prepare_inputs(self, scheduled: List[Tuple[Sequence, int]],
                       scores: Optional[ScoreRequest] = None) -> ModelInput:
        scores = scores or ScoreRequest()
        tt = self.token_table
        if len(self.translation) > len(scheduled):
            self.translation.retain(s.seq_id for s, _ in scheduled)
        # Single-token rows first: they share one padded, batched attention call.
        decodes = [(s, n) for s, n in scheduled if n == 1]
        prefills = [(s, n) for s, n in scheduled if n > 1]
        ids, pos, slots, rows, views = [], [], [], [], []
        prefill_spans: List[PrefillSpan] = []
        start = 0
        for i, (seq, n) in enumerate(decodes + prefills):
            c = seq.num_computed_tokens
            ids.append(seq.token_ids[c:c + n])
            pos.append(np.arange(c, c + n))
            slots.append(tt.slots(seq.seq_id, c, c + n))
            view_ids, view_slots = self.translation.view(seq.seq_id)
            is_decode = i < len(decodes)
            if is_decode:
                views.append(view_slots)
            else:
                span = self._prefill_span(start, n, c, view_ids, view_slots)
                first = scores.prefill_from.get(seq.seq_id)
                if first is not None:
                    span.colsum = torch.zeros(len(view_ids), device=self.device)
                    span.colsum_from = first
                prefill_spans.append(span)
            stats_row = i if is_decode else len(prefill_spans) - 1
            rows.append(StepRow(seq, n, start, view_ids, view_slots, stats_row, is_decode))
            start += n
        self.buffers.update(np.fromiter((t for r in ids for t in r), np.int64, start),
                            np.concatenate(pos), np.concatenate(slots), views)
        input_ids, positions, slot_mapping, decode_views, view_lens = self.buffers.step_inputs()
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, num_decodes=len(decodes), decode_views=decode_views,
            decode_lens=view_lens, prefills=prefill_spans)
        # a one-token prompt chunk runs as a decode row: its scores come from the decode mass
        if decodes and (scores.decode or any(s.seq_id in scores.prefill_from for s, _ in decodes)):
            meta.decode_mass = torch.zeros(decode_views.shape, dtype=torch.float32,
                                           device=self.device)
        return ModelInput(input_ids=input_ids, positions=positions, meta=meta, rows=rows,
                          scores=scores)

    def _prefill_span(self, start: int, n: int, computed: int, view_ids: np.ndarray,
                      view_slots: np.ndarray) -> PrefillSpan:
        slots = to_device(view_slots.astype(np.int64, copy=False), self.device)
        mask = None
        if computed > 0 or len(view_ids) != computed + n:
            # query at logical id p sees live keys with id <= p
            ids = to_device(view_ids.astype(np.int64, copy=False), self.device)
            q_ids = torch.arange(computed, computed + n, device=self.device)
            mask = ids[None, :] <= q_ids[:, None]
        return PrefillSpan(start, start + n, slots, mask)

    def logits_rows(self, rows: List[StepRow]) -> Union[torch.Tensor, slice]:
        """Each row's last token's index in the flat batch (whose hidden state is sampled); in
        a decode-only step those are the first len(rows) tokens: a slice, no gather."""
        last = [r.start + r.num_new - 1 for r in rows]
        if last == list(range(len(last))):
            return slice(0, len(last))
        return to_device(np.array(last, dtype=np.int64), self.device)

    @torch.inference_mode()
    def execute(self, inp: ModelInput) -> torch.Tensor:
        if self.graphs is not None and self.graphs.accepts(inp):
            hidden = self.graphs.run(inp, self.relocation)
        else:
            hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta)
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
        done.synchronize()             # already complete where the sampler read its tokens
        flat, at, mass, colsums = host.numpy(), 0, None, []
        if meta.decode_mass is not None:      # same order as _start_stats_copy
            at = meta.decode_mass.numel()
            mass = flat[:at].reshape(meta.decode_mass.shape)
        for s in meta.prefills:
            n = 0 if s.colsum is None else s.colsum.numel()
            colsums.append(None if s.colsum is None else flat[at:at + n])
            at += n
        return mass, colsums

    def step_stats(self, inp: ModelInput) -> StepStats:
        """The step's attention statistics per sequence, as numpy arrays by view position."""
        mass, colsums = self._host_stats(inp)
        rows = []
        for r in inp.rows:
            scores = None
            if r.is_decode and mass is not None:
                scores = mass[r.stats_row, :len(r.view_ids)]
            elif not r.is_decode:
                scores = colsums[r.stats_row]
            kind = inp.scores.key_statistic.get(r.seq.seq_id)
            keys = None if kind is None else self._key_statistic(r.view_slots, kind)
            rows.append(SeqStepStats(r.seq, r.num_new, r.is_decode, r.view_ids, scores, keys))
        return StepStats(rows)

    def _key_statistic(self, view_slots: np.ndarray, kind: str) -> np.ndarray:
        """Per view token, mean over layers and KV heads: "norm" ||k||, or "similarity"
        cos(k, anchor) with the anchor the mean of the view's unit keys (KeyDiff)."""
        slots = to_device(view_slots.astype(np.int64, copy=False), self.device)
        keys = self.kv_caches[:, slots, 0].float()
        norms = keys.norm(dim=-1, keepdim=True)                      # [layers, n, KVH, 1]
        if kind == "norm":
            return norms.mean(dim=(0, 2)).flatten().cpu().numpy()
        unit = keys / norms.clamp_min(1e-12)
        anchor = unit.mean(dim=1, keepdim=True)
        anchor = anchor / anchor.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return (unit * anchor).sum(dim=-1).mean(dim=(0, 2)).cpu().numpy()


@torch.inference_mode()
def profile_forward(model: torch.nn.Module, num_tokens: int, max_model_len: int,
                    num_seqs: int) -> int:
    """The largest step the scheduler can send (num_tokens prompt tokens, in sequences of at most
    max_model_len; once plain, once collecting column sums as an evicting request does), then
    logits for num_seqs rows, on a scratch cache of exactly those tokens: what sizing the KV pool
    measures the peak memory of. Returns the scratch cache's bytes (the pool is not an
    activation)."""
    cfg, dev = model.config, model.embed.device
    kv = torch.zeros(cfg.num_hidden_layers, num_tokens, 2, cfg.num_key_value_heads, cfg.head_dim,
                     dtype=model.embed.dtype, device=dev)
    starts = range(0, num_tokens, max_model_len)
    ends = [min(s + max_model_len, num_tokens) for s in starts]
    positions = torch.cat([torch.arange(e - s, device=dev) for s, e in zip(starts, ends)])
    for colsum in (False, True):
        spans = [PrefillSpan(s, e, torch.arange(s, e, device=dev), None,
                             torch.zeros(e - s, device=dev) if colsum else None)
                 for s, e in zip(starts, ends)]
        meta = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, device=dev), num_decodes=0,
            decode_views=torch.full((0, 1), -1, dtype=torch.int64, device=dev),
            decode_lens=torch.zeros(0, dtype=torch.int64, device=dev), prefills=spans)
        hidden = model(torch.zeros(num_tokens, dtype=torch.int64, device=dev), positions, kv,
                       meta)
        torch.softmax(model.compute_logits(hidden[:num_seqs]), dim=-1)
    return kv.numel() * kv.element_size()
