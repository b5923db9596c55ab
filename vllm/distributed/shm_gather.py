"""ShmGather: rank 0 gets every rank's [rows, width] float32 block through shared memory (the
vocabulary-parallel logits: rank r holds the vocabulary columns r*width .. (r+1)*width).

A gather costs one copy on each side (benchmarks/benchmark_tp.py compares it with gloo's).

Layout (an ShmSegment): N counters, one cache line each, then one slot of max_floats per rank
1..N-1. counter[r] (r > 0): rank r has written call k into its slot; counter[0]: rank 0 has read
call k. Call k on rank r > 0: wait until rank 0 has read call k - 1 (its slot is free again;
in the engine this is long true: rank 0 reads the logits before it sends the next step), copy
the block into the slot, publish k. On rank 0: copy its own block into the output, wait until
every rank published k, copy their slots beside it, publish k as read. The output is the
ranks' blocks side by side in rank order: bitwise what a gather plus a concatenation gives.
"""
from typing import Optional

import torch

from vllm.distributed.shm_segment import LINE, ShmSegment


class ShmGather:
    def __init__(self, rank: int, world_size: int, max_floats: int, name: Optional[str] = None,
                 timeout_s: float = 600.0):
        """Rank 0 creates the segment (name None) and shares .name; the others attach."""
        assert world_size >= 2, "a gather from one rank needs no shared memory"
        self.rank, self.n, self.max_floats = rank, world_size, max_floats
        self.seg = ShmSegment(rank, self.nbytes(world_size, max_floats), name, timeout_s)
        self.name = self.seg.name
        self.counters = self.seg.counters(world_size)
        self.slots = self.seg.floats((world_size - 1, max_floats), world_size * LINE)
        self.calls = 0

    @staticmethod
    def nbytes(world_size: int, max_floats: int) -> int:
        return world_size * LINE + (world_size - 1) * max_floats * 4

    def fits(self, t: torch.Tensor) -> bool:
        return t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 2 and \
            t.numel() <= self.max_floats

    def __call__(self, local: torch.Tensor) -> Optional[torch.Tensor]:
        """Rank 0: [rows, N * width], rank r's block at columns r*width..; None elsewhere.
        Every rank passes a [rows, width] block of the same shape."""
        self.calls += 1
        k, (rows, width) = self.calls, local.shape
        n = rows * width
        if self.rank > 0:
            self.seg.wait_for(self.counters[:1], k - 1, "gather")
            self.slots[self.rank - 1, :n].copy_(local.reshape(-1))
            self.counters[self.rank] = k
            return None
        out = torch.empty(rows, self.n * width)
        out[:, :width].copy_(local)               # while the others write theirs
        self.seg.wait_for(self.counters[1:], k, "gather")
        for r in range(1, self.n):
            out[:, r * width:(r + 1) * width].copy_(self.slots[r - 1, :n].view(rows, width))
        self.counters[0] = k
        return out

    def close(self) -> None:
        self.counters = self.slots = None
        self.seg.close()
