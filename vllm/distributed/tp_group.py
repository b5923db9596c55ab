"""TPGroup: the collectives tensor parallelism needs, over one process group of its own.

    all_reduce(t)         in place, sum over ranks (the row-parallel O and down projections,
                          the vocab-parallel embedding, the attention statistics)
    gather_vocab(logits)  rank 0 gets [rows, vocab] from every rank's [rows, vocab shard]
    broadcast_object(x)   rank 0's picklable x on every rank (the step input, control calls)

On one host (the mp executor, CPU) each has a shared-memory path, sized by the caller:
float32 sums up to `shm_floats` (ShmAllReduce), gathers up to `shm_gather_floats` per rank
(ShmGather), objects up to `shm_broadcast_bytes` pickled (ShmBroadcast). Larger ones, other ops, other devices (NCCL) and
ranks on other hosts (Ray) use the process group; so does everything when /dev/shm has no room.
Rank 0 creates the segments and names them in the store (an empty name: none); shutdown()
removes them.

World size 1 is the same object with nothing to talk to: every call returns at once, so the
single-process model and worker run the same code. The group is a torch.distributed process
group built straight on a TCPStore (gloo on CPU, NCCL on CUDA), not the process-wide default
group: two engines in one process (tests, a server and a benchmark) each get their own.
"""
import datetime
import logging
import os
import pickle
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from vllm.distributed.shm_all_reduce import ShmAllReduce
from vllm.distributed.shm_broadcast import ShmBroadcast
from vllm.distributed.shm_gather import ShmGather
from vllm.distributed.shm_segment import PeerGone, host_has_room

logger = logging.getLogger(__name__)

# a worker that hangs (not dies: a dead one closes its sockets and fails the collective at once)
# fails the step after this long
DEFAULT_TIMEOUT_S = 600.0
JOIN_POLL_S = 0.05


def rank_device(device: str, rank: int, world_size: int) -> torch.device:
    """Rank r's device: cuda:r on CUDA with more than one rank (one GPU per rank, one node),
    else `device` as given."""
    if world_size > 1 and torch.device(device).type == "cuda":
        return torch.device("cuda", rank)
    return torch.device(device)


