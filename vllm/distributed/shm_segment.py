"""ShmSegment: one shared-memory segment of the ranks of one host, and waiting on counters in it.

Rank 0 creates the segment (name None) and shares .name; the other ranks attach by name. The
creator alone unlinks it (close()). Spawned ranks share rank 0's resource tracker, in which an attach
registers the same name again (a no-op), so a rank 0 that dies without closing still has its
segments removed by the tracker.

The collectives built on it (ShmAllReduce, ShmGather, ShmBroadcast) publish progress as counters,
one cache line each, that only grow: "rank r has written call k", "rank 0 has read call k". A
waiter spins (each rank owns its core), then naps; while napping it asks `peer_alive` (a dead
peer never publishes) and gives up after `timeout_s` (None: wait as long as the peers live, for
a rank that waits for the next step of an idle engine).
"""
import os
import time
from multiprocessing import shared_memory
from typing import Callable, Optional

import numpy as np
import torch

LINE = 64                     # bytes per counter: one cache line each
SPIN_S = 0.002                # spin this long, then nap between looks
NAP_S = 0.0002
CHECK_S = 0.5                 # while napping, ask peer_alive this often
SHM_DIR = "/dev/shm"
_LINGERING = []               # segments closed while a view lived: their mapping stays mapped


class PeerGone(RuntimeError):
    """A rank stopped taking part (it died, or did not arrive within the timeout)."""


def host_has_room(nbytes: int) -> bool:
    """Whether /dev/shm can back nbytes with room to spare. A tmpfs segment larger than the
    free space is created without complaint, and the first write past it is a SIGBUS."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return False
    return nbytes <= st.f_bavail * st.f_frsize // 2


class ShmSegment:
    def __init__(self, rank: int, nbytes: int, name: Optional[str] = None,
                 timeout_s: Optional[float] = 600.0):
        if nbytes <= 0:
            raise ValueError(f"a shared-memory segment needs a positive size, got {nbytes}")
        self.rank, self.nbytes, self.timeout_s = rank, nbytes, timeout_s
        self.created = name is None
        self.shm = shared_memory.SharedMemory(name=name, create=self.created, size=nbytes)
        self.name = self.shm.name
        # views hold a buffer export of the mmap itself (np.frombuffer, memoryview), so that
        # SharedMemory.close() refuses to unmap under a live view; an np.ndarray over .buf or
        # the mmap holds none, and a read after close() would be a segfault
        self._map = self.shm._mmap
        self.peer_alive: Callable[[], bool] = lambda: True
        # True where ranks share cores: a spinning waiter would hold the core its peer needs
        # (yielding is not the default: it hands the core to any other process for a slice)
        self.yield_core = False
        self._memoryviews = []        # released at close (an owner drops its arrays first)

    def counters(self, n: int, offset: int = 0) -> np.ndarray:
        """n int64 counters at offset, one cache line each (zeroed by the creator)."""
        assert offset % LINE == 0 and offset + n * LINE <= self.nbytes
        lines = np.frombuffer(self._map, np.int64, n * LINE // 8, offset).reshape(n, -1)
        if self.created:
            lines[:] = 0
        return lines[:, 0]

    def floats(self, shape, offset: int) -> torch.Tensor:
        """A float32 tensor of `shape` over the segment at offset (no copy)."""
        arr = np.frombuffer(self._map, np.float32, int(np.prod(shape)), offset).reshape(shape)
        return torch.from_numpy(arr)

    def bytes(self, offset: int, n: int) -> memoryview:
        assert offset + n <= self.nbytes
        view = memoryview(self._map)[offset:offset + n]
        self._memoryviews.append(view)
        return view

    def wait_for(self, counters: np.ndarray, k: int, what: str, spin_s: float = SPIN_S,
                 max_nap_s: float = NAP_S) -> None:
        """Until every counter is >= k. (min of .tolist(): cheaper a look than numpy's min on a few counters.)
        Naps start at NAP_S and double up to max_nap_s: a waiter that may wait long (for the
        next step of an idle engine) wakes the core a few hundred times a second, not 5,000."""
        if min(counters.tolist()) >= k:
            return
        start = time.perf_counter()
        if self._spin(counters, k, start + spin_s):
            return
        last_check, nap = start, NAP_S
        while min(counters.tolist()) < k:
            now = time.perf_counter()
            time.sleep(nap)
            nap = min(2 * nap, max_nap_s)
            if now - last_check > CHECK_S:
                last_check = now
                if not self.peer_alive():
                    raise PeerGone(f"rank {self.rank}: a peer left the shared-memory {what}")
                if self.timeout_s is not None and now - start > self.timeout_s:
                    raise PeerGone(f"rank {self.rank}: the shared-memory {what} waited "
                                   f"{self.timeout_s:.0f} s for a peer")

    def _spin(self, counters: np.ndarray, k: int, until: float) -> bool:
        """Look until every counter is >= k (True) or the clock passes `until` (False),
        yielding the core between looks where a peer may need it."""
        while min(counters.tolist()) < k:
            if time.perf_counter() > until:
                return False
            if self.yield_core:
                os.sched_yield()
        return True

    def close(self) -> None:
        if self.shm is None:
            return
        for view in self._memoryviews:
            view.release()
        self._memoryviews, self._map = [], None
        try:
            self.shm.close()
        except BufferError:      # a view still alive somewhere: mapped until the process ends
            _LINGERING.append(self.shm)
        if self.created:
            self.shm.unlink()
        self.shm = None
