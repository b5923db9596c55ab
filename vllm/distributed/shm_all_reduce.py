"""ShmAllReduce: a float32 sum over the ranks of one host through shared memory.

A decode step makes two all-reduces per layer; through shared memory each is a copy in, a
counter, and a sum, with no socket round trip (benchmarks/benchmark_tp.py compares it with gloo).

Layout (an ShmSegment): a counter per rank (one cache line each), then two sets (by call
parity) of one slot per rank. Call k on rank r: copy the tensor into slot[k % 2][r], publish k
in counter[r], wait until every counter reaches k, then sum slot[k % 2][0..N-1] in rank order
into the tensor, so every rank gets bitwise the same result. Two sets suffice: a rank can start
call k + 2 (overwriting its k-parity slot) only after every rank published k + 1, i.e. finished
reading call k. On x86 the stores of the copy are visible before the counter's (stores are not
reordered), and a reader reads the counter before the slots.
"""
from typing import Dict, List, Optional, Tuple

import torch

from vllm.distributed.shm_segment import LINE, ShmSegment

MAX_SHAPES = 64               # slot views kept (a step's row count varies)


class ShmAllReduce:
    def __init__(self, rank: int, world_size: int, max_floats: int, name: Optional[str] = None,
                 timeout_s: float = 600.0):
        """Rank 0 creates the segment (name None) and shares .name; the others attach."""
        assert world_size >= 2, "a sum over one rank needs no shared memory"
        self.rank, self.n, self.max_floats = rank, world_size, max_floats
        self.seg = ShmSegment(rank, self.nbytes(world_size, max_floats), name, timeout_s)
        self.name = self.seg.name
        self.counters = self.seg.counters(world_size)
        self.slots = self.seg.floats((2, world_size, max_floats), world_size * LINE)
        self.calls = 0
        self._views: Dict[Tuple[int, torch.Size], List[torch.Tensor]] = {}

    @staticmethod
    def nbytes(world_size: int, max_floats: int) -> int:
        return world_size * LINE + 2 * world_size * max_floats * 4

    def fits(self, t: torch.Tensor) -> bool:
        return t.dtype == torch.float32 and t.device.type == "cpu" and \
            t.numel() <= self.max_floats

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """t += the other ranks' t (in place; t float32 on the CPU, at most max_floats)."""
        self.calls += 1
        k = self.calls
        slots = self._slots(k % 2, t.shape)
        slots[self.rank].copy_(t)
        self.counters[self.rank] = k
        self.seg.wait_for(self.counters, k, "all-reduce")
        torch.add(slots[0], slots[1], out=t)      # (s0 + s1) + s2 + ...: rank order
        for s in slots[2:]:
            t += s
        return t

    def _slots(self, parity: int, shape: torch.Size) -> List[torch.Tensor]:
        """Every rank's slot of this parity as a tensor of `shape`, kept per shape (slicing a
        tensor costs several us, and a decode step makes 62 calls)."""
        key = (parity, shape)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= MAX_SHAPES:
                self._views.clear()
            n = shape.numel()
            views = self._views[key] = [self.slots[parity, r, :n].view(shape)
                                        for r in range(self.n)]
        return views

    def close(self) -> None:
        self.counters = self.slots = None
        self._views = {}
        self.seg.close()