class TPGroup:
    def __init__(self, rank: int = 0, world_size: int = 1, host: str = "127.0.0.1",
                 port: int = 0, device: torch.device = torch.device("cpu"),
                 timeout_s: float = DEFAULT_TIMEOUT_S, connect: bool = True,
                 shm_floats: int = 0, shm_gather_floats: int = 0, shm_broadcast_bytes: int = 0,
                 peer_alive: Optional[Callable[[], bool]] = None):
        """Rank 0 hosts the store (port 0: any free port, read it from .port); connect=False
        leaves joining the group (which waits for every rank) to connect(). The shm_* sizes
        (ranks on one host, CPU; 0: none) must be the same on every rank; peer_alive tells the
        shared-memory paths whether the other ranks are still there."""
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.timeout_s = timeout_s
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = self.pg = None
        self.shm: Optional[ShmAllReduce] = None
        self.shm_gather: Optional[ShmGather] = None
        self.shm_bcast: Optional[ShmBroadcast] = None
        self.comm_seconds = 0.0        # host time spent waiting in collectives (benchmarks)
        self.peer_alive = peer_alive or (lambda: True)
        if world_size == 1:
            return
        self.store = dist.TCPStore(host, port, world_size, rank == 0, timeout=self.timeout,
                                   wait_for_workers=False)
        if self.device.type == "cpu":
            self._shm_bytes = 0
            self.shm = self._shm_setup("shm_all_reduce", ShmAllReduce, shm_floats)
            self.shm_gather = self._shm_setup("shm_gather", ShmGather, shm_gather_floats)
            self.shm_bcast = self._shm_setup("shm_broadcast", ShmBroadcast, shm_broadcast_bytes)
        if connect:
            self.connect()

    def _shm_setup(self, key: str, cls, size: int):
        """Rank 0 creates cls's segment when size > 0 and /dev/shm has room for it beside the
        ones before, and names it under key in the store ("": none); the others attach to the
        one it named."""
        if self.rank == 0:
            obj = None
            nbytes = cls.nbytes(self.world_size, size) if size > 0 else 0
            if nbytes and host_has_room(self._shm_bytes + nbytes):
                try:
                    obj = cls(0, self.world_size, size, None, self.timeout_s)
                    self._shm_bytes += nbytes
                except OSError as e:
                    logger.warning("no shared memory for the %s (%s): it uses the process group",
                                   key, e)
            elif nbytes:
                logger.warning("/dev/shm has no room for the %s (%d MiB): it uses the process "
                               "group", key, nbytes >> 20)
            self.store.set(key, obj.name if obj is not None else "")
        else:
            name = self.store.get(key).decode()
            obj = cls(self.rank, self.world_size, size, name, self.timeout_s) if name else None
        if obj is not None:
            obj.seg.peer_alive = self.peer_alive
            obj.seg.yield_core = (os.cpu_count() or 1) < self.world_size
        return obj

    def connect(self) -> None:
        """Join the process group. Rank 0 first waits for every rank to check in, asking
        peer_alive meanwhile: a rank that dies before it joins (a script without the
        `if __name__ == "__main__"` guard, under spawn) is an error at once, not a wait for
        the group's timeout."""
        if self.rank == 0:
            self._wait_for_ranks()
        else:
            self.store.set(f"joined/{self.rank}", b"1")
        if self.device.type == "cuda":
            self.pg = dist.ProcessGroupNCCL(self.store, self.rank, self.world_size)
        else:
            self.pg = dist.ProcessGroupGloo(self.store, self.rank, self.world_size, self.timeout)

    def _wait_for_ranks(self) -> None:
        keys = [f"joined/{r}" for r in range(1, self.world_size)]
        start = time.monotonic()
        while not self.store.check(keys):
            if not self.peer_alive():
                raise PeerGone("a tensor-parallel rank ended before it joined the group")
            if time.monotonic() - start > self.timeout_s:
                raise PeerGone(f"the tensor-parallel ranks did not join within "
                               f"{self.timeout_s:.0f} s")
            time.sleep(JOIN_POLL_S)

    @property
    def port(self) -> int:
        return self.store.port if self.store is not None else 0

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.shm is not None and op == "sum" and self.shm.fits(t):
            t0 = time.perf_counter()
            self.shm(t)
            self.comm_seconds += time.perf_counter() - t0
        elif self.pg is not None:
            opts = dist.AllreduceOptions()
            opts.reduceOp = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN}[op]
            self._wait(self.pg.allreduce([t], opts))
        return t

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> Optional[torch.Tensor]:
        """Every rank's [rows, shard] logits (shards of equal width, the last padded) joined
        along the vocabulary and trimmed to vocab_size on rank 0; None on the others."""
        if self.pg is None:
            return local[:, :vocab_size]
        if self.shm_gather is not None and self.shm_gather.fits(local):
            t0 = time.perf_counter()
            out = self.shm_gather(local)
            self.comm_seconds += time.perf_counter() - t0
            return out[:, :vocab_size] if out is not None else None
        parts = [torch.empty_like(local) for _ in range(self.world_size)] if self.rank == 0 \
            else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self._wait(self.pg.gather([parts] if self.rank == 0 else [], [local], opts))
        return torch.cat(parts, dim=1)[:, :vocab_size] if self.rank == 0 else None

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's obj, pickled once: through shared memory, or over the process group (its
        length, then its bytes: two broadcasts)."""
        if self.pg is None:
            return obj
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == 0 else b""
        if self.shm_bcast is not None:
            t0 = time.perf_counter()
            sent, got = (self.shm_bcast.send(data), obj) if self.rank == 0 \
                else self.shm_bcast.recv()
            self.comm_seconds += time.perf_counter() - t0
            if sent:
                return got
        size = torch.tensor([len(data)], dtype=torch.int64)
        self._broadcast(size)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 \
            else torch.empty(int(size), dtype=torch.uint8)
        self._broadcast(buf)
        return obj if self.rank == 0 else pickle.loads(buf.numpy().tobytes())

    def _broadcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if self.device.type == "cuda":    # NCCL moves device tensors; objects are host bytes
            dev = t.to(self.device)
            self._wait(self.pg.broadcast([dev], opts))
            t.copy_(dev.cpu())
        else:
            self._wait(self.pg.broadcast([t], opts))

    def _wait(self, work) -> None:
        t0 = time.perf_counter()
        work.wait()
        self.comm_seconds += time.perf_counter() - t0

    def barrier(self) -> None:
        if self.pg is not None:
            self.all_reduce(torch.zeros(1, device=self.device))

    def shutdown(self) -> None:
        for shm in (self.shm, self.shm_gather, self.shm_bcast):
            if shm is not None:
                shm.close()
        self.pg = self.store = self.shm = self.shm_gather = self.shm_bcast = None
