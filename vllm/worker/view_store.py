"""ViewStore: the worker's copy of each row's attention view, updated from the step's deltas.

The engine's TranslationCache and this store advance together, one StepInput at a time: after
every step both hold, per handle, the live slots (in logical order) of that step's rows, and
both forget the handles that were not in the step. A row's view is then

    view = delete(stored, drops)[:keep] ++ new
        stored [5, 9, 12], keep 3, new [13]                 -> [5, 9, 12, 13]
        stored [5, 9, 12], drops [1], keep 2, new [13]      -> [5, 12, 13]   (an eviction)
        keep 0, new [5, 12, 13]                             -> [5, 12, 13]   (sent whole)

so a plain decode step sends one slot per row, and an eviction its evicted positions.
"""
from typing import Dict, List

import numpy as np

from vllm.worker.step_input import StepInput


class _Slots:
    __slots__ = ("slots", "n")

    def __init__(self):
        self.slots = np.empty(0, np.int64)
        self.n = 0


class ViewStore:
    def __init__(self):
        self._views: Dict[int, _Slots] = {}

    def __len__(self) -> int:
        return len(self._views)

    def update(self, step: StepInput) -> List[np.ndarray]:
        """Apply the step's deltas -> each row's view (slots, int64), in row order."""
        handles = step.view_handles.tolist()
        if len(self._views) > len(handles):
            keep = set(handles)
            for h in [h for h in self._views if h not in keep]:
                del self._views[h]
        new, drops = step.view_new_slots, step.view_drops
        drop_lens = step.view_drop_lens.tolist() or [0] * len(handles)
        views, at, dropped = [], 0, 0
        for h, k, n, d in zip(handles, step.view_keep.tolist(), step.view_new_lens.tolist(),
                              drop_lens):
            v = self._views.get(h)
            if v is None:
                v = self._views[h] = _Slots()
            if d:
                v.n = _delete(v, drops[dropped:dropped + d], h)
                dropped += d
            if k > v.n:
                raise RuntimeError(f"view {h}: the step keeps {k} slots but the worker holds "
                                   f"{v.n}: its view deltas are out of step with the engine")
            if k + n > len(v.slots):
                v.slots = np.resize(v.slots, max(k + n, 2 * len(v.slots), 64))
            v.slots[k:k + n] = new[at:at + n]
            v.n = k + n
            at += n
            views.append(v.slots[:v.n])
        return views

    def snapshot(self) -> Dict[int, np.ndarray]:
        """Every handle's view (copies), for the engine's consistency check."""
        return {h: v.slots[:v.n].copy() for h, v in self._views.items()}


def _delete(v: _Slots, positions: np.ndarray, handle: int) -> int:
    """Delete the entries at `positions` (increasing) in place -> the new length."""
    if positions[-1] >= v.n:
        raise RuntimeError(f"view {handle}: the step drops position {positions[-1]} but the "
                           f"worker holds {v.n}: its view deltas are out of step with the engine")
    kept = np.delete(v.slots[:v.n], positions)
    v.slots[:len(kept)] = kept
    return len(kept)
