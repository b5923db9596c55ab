"""StepInputBuilder: the engine side of the worker boundary.

It turns a scheduler output into the step's StepInput (plain arrays that every rank receives,
worker/step_input.py) and keeps, per row, what the engine needs to read the StepOutput back
(StepRow: the sequence, where its tokens lie in the flat batch, its view's logical ids). Write
slots and attention views both come from the token table, never from positions:

    positions     logical ids of this step's tokens (RoPE; they never change)
    slot_mapping  token_table slots of this step's tokens (where their K/V is written)
    views         token_table live slots, in logical order (what attention reads)

It owns the TranslationCache, so it knows how each view changed since the previous step: views
travel as deltas (evicted positions, the new tokens' slots), new ones whole.
"""
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

from vllm.core.sliding_window_blocks import SlidingWindowBlocks
from vllm.core.step_stats import ScoreRequest, SeqStepStats, StepStats
from vllm.core.token_table import TokenTable
from vllm.engine.translation_cache import TranslationCache
from vllm.sequence import Sequence
from vllm.worker.step_input import (KEY_STATISTICS, NO_COLUMN_SUMS, CopyBatch, StepInput,
                                    needs_mask)
from vllm.worker.step_output import StepOutput

_KEY_CODE = {kind: i + 1 for i, kind in enumerate(KEY_STATISTICS)}


@dataclass
class StepRow:
    seq: Sequence
    num_new: int
    start: int                   # first index of this sequence's tokens in the flat batch
    view_ids: np.ndarray         # logical ids of its attention view (aligned with the statistics)
    is_decode: bool
    prompt_logits: Optional[slice] = None   # its rows of StepOutput.prompt_logits

    @property
    def completes(self) -> bool:
        """After this step every known token is computed, so the next token gets sampled."""
        return self.seq.num_computed_tokens + self.num_new == self.seq.num_tokens


def prompt_logit_count(seq: Sequence, num_new: int) -> int:
    """Positions of this chunk whose logits give a prompt token's logprob (prompt_logprobs)."""
    if seq.params.prompt_logprobs is None or (seq.prompt_logprobs is not None and
                                              len(seq.prompt_logprobs) >= seq.num_prompt_tokens):
        return 0
    c = seq.num_computed_tokens
    return max(min(c + num_new, seq.num_prompt_tokens - 1) - c, 0)


class _Columns:
    """The step input's columns while rows are added (lists; arrays once, at the end)."""

    def __init__(self):
        self.ids, self.pos, self.slots, self.num_new = [], [], [], []
        self.handles, self.keep, self.new, self.drops = [], [], [], []
        self.mask_ids, self.colsum_from, self.keys = [], [], []
        self.sample, self.prompt_spans = [], []
        self.start = self.prompt_at = 0

    def step_input(self, num_decodes: int, decode_mass: bool,
                   copies: Optional[CopyBatch]) -> StepInput:
        return StepInput(
            input_ids=np.array(self.ids, np.int64), positions=_concat(self.pos),
            slot_mapping=_concat(self.slots), num_new=np.array(self.num_new, np.int64),
            num_decodes=num_decodes, view_handles=np.array(self.handles, np.int64),
            view_keep=np.array(self.keep, np.int64),
            view_new_lens=np.fromiter((len(v) for v in self.new), np.int64, len(self.new)),
            view_new_slots=_concat(self.new), mask_view_ids=_concat(self.mask_ids),
            view_drop_lens=np.fromiter((len(d) for d in self.drops), np.int64, len(self.drops)),
            view_drops=_concat(self.drops),
            decode_mass=decode_mass, colsum_from=_ints(self.colsum_from),
            key_statistic=np.array(self.keys, np.int8), sample_indices=_ints(self.sample),
            prompt_logit_spans=_ints(self.prompt_spans).reshape(-1, 2), copies=copies)


