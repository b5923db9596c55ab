"""ShmBroadcast: rank 0's picklable object on every rank of one host, through shared memory (the
step input and the executor's other calls).

Through shared memory the send is one copy of the pickled bytes, with no second broadcast for
the length (benchmarks/benchmark_tp.py, part 2, compares it with gloo's). A rank waits here between steps, so its wait has no timeout: it lasts as long as the
engine is idle and ends with an error only when rank 0 is gone.

Layout (an ShmSegment): N counters, one cache line each, a length (one line), then `capacity`
bytes. counter[0]: rank 0 has published call k; counter[r] (r > 0): rank r has read call k.
Call k on rank 0: wait until every rank has read call k - 1, write the pickled object and its
length (-1: it does not fit, the caller sends it another way), publish k. On rank r: wait for
k, unpickle (a copy: the object does not alias the buffer), publish k as read.
"""
import pickle
from typing import Any, Optional, Tuple

from vllm.distributed.shm_segment import LINE, ShmSegment

READER_SPIN_S = 0.02         # rank 0 spends ~2-7 ms between steps (sampling, scheduling)
READER_MAX_NAP_S = 0.005      # then an idle engine: a late first step costs at most this


class ShmBroadcast:
    def __init__(self, rank: int, world_size: int, capacity: int, name: Optional[str] = None,
                 timeout_s: float = 600.0):
        """Rank 0 creates the segment (name None) and shares .name; the others attach."""
        assert world_size >= 2, "a broadcast to no other rank needs no shared memory"
        self.rank, self.n, self.capacity = rank, world_size, capacity
        # rank 0 waits for readers (who are always quick) with the group's timeout; readers
        # wait for rank 0 as long as it lives
        self.seg = ShmSegment(rank, self.nbytes(world_size, capacity), name,
                              timeout_s if rank == 0 else None)
        self.name = self.seg.name
        self.counters = self.seg.counters(world_size)
        self.length = self.seg.counters(1, world_size * LINE)
        self.data = self.seg.bytes((world_size + 1) * LINE, capacity)
        self.calls = 0

    @staticmethod
    def nbytes(world_size: int, capacity: int) -> int:
        return (world_size + 1) * LINE + capacity

    def send(self, data: bytes) -> bool:
        """Rank 0: publish pickled bytes; False when they do not fit (the readers are told so,
        and the caller sends them another way)."""
        assert self.rank == 0
        self.calls += 1
        k, fits = self.calls, len(data) <= self.capacity
        self.seg.wait_for(self.counters[1:], k - 1, "broadcast")
        if fits:
            self.data[:len(data)] = data
        self.length[0] = len(data) if fits else -1
        self.counters[0] = k
        return fits

    def recv(self) -> Tuple[bool, Any]:
        """Ranks > 0: (True, the object) or (False, None) when it comes another way."""
        assert self.rank > 0
        self.calls += 1
        k = self.calls
        self.seg.wait_for(self.counters[:1], k, "broadcast", READER_SPIN_S, READER_MAX_NAP_S)
        n = int(self.length[0])
        obj = pickle.loads(self.data[:n]) if n >= 0 else None
        self.counters[self.rank] = k
        return n >= 0, obj

    def close(self) -> None:
        self.counters = self.length = self.data = None
        self.seg.close()
