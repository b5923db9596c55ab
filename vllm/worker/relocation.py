"""RelocationExecutor: copies K and V of every layer for all of a step's moves in one call.

    kv_caches  [num_layers, num_slots, 2, kv_heads, head_dim]
    kv_caches[:, dst] = kv_caches[:, src]        one batched gather/scatter over every layer

`submit` returns a CopyEvent; the backend polls `event.query()` and applies the moves to the
token table (and frees emptied blocks) only once it reports completion. On CPU the copy is
synchronous and the event completes at once; `DelayedRelocationExecutor` (tests) holds
completion back for N steps to exercise the asynchronous protocol (I3).
"""
import time
from typing import List

import torch

from vllm import _custom_ops as ops


class CopyEvent:
    def __init__(self, done: bool = True):
        self._done = done

    def query(self) -> bool:
        return self._done

    def synchronize(self) -> None:
        self._done = True


class RelocationExecutor:
    def __init__(self, kv_caches: torch.Tensor, force_sync: bool = False):
        self.kv_caches = kv_caches
        self.force_sync = force_sync
        self.copy_time = 0.0
        self.launches = 0

    def submit(self, src: torch.Tensor, dst: torch.Tensor) -> CopyEvent:
        t0 = time.perf_counter()
        ops.relocate_kv(self.kv_caches, src, dst)
        self.copy_time += time.perf_counter() - t0
        self.launches += 1
        return CopyEvent(done=True)

    def step(self) -> None:
        """Called once per engine step (advances simulated delays)."""


class _DelayedEvent(CopyEvent):
    def __init__(self, executor: "DelayedRelocationExecutor", src, dst, steps: int):
        super().__init__(done=False)
        self.executor, self.src, self.dst, self.steps_left = executor, src, dst, steps

    def land(self) -> None:
        if not self._done:
            ops.relocate_kv(self.executor.kv_caches, self.src, self.dst)
            self._done = True

    def synchronize(self) -> None:
        self.land()


class DelayedRelocationExecutor(RelocationExecutor):
    """The copy lands N engine steps after submit. Until then the destination slots hold
    poison (NaN), so any attention that read them early would corrupt the output (I3 test)."""

    def __init__(self, kv_caches: torch.Tensor, delay_steps: int):
        super().__init__(kv_caches)
        self.delay_steps = delay_steps
        self.pending: List[_DelayedEvent] = []

    def submit(self, src: torch.Tensor, dst: torch.Tensor) -> CopyEvent:
        self.launches += 1
        self.kv_caches[:, dst] = float("nan")
        event = _DelayedEvent(self, src.clone(), dst.clone(), self.delay_steps)
        if self.delay_steps <= 0:
            event.land()
        else:
            self.pending.append(event)
        return event

    def step(self) -> None:
        for event in self.pending:
            event.steps_left -= 1
            if event.steps_left <= 0:
                event.land()
        self.pending = [e for e in self.pending if not e.query()]
