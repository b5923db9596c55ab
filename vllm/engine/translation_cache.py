"""TranslationCache: each running request's attention view (live ids and slots), kept between steps.

On a plain decode step the token table only grew, so the view is extended with the new tokens;
after an eviction or relocation (the table's version changed) it is rebuilt from the token
table. `rebuilds` counts the rebuilds.

Each view also says what the workers' copy of it (worker/view_store.py) must change, as a
ViewDelta against the previous call's view: the positions of the tokens evicted since (`drops`),
then how many entries of what is left stay (`keep`); the rest of the view is sent. A rebuild
finds its delta by comparing the two views (a token never comes back once evicted):

    previous ids [0 1 2 3 4 5], slots [10 11 12 13 14 15]; ids 1 and 4 evicted, 6 appended
    new ids      [0 2 3 5 6],   slots [10 12 13 15 16]  -> drops [1, 4], keep 4, send [16]
    ... and if token 3 was relocated to slot 30: slots [10 12 30 15 16] -> keep 2, send
    [30 15 16]

so an eviction sends O(evicted) numbers, not the view. A new view (new request, after a
preemption or a failed step) gets a new `handle` and goes whole.
"""
import itertools
from typing import Dict, NamedTuple

import numpy as np

from vllm.core.token_table import TokenTable

_NONE = np.empty(0, np.int64)


class ViewDelta(NamedTuple):
    """A view and what the workers' copy must do: delete `drops` (positions in its previous
    view), keep the first `keep` entries of the rest, append slots[keep:]."""
    ids: np.ndarray
    slots: np.ndarray
    handle: int
    keep: int
    drops: np.ndarray = _NONE


class _View:
    __slots__ = ("ids", "slots", "n", "length", "version", "handle")

    def __init__(self, handle: int):
        self.ids = np.empty(0, np.int64)
        self.slots = np.empty(0, np.int64)
        self.n = 0          # entries in the view
        self.length = 0     # token-table length it reflects
        self.version = -1
        self.handle = handle


class TranslationCache:
    def __init__(self, token_table: TokenTable):
        self.token_table = token_table
        self._views: Dict[str, _View] = {}
        self._handles = itertools.count()
        self.rebuilds = 0

    def view(self, req_id: str) -> ViewDelta:
        """The request's live logical ids and their slots, both in logical order, and the delta
        from its previous view. Once per row a step."""
        tt = self.token_table
        v = self._views.get(req_id)
        if v is None:
            v = self._views[req_id] = _View(next(self._handles))
        keep, drops = v.n, _NONE
        length = tt.length(req_id)
        if v.version != tt.version(req_id) or length < v.length:
            keep, drops = self._rebuild(req_id, v)
        elif length > v.length:
            self._append(req_id, v, length)
        return ViewDelta(v.ids[:v.n], v.slots[:v.n], v.handle, keep, drops)

    def _rebuild(self, req_id: str, v: _View):
        """Reread the view from the token table -> (keep, drops) against the old one."""
        tt = self.token_table
        old_ids, old_slots, old_length = v.ids[:v.n], v.slots[:v.n], v.length
        ids = tt.live_ids(req_id)
        v.ids, v.slots = ids.copy(), tt.live_slots(req_id).astype(np.int64)
        v.n, v.length, v.version = len(ids), tt.length(req_id), tt.version(req_id)
        self.rebuilds += 1
        if v.length < old_length or not len(old_ids):
            return 0, _NONE
        at = np.minimum(np.searchsorted(v.ids, old_ids), max(v.n - 1, 0))
        live = v.ids[at] == old_ids if v.n else np.zeros(len(old_ids), bool)
        kept = int(live.sum())
        if kept != int((v.ids < old_length).sum()):     # an old token came back: send it whole
            return 0, _NONE
        differ = np.flatnonzero(old_slots[live] != v.slots[:kept])   # relocated tokens
        return (int(differ[0]) if len(differ) else kept), np.flatnonzero(~live)
    def _append(self, req_id: str, v: _View, length: int) -> None:
        new = length - v.length            # new tokens are always live
        if v.n + new > len(v.ids):
            cap = max(v.n + new, 2 * len(v.ids), 64)
            v.ids = np.resize(v.ids, cap)
            v.slots = np.resize(v.slots, cap)
        v.ids[v.n:v.n + new] = np.arange(v.length, length)
        v.slots[v.n:v.n + new] = self.token_table.slots(req_id, v.length, length)
        v.n += new
        v.length = length

    def __len__(self) -> int:
        return len(self._views)

    def retain(self, req_ids) -> None:
        """Forget views of requests no longer running (finished, aborted, preempted)."""
        keep = set(req_ids)
        for rid in [r for r in self._views if r not in keep]:
            del self._views[rid]

    def clear(self) -> None:
        """Forget every view: the next step sends each one whole (after a failed step, whose
        deltas the workers may not have applied)."""
        self._views.clear()

    def snapshot(self) -> Dict[int, np.ndarray]:
        """handle -> slots of every view: what the workers' view stores must hold."""
        return {v.handle: v.slots[:v.n].copy() for v in self._views.values()}
