"""ViewRows: what each row of the device view table holds, and the patch that turns it into this
step's decode views, so that a step uploads its new slots and changed rows, not the table.

Row r of the table holds handle held[r]'s view as of the previous step in columns [0, lens[r]),
and -1 from extent[r] on (columns in [lens, extent) may hold stale slots). This step's row i is
handle h, keeping the first keep[i] slots of h's previous view, whole view v of length L:

    h in row i (steady decode)    its prefix stays                 write v[keep:] at [keep, L)
    h in another row j            move row j's first keep slots    write v[keep:] at [keep, L)
    h not held (new, after a prefill chunk, rebuilt: keep 0)       write v at [0, L)
    then -1 over [L, extent) of every row, and over [0, extent) of rows past the step's last

    held [7, 8, 9], lens [5, 2, 4]; step handles [7, 8, 9], keep [5, 2, 4], one new slot each
        -> writes at (0, 5) (1, 2) (2, 4); no move, no fill
    request 8 finished; step handles [7, 9], keep [6, 5]
        -> write (0, 6); move row 2 -> 1 (first 5 columns), write (1, 5); -1 over row 2's [0, 5)
"""
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np


def _ints() -> np.ndarray:
    return np.empty(0, np.int64)


@dataclass
class ViewPatch:
    """Applied in order: table[move_dst, :move_width] = table[move_src, :move_width] (reading
    the table as it was), then table.flat[idx] = val."""
    move_src: np.ndarray = field(default_factory=_ints)
    move_dst: np.ndarray = field(default_factory=_ints)
    move_width: int = 0
    idx: np.ndarray = field(default_factory=_ints)
    val: np.ndarray = field(default_factory=_ints)

    @property
    def num_entries(self) -> int:
        """int64 entries a staged upload sends: both move lists, then indices and values."""
        return 2 * len(self.move_src) + 2 * len(self.idx)


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
    def __init__(self, max_rows: int, width: int):
        self.width = width
        self.rows = 0                                     # rows of the previous step
        self.held = np.full(max_rows, -1, np.int64)       # handle per row (-1: none)
        self.lens = np.zeros(max_rows, np.int64)
        self.extent = np.zeros(max_rows, np.int64)        # -1 from here on

    def patch(self, views: List[np.ndarray], handles: Optional[np.ndarray] = None,
              keep: Optional[np.ndarray] = None) -> ViewPatch:
        """The patch from the previous step's table to `views` (row order); the rows then hold
        them. Without handles every row is written whole."""
        b = len(views)
        lens = np.fromiter((len(v) for v in views), np.int64, b)
        src = self._rows_of(handles) if handles is not None else np.full(b, -1, np.int64)
        kept = np.where(src >= 0, keep if keep is not None else 0, 0).astype(np.int64)
        assert (kept <= self.lens[np.maximum(src, 0)]).all() and (kept <= lens).all(), \
            "a view keeps more slots than its row holds"
        out = ViewPatch()
        extent = self.extent[:b].copy()
        moved = (src >= 0) & (src != np.arange(b)) & (kept > 0)
        if moved.any():
            out.move_src, out.move_dst = src[moved], np.flatnonzero(moved)
            out.move_width = int(kept[moved].max())
            extent[moved] = np.maximum(extent[moved], out.move_width)
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
