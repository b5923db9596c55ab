"""StepInput: everything a worker needs for one engine step, as plain numpy arrays and ints.

The engine builds one per step (engine/step_input_builder.py) from the scheduler output and the
token tables, and every rank receives the same one (it pickles as a handful of arrays). Nothing
in it is a Sequence, a TokenTable or a torch tensor: tokens, positions and slots are numbers,
and a request is a view handle. This module imports numpy only, so the engine side (the core's
reclamation backend makes CopyBatch) can import it without pulling in the worker.

Rows are the step's requests, single-token rows (decodes) first; their tokens lie flat:

    num_new       [1, 1, 5]                      two decode rows, then a prompt chunk of 5
    input_ids     [a, b, p0, p1, p2, p3, p4]     positions and slot_mapping alike
    row starts    [0, 1, 2]                      (cumulative num_new)

Attention views travel as deltas against the worker's copy (worker/view_store.py): row i
deletes the view_drop_lens[i] positions taken in turn from view_drops (evicted tokens, as
positions in the view its handle held after the previous step), keeps the first view_keep[i]
slots of what is left and appends view_new_lens[i] slots taken in turn from view_new_slots:

    plain decode step      keep = old length, new = [the token's slot]      (O(1) per row)
    after an eviction      drops = the evicted positions, new = [the token's slot]
    after a relocation     keep = up to the first moved token, new = the rest
    new request (or after a preemption)            keep = 0, new = the whole view
"""
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np

KEY_STATISTICS = ("norm", "similarity", "value_norm")   # key_statistic codes 1-3; 0 = none
NO_COLUMN_SUMS = -1                       # colsum_from of a prompt chunk that collects none


def _ints() -> np.ndarray:
    return np.empty(0, np.int64)


def needs_mask(computed: int, num_new: int, view_len: int) -> bool:
    """A prompt chunk attends causally over its view unless it continues a prompt or its view
    has holes (evicted tokens): then an explicit mask from the view's logical ids."""
    return computed > 0 or view_len != computed + num_new


@dataclass
class CopyBatch:
    """Relocation copies for the worker: kv[:, dst] = kv[:, src] in every layer, K and V."""
    batch_id: Optional[int] = None           # None: no new copies, only fences
    src: np.ndarray = field(default_factory=_ints)
    dst: np.ndarray = field(default_factory=_ints)
    fence: List[int] = field(default_factory=list)   # batches the next forward must wait for


@dataclass
class StepInput:
    # ---- tokens (flat over rows) ----
    input_ids: np.ndarray = field(default_factory=_ints)       # [T]
    positions: np.ndarray = field(default_factory=_ints)       # [T] logical ids (RoPE)
    slot_mapping: np.ndarray = field(default_factory=_ints)    # [T] where each K/V is written
    num_new: np.ndarray = field(default_factory=_ints)         # [R] tokens per row
    num_decodes: int = 0                                       # rows of one token, first
    # ---- attention views, as deltas (see above) ----
    view_handles: np.ndarray = field(default_factory=_ints)    # [R]
    view_keep: np.ndarray = field(default_factory=_ints)       # [R]
    view_new_lens: np.ndarray = field(default_factory=_ints)   # [R]
    view_new_slots: np.ndarray = field(default_factory=_ints)  # [sum(view_new_lens)]
    view_drop_lens: np.ndarray = field(default_factory=_ints)  # [R] (empty: no drops at all)
    view_drops: np.ndarray = field(default_factory=_ints)      # [sum(view_drop_lens)]
    # logical ids of the views of the prompt chunks that need_mask(), in row order (the mask:
    # a query at logical id p sees the live keys with id <= p)
    mask_view_ids: np.ndarray = field(default_factory=_ints)
    # [num_decodes] per decode row, the leading entries of its view (logical ids <= its
    # position - W) that the model's sliding layers of window W do not read; empty: no window
    window_skip: np.ndarray = field(default_factory=_ints)
    # a hybrid model's sliding-window subgroups (layers/attention.py KVGroups), whose views are
    # contiguous logical ids and go whole: per row the ids first .. its last new token, each
    # subgroup's slots side by side ([., K]); empty: one KV group
    sliding_slot_mapping: np.ndarray = field(default_factory=lambda: np.empty((0, 0), np.int64))
    sliding_first: np.ndarray = field(default_factory=_ints)      # [R] first id of each view
    sliding_lens: np.ndarray = field(default_factory=_ints)       # [R]
    sliding_views: np.ndarray = field(default_factory=lambda: np.empty((0, 0), np.int64))
    # ---- score request: which attention statistics to collect ----
    decode_mass: bool = False                  # attention mass of every decode row over its view
    colsum_from: np.ndarray = field(default_factory=_ints)     # [R - num_decodes] first scored
                                               # query of each prompt chunk, or NO_COLUMN_SUMS
    key_statistic: np.ndarray = field(default_factory=lambda: np.empty(0, np.int8))   # [R]
    # ---- which hidden states get logits ----
    sample_indices: np.ndarray = field(default_factory=_ints)  # [S] increasing flat indices
    prompt_logit_spans: np.ndarray = field(                    # [Q, 2] (flat start, count)
        default_factory=lambda: np.empty((0, 2), np.int64))
    # ---- relocation ----
    copies: Optional[CopyBatch] = None

    @property
    def num_rows(self) -> int:
        return len(self.num_new)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)