class StepInputBuilder:
    def __init__(self, token_table: TokenTable, window: Optional[int] = None,
                 sliding: Optional[SlidingWindowBlocks] = None):
        """window: the model's sliding window (layers/attention.py); sliding: a hybrid model's
        sliding-window blocks (then its sliding layers read those, not the token table's)."""
        self.token_table = token_table
        self.translation = TranslationCache(token_table)
        self.window = window
        self.sliding = sliding

    def build(self, scheduled: List[Tuple[Sequence, int]], scores: Optional[ScoreRequest] = None,
              copies: Optional[CopyBatch] = None) -> Tuple[StepInput, List[StepRow]]:
        """-> (the StepInput for every rank, the rows in its order). Each StepInput built must
        reach the workers: their view stores advance with this builder's cache."""
        if not scheduled:
            return StepInput(copies=copies), []
        scores = scores or ScoreRequest()
        if len(self.translation) > len(scheduled):
            self.translation.retain(s.seq_id for s, _ in scheduled)
        # Single-token rows first: they share one padded, batched attention call.
        decodes = [(s, n) for s, n in scheduled if n == 1]
        prefills = [(s, n) for s, n in scheduled if n > 1]
        cols = _Columns()
        rows = [self._add_row(cols, seq, n, i < len(decodes), scores)
                for i, (seq, n) in enumerate(decodes + prefills)]
        # a one-token prompt chunk runs as a decode row: its scores come from the decode mass
        mass = bool(decodes) and (scores.decode or any(s.seq_id in scores.prefill_from
                                                       for s, _ in decodes))
        step = cols.step_input(len(decodes), mass, copies)
        if self.sliding is not None:
            self._add_sliding(step, rows)
        elif self.window is not None and decodes:
            step.window_skip = self._window_skip(rows[:len(decodes)])
        return step, rows

    def _add_sliding(self, step: StepInput, rows: List[StepRow]) -> None:
        """Each row's sliding-window view (ids max(0, first query - W + 1) .. its last new
        token) and its new tokens' slots, in every sliding subgroup."""
        first, lens, slots, views = [], [], [], []
        for r in rows:
            c, sid = r.seq.num_computed_tokens, r.seq.seq_id
            lo = max(c - self.window + 1, 0)
            ids = np.arange(lo, c + r.num_new)
            view = self.sliding.slots(sid, ids)
            first.append(lo)
            lens.append(len(ids))
            views.append(view)
            slots.append(view[c - lo:])
        step.sliding_first, step.sliding_lens = _ints(first), _ints(lens)
        step.sliding_slot_mapping, step.sliding_views = np.concatenate(slots), \
            np.concatenate(views)

    def _window_skip(self, rows: List[StepRow]) -> np.ndarray:
        """Per decode row, the view entries with logical id <= position - W: the keys its
        sliding layers do not read (ids [0, 2, 5, 6, 7], position 7, W 3 -> 3)."""
        return np.fromiter((np.searchsorted(r.view_ids, r.seq.num_computed_tokens - self.window
                                            + 1) for r in rows), np.int64, len(rows))

    def _add_row(self, cols: _Columns, seq: Sequence, n: int, is_decode: bool,
                 scores: ScoreRequest) -> StepRow:
        """One row's columns; runs for every running request every step, so kept lean."""
        c, start, sid = seq.num_computed_tokens, cols.start, seq.seq_id
        cols.ids += seq.token_ids[c:c + n]
        cols.pos.append(np.arange(c, c + n))
        cols.slots.append(self.token_table.slots(sid, c, c + n))
        cols.num_new.append(n)
        view_ids, view_slots, handle, keep, drops = self.translation.view(sid)
        cols.handles.append(handle)
        cols.keep.append(keep)
        cols.new.append(view_slots[keep:])
        cols.drops.append(drops)
        cols.keys.append(_KEY_CODE.get(scores.key_statistic.get(sid), 0))
        if not is_decode:
            cols.colsum_from.append(scores.prefill_from.get(sid, NO_COLUMN_SUMS))
            if needs_mask(c, n, len(view_ids)):
                cols.mask_ids.append(view_ids)
        row = StepRow(seq, n, start, view_ids, is_decode)
        if seq.params.prompt_logprobs is not None:
            count = prompt_logit_count(seq, n)
            if count:
                cols.prompt_spans.append((start, count))
                row.prompt_logits = slice(cols.prompt_at, cols.prompt_at + count)
                cols.prompt_at += count
        if c + n == len(seq.token_ids):      # row.completes: its next token gets sampled
            cols.sample.append(start + n - 1)
        cols.start += n
        return row

    @staticmethod
    def step_stats(rows: List[StepRow], out: StepOutput) -> StepStats:
        """The worker's per-row statistics, attached to the sequences (for the KV manager)."""
        assert len(out.rows) == len(rows), "a step output has one RowStats per row"
        return StepStats([SeqStepStats(r.seq, r.num_new, r.is_decode, r.view_ids, s.scores,
                                       s.key_statistic) for r, s in zip(rows, out.rows)])

    def forget_views(self) -> None:
        """After a failed step: send every view whole next time (see TranslationCache.clear)."""
        self.translation.clear()

    @property
    def rebuilds(self) -> int:
        return self.translation.rebuilds


_NONE = np.empty(0, np.int64)
_NONE.flags.writeable = False        # shared by every step input with an empty column


def _concat(arrays: List[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays).astype(np.int64, copy=False) if arrays else _NONE


def _ints(values: list) -> np.ndarray:
    return np.array(values, np.int64) if values else _NONE
