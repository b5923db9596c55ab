"""TranslationCache: each running request's attention view (live ids and slots), kept between steps.

On a plain decode step the token table only grew, so the view is extended with the new tokens;
after an eviction, relocation or preemption (the table's version changed) it is rebuilt from the
token table. `rebuilds` counts the rebuilds.

Each view also says what the workers' copy of it (worker/view_store.py) must change: `keep`, the
entries unchanged since the previous call (0 after a rebuild), and a `handle` that names the
view across the worker boundary (a new one whenever the view is created afresh).
"""
import itertools
from typing import Dict, Tuple

import numpy as np

from vllm.core.token_table import TokenTable


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

    def view(self, req_id: str) -> Tuple[np.ndarray, np.ndarray, int, int]:
        """(live logical ids, their slots, both in logical order; the view's handle; how many
        leading entries the workers' copy already holds). A plain tuple: once per row a step."""
        tt = self.token_table
        v = self._views.get(req_id)
        if v is None:
            v = self._views[req_id] = _View(next(self._handles))
        keep = v.n
        length = tt.length(req_id)
        if v.version != tt.version(req_id) or length < v.length:
            self._rebuild(req_id, v)
            keep = 0
        elif length > v.length:
            self._append(req_id, v, length)
        return v.ids[:v.n], v.slots[:v.n], v.handle, keep

    def _rebuild(self, req_id: str, v: _View) -> None:
        tt = self.token_table
        ids = tt.live_ids(req_id)
        v.ids, v.slots = ids.copy(), tt.live_slots(req_id).astype(np.int64)
        v.n, v.length, v.version = len(ids), tt.length(req_id), tt.version(req_id)
        self.rebuilds += 1

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
