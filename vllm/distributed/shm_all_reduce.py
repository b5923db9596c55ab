"""ShmAllReduce: a float32 sum over the ranks of one host through shared memory.

gloo's all-reduce costs ~0.7 ms a call on the 2-core AMD EPYC host (p90 4 ms), and a decode step
of a 30-layer model makes 62 of them; this one costs ~20-30 us (benchmarks/benchmark_tp.py).

Layout: a counter per rank (one cache line each), then two sets (by call parity) of one slot
per rank. Call k on rank r: copy the tensor into slot[k % 2][r], publish k in counter[r], wait
until every counter reaches k, then sum slot[k % 2][0..N-1] in rank order, so every rank gets
bitwise the same result. Two sets suffice: a rank can start call k + 2 (overwriting its
k-parity slot) only after every rank published k + 1, i.e. finished reading call k. On x86 the
stores of the copy are visible before the counter's (stores are not reordered), and a reader
reads the counter before the slots.

Waiting spins (the ranks are bound to their own cores), then naps; while napping it asks
`peer_alive` (a dead peer never publishes) and gives up after the group's timeout.
"""
import time
from multiprocessing import shared_memory
from typing import Callable, Optional

import numpy as np
import torch

LINE = 64                     # bytes per counter: one cache line each
SPIN_S = 0.002                # spin this long, then nap between looks
NAP_S = 0.0002
CHECK_S = 0.5                 # while napping, ask peer_alive this often


class PeerGone(RuntimeError):
    """A rank stopped taking part (it died, or did not arrive within the timeout)."""


class ShmAllReduce:
    def __init__(self, rank: int, world_size: int, max_floats: int, name: Optional[str] = None,
                 timeout_s: float = 600.0):
        """Rank 0 creates the segment (name None) and shares .name; the others attach."""
        self.rank, self.n, self.max_floats, self.timeout_s = rank, world_size, max_floats, \
            timeout_s
        size = world_size * LINE + 2 * world_size * max_floats * 4
        # the creator alone unlinks it; spawned ranks share its resource tracker, in which an
        # attach registers the same name again (a no-op), so nothing else is to be done
        self.shm = shared_memory.SharedMemory(name=name, create=name is None, size=size)
        self.name = self.shm.name
        self.counters = np.ndarray((world_size, LINE // 8), np.int64, self.shm.buf)[:, 0]
        self.slots = np.ndarray((2, world_size, max_floats), np.float32, self.shm.buf,
                                offset=world_size * LINE)
        if name is None:
            self.counters[:] = 0
        self.calls = 0
        self.peer_alive: Callable[[], bool] = lambda: True

    def fits(self, t: torch.Tensor) -> bool:
        return t.dtype == torch.float32 and t.device.type == "cpu" and \
            t.numel() <= self.max_floats

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """t += the other ranks' t (in place; t float32 on the CPU, at most max_floats)."""
        self.calls += 1
        k, n = self.calls, t.numel()
        slots = self.slots[k % 2]
        slots[self.rank, :n] = t.reshape(-1).numpy()
        self.counters[self.rank] = k
        self._wait(k)
        total = torch.from_numpy(slots[0, :n].copy())
        for r in range(1, self.n):
            total += torch.from_numpy(slots[r, :n])
        t.copy_(total.view(t.shape))
        return t

    def _wait(self, k: int) -> None:
        counters = self.counters
        if counters.min() >= k:
            return
        start = time.perf_counter()
        while counters.min() < k:
            if time.perf_counter() - start > SPIN_S:
                break
        last_check = start
        while counters.min() < k:
            time.sleep(NAP_S)
            now = time.perf_counter()
            if now - last_check > CHECK_S:
                last_check = now
                if not self.peer_alive():
                    raise PeerGone(f"rank {self.rank}: a peer left the shared-memory all-reduce")
                if now - start > self.timeout_s:
                    raise PeerGone(f"rank {self.rank}: the shared-memory all-reduce waited "
                                   f"{self.timeout_s:.0f} s for a peer")

    def close(self) -> None:
        if self.shm is None:
            return
        self.counters = self.slots = None
        try:
            self.shm.close()
        except BufferError:      # a view still alive somewhere: the mapping goes with it
            pass
        if self.rank == 0:
            self.shm.unlink()
        self.shm = None
