"""ViewRows: what each row of the device view table holds, and the patch that turns it into this
step's decode views, so that a step uploads its new slots, evicted positions and changed rows,
not the table.

Row r of the table holds handle held[r]'s view as of the previous step in columns [0, lens[r]),
and -1 from extent[r] on (columns in [lens, extent) may hold stale slots). This step's row i is
handle h, deleting the positions `drops` from h's previous view, keeping the first keep[i]
entries of what is left, whole view v of length L (see worker/step_input.py):

    h in row i (steady decode)    its prefix stays                 write v[keep:] at [keep, L)
    h in another row j            move row j's first columns       write v[keep:] at [keep, L)
    h not held (new, after a prefill chunk, sent whole: keep 0)    write v at [0, L)
    drops (h held)                squeeze the row: the entries left close up, -1 behind them
    then -1 over [L, extent) of every row, and over [0, extent) of rows past the step's last

    held [7, 8, 9], lens [5, 2, 4]; step handles [7, 8, 9], keep [5, 2, 4], one new slot each
        -> writes at (0, 5) (1, 2) (2, 4); no move, no fill
    request 8 finished; step handles [7, 9], keep [6, 5]
        -> write (0, 6); move row 2 -> 1 (first 5 columns), write (1, 5); -1 over row 2's [0, 5)
    row 0 evicted position 2: drops [2], keep 5 -> squeeze row 0, write (0, 5)
"""
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np
import torch


def _ints() -> np.ndarray:
    return np.empty(0, np.int64)


@dataclass
class ViewPatch:
    """Applied in order (apply_patch): the moves, table[move_dst, :move_width] =
    table[move_src, :move_width] (reading the table as it was); the squeezes, row squeeze_rows[j]
    loses the positions drop_pos where drop_row == j among its first squeeze_lens[j] columns;
    then table.flat[idx] = val."""
    move_src: np.ndarray = field(default_factory=_ints)
    move_dst: np.ndarray = field(default_factory=_ints)
    move_width: int = 0
    squeeze_rows: np.ndarray = field(default_factory=_ints)
    squeeze_lens: np.ndarray = field(default_factory=_ints)
    squeeze_width: int = 0
    drop_row: np.ndarray = field(default_factory=_ints)
    drop_pos: np.ndarray = field(default_factory=_ints)
    idx: np.ndarray = field(default_factory=_ints)
    val: np.ndarray = field(default_factory=_ints)

    def arrays(self) -> List[np.ndarray]:
        """Everything a staged upload sends, in apply_patch's order."""
        return [self.move_src, self.move_dst, self.squeeze_rows, self.squeeze_lens,
                self.drop_row, self.drop_pos, self.idx, self.val]

    @property
    def num_entries(self) -> int:
        return sum(len(a) for a in self.arrays())


def apply_patch(table: torch.Tensor, p: ViewPatch, parts: List[torch.Tensor],
                writes: bool = True) -> None:
    """p onto table, with parts = p.arrays() as tensors on the table's device (no host sync:
    widths are host numbers). writes=False leaves idx/val to the caller (staged in pieces)."""
    src, dst, rows, lens, drop_row, drop_pos, idx, val = parts
    if len(p.move_src):
        table[dst, :p.move_width] = table[src, :p.move_width]
    if len(p.squeeze_rows):
        _squeeze(table, rows, lens, drop_row, drop_pos, p.squeeze_width)
    if writes:
        table.view(-1)[idx] = val


def _squeeze(table, rows, lens, drop_row, drop_pos, width: int) -> None:
    """Close up each row's entries left after the drops; -1 behind them:

        row [5, 9, 12, 13, -1], lens 4, drops [1]:  keep [T, F, T, T, F]
        dest = cumsum - 1 where kept, else width (a scratch column) = [0, 5, 1, 2, 5]
        -> [5, 12, 13, -1, -1]
    """
    sub = table[rows, :width]
    keep = torch.arange(width, device=table.device)[None, :] < lens[:, None]
    keep.index_put_((drop_row, drop_pos), keep.new_zeros(()))   # (`= False`: a host copy, a sync)
    dest = torch.where(keep, keep.cumsum(1) - 1, width)
    out = torch.full((len(sub), width + 1), -1, dtype=table.dtype, device=table.device)
    out.scatter_(1, dest, sub)
    table[rows, :width] = out[:, :width]


def flat_ranges(rows: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                width: int) -> np.ndarray:
    """Flat indices row * width + col of the columns [starts[i], ends[i]) of rows[i] (empty
    where ends <= starts):

        rows [0, 2], starts [1, 0], ends [3, 2], width 4 -> [1, 2, 8, 9]
    """
    counts = np.maximum(ends - starts, 0)
    first = rows * width + starts - (np.cumsum(counts) - counts)   # minus the entries before
    return np.repeat(first, counts) + np.arange(int(counts.sum()))


