"""ModelRunner: the one place that turns a scheduler step into model inputs.

Write slots and attention views both come from the token table, never from positions:

    positions     logical ids of this step's tokens (RoPE; they never change)
    slot_mapping  token_table slots of this step's tokens (where their K/V is written)
    views         token_table live slots, in logical order (what attention reads)

The runner is the worker side of the KV plane: it owns the relocation executor, submits the
copies that come with each scheduler output, reports completed batches, and hands the step's
attention statistics back as plain arrays (StepStats).
"""
from dataclasses import dataclass
from typing import List, Optional, Set, Tuple

import numpy as np
import torch

from vllm.attention.backend import AttentionMetadata, PrefillSpan
from vllm.core.reclaim.backend import CopyBatch
from vllm.core.step_stats import ScoreRequest, SeqStepStats, StepStats
from vllm.core.token_table import TokenTable
from vllm.sequence import Sequence
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


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: torch.Tensor, token_table: TokenTable,
                 max_tokens: int, max_seqs: int, max_model_len: int):
        self.model = model
        self.kv_caches = kv_caches
        self.token_table = token_table
        self.translation = TranslationCache(token_table)
        # persistent inputs, rewritten in place every step (what CUDA graph replay needs)
        self.buffers = InputBuffers(max_tokens, max_seqs, max_model_len, kv_caches.device)
        self.relocation: Optional[RelocationExecutor] = None     # set where vToken reclaims

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
                    span.colsum, span.colsum_from = torch.zeros(len(view_ids)), first
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
            meta.decode_mass = torch.zeros(decode_views.shape, dtype=torch.float32)
        return ModelInput(input_ids=input_ids, positions=positions, meta=meta, rows=rows,
                          scores=scores)

    @staticmethod
    def _prefill_span(start: int, n: int, computed: int, view_ids: np.ndarray,
                      view_slots: np.ndarray) -> PrefillSpan:
        mask = None
        if computed > 0 or len(view_ids) != computed + n:
            # query at logical id p sees live keys with id <= p
            q_ids = np.arange(computed, computed + n)
            mask = torch.from_numpy(view_ids[None, :] <= q_ids[:, None])
        return PrefillSpan(start, start + n, torch.from_numpy(view_slots.astype(np.int64)), mask)

    @torch.inference_mode()
    def execute(self, inp: ModelInput) -> torch.Tensor:
        return self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta)

    def step_stats(self, inp: ModelInput) -> StepStats:
        """The step's attention statistics per sequence, as numpy arrays by view position."""
        meta, rows = inp.meta, []
        for r in inp.rows:
            scores = None
            if r.is_decode and meta.decode_mass is not None:
                scores = meta.decode_mass[r.stats_row, :len(r.view_ids)].numpy()
            elif not r.is_decode and meta.prefills[r.stats_row].colsum is not None:
                scores = meta.prefills[r.stats_row].colsum.numpy()
            kind = inp.scores.key_statistic.get(r.seq.seq_id)
            keys = None if kind is None else self._key_statistic(r.view_slots, kind)
            rows.append(SeqStepStats(r.seq, r.num_new, r.is_decode, r.view_ids, scores, keys))
        return StepStats(rows)

    def _key_statistic(self, view_slots: np.ndarray, kind: str) -> np.ndarray:
        """Per view token, mean over layers and KV heads: "norm" ||k||, or "similarity"
        cos(k, anchor) with the anchor the mean of the view's unit keys (KeyDiff)."""
        keys = self.kv_caches[:, torch.from_numpy(view_slots.astype(np.int64)), 0].float()
        norms = keys.norm(dim=-1, keepdim=True)                      # [layers, n, KVH, 1]
        if kind == "norm":
            return norms.mean(dim=(0, 2)).flatten().numpy()
        unit = keys / norms.clamp_min(1e-12)
        anchor = unit.mean(dim=1, keepdim=True)
        anchor = anchor / anchor.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return (unit * anchor).sum(dim=-1).mean(dim=(0, 2)).numpy()