class ViewRows:
    def __init__(self, max_rows: int, width: int, max_drops: Optional[int] = None):
        self.width = width
        self.max_drops = max_drops          # more drops in one step: those rows go whole
        self.rows = 0                                     # rows of the previous step
        self.held = np.full(max_rows, -1, np.int64)       # handle per row (-1: none)
        self.lens = np.zeros(max_rows, np.int64)
        self.extent = np.zeros(max_rows, np.int64)        # -1 from here on

    def patch(self, views: List[np.ndarray], handles: Optional[np.ndarray] = None,
              keep: Optional[np.ndarray] = None, drop_lens: Optional[np.ndarray] = None,
              drops: Optional[np.ndarray] = None) -> ViewPatch:
        """The patch from the previous step's table to `views` (row order); the rows then hold
        them. Without handles every row is written whole."""
        b = len(views)
        lens = np.fromiter((len(v) for v in views), np.int64, b)
        src = self._rows_of(handles) if handles is not None else np.full(b, -1, np.int64)
        held = src >= 0
        old_lens = np.where(held, self.lens[np.maximum(src, 0)], 0)
        ndrop = drop_lens if drop_lens is not None and len(drop_lens) else np.zeros(b, np.int64)
        if self.max_drops is not None and int(ndrop[held].sum()) > self.max_drops:
            held &= ndrop == 0
        ndrop = np.where(held, ndrop, 0)
        kept = np.where(held, keep if keep is not None else 0, 0).astype(np.int64)
        assert (kept <= old_lens - ndrop).all() and (kept <= lens).all(), \
            "a view keeps more slots than its row holds"
        out = ViewPatch()
        extent = self.extent[:b].copy()
        # old columns the row still reads: its kept prefix and the drops inside it, or all of
        # them where it has drops (a squeeze reads the row up to its last drop, which may lie
        # past keep + drops when the view changed after it: a relocation)
        need = np.where(ndrop > 0, old_lens, np.minimum(old_lens, kept + ndrop))
        moved = held & (src != np.arange(b)) & (need > 0)
        if moved.any():
            out.move_src, out.move_dst = src[moved], np.flatnonzero(moved)
            out.move_width = int(need[moved].max())
            extent[moved] = np.maximum(extent[moved], out.move_width)
        squeezed = np.flatnonzero(ndrop > 0)
        if len(squeezed):
            self._squeeze(out, squeezed, old_lens, ndrop, drop_lens, drops, extent)
        rows = np.arange(b)
        write = flat_ranges(rows, kept, lens, self.width)
        values = [v[k:] for v, k in zip(views, kept.tolist())]
        stale = max(self.rows - b, 0)               # rows the previous step had past this one
        fill = np.concatenate([flat_ranges(rows, lens, extent, self.width),
                               flat_ranges(np.arange(b, b + stale), np.zeros(stale, np.int64),
                                           self.extent[b:b + stale], self.width)])
        out.idx = np.concatenate([write, fill])
        out.val = np.concatenate(values + [np.full(len(fill), -1, np.int64)]) \
            .astype(np.int64, copy=False)
        self._commit(handles, lens, b)
        return out

    @staticmethod
    def _squeeze(out: ViewPatch, rows: np.ndarray, old_lens, ndrop, drop_lens, drops,
                 extent) -> None:
        """The squeezes of `rows` (held rows with drops); their extent becomes what is left."""
        starts = np.cumsum(drop_lens) - drop_lens            # each row's first entry in drops
        out.squeeze_rows, out.squeeze_lens = rows, old_lens[rows]
        out.squeeze_width = int(extent[rows].max())
        out.drop_row = np.repeat(np.arange(len(rows)), ndrop[rows])
        out.drop_pos = np.concatenate([drops[s:s + n] for s, n in
                                       zip(starts[rows].tolist(), ndrop[rows].tolist())])
        extent[rows] = old_lens[rows] - ndrop[rows]

    def _rows_of(self, handles: np.ndarray) -> np.ndarray:
        """The previous step's row of each handle, -1 where it was not there."""
        held = self.held[:self.rows]
        if not len(held):
            return np.full(len(handles), -1, np.int64)
        order = np.argsort(held, kind="stable")
        at = np.minimum(np.searchsorted(held[order], handles), len(held) - 1)
        return np.where(held[order][at] == handles, order[at], -1)

    def _commit(self, handles: Optional[np.ndarray], lens: np.ndarray, b: int) -> None:
        end = max(self.rows, b)
        self.held[:end], self.lens[:end], self.extent[:end] = -1, 0, 0
        if handles is not None:
            self.held[:b] = handles
        self.lens[:b] = self.extent[:b] = lens
        self.rows = b
