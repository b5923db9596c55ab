"""RelocationExecutor: copies K and V of every layer for all of a step's moves in one launch.

    kv_caches  [num_layers, num_slots, 2, kv_heads, head_dim]
    kv_caches[:, dst] = kv_caches[:, src]        one batched gather/scatter over every layer

Protocol (one event per batch; the batches come with the scheduler output, see
core/reclaim/backend.py):

    engine step k   after the forward the KV manager plans relocation (pending)
    engine step k+1 schedule -> CopyBatch in the StepInput -> worker: fence, submit(id, src,
                    dst), poll, pre_attention() -> forward (views still read the sources,
                    which stay valid) -> completed ids in the StepOutput -> KV manager:
                    apply_moves + free blocks
    engine step k+2 views read the destinations (the compute stream waited on them at k+1)

On CUDA the copy runs on a side stream that first waits for the compute stream (the sources were
written by earlier forwards), and records an event. Nothing on the host waits: the worker
polls `query()`, and only a completed batch has its moves applied, so attention
reads the old slots until then. `pre_attention()` makes the compute stream wait (a stream wait,
never a device synchronize) on the batches completed since the last call, i.e. on every batch
whose new slots the next attention may read (I3). Batches complete in submission order on the
one side stream, so waiting on the newest completed event covers all of them. On CPU the copy
is synchronous and the event completes at once: the same state machine, with no-op waits.

`force_sync` (ablation) blocks the host on each batch at submit; the time blocked on the device
is `blocked_time`. `DelayedRelocationExecutor` (tests) lands each copy N steps after submit.
"""
import time
from typing import Dict, List, Optional, Set

import torch

from vllm.kernels import ops
from vllm.attention import kv_quant


class CopyEvent:
    """A completed copy (CPU). query() polls, synchronize() blocks, wait(stream) orders a stream."""

    def __init__(self, done: bool = True):
        self._done = done

    def query(self) -> bool:
        return self._done

    def synchronize(self) -> None:
        self._done = True

    def wait(self, stream=None) -> None:
        """Make `stream` (default: current) wait for the copy; no-op off CUDA."""


class CudaCopyEvent(CopyEvent):
    def __init__(self, owner: "RelocationExecutor", number: int, start, end, keepalive):
        super().__init__(done=False)
        self.owner, self.number, self.start, self.end = owner, number, start, end
        self._keepalive = keepalive          # index tensors the copy still reads

    def query(self) -> bool:
        if not self._done and self.end.query():
            self._retire()
        return self._done

    def synchronize(self) -> None:
        if not self._done:
            t0 = time.perf_counter()
            self.end.synchronize()
            self.owner.blocked_time += time.perf_counter() - t0
            self._retire()

    def wait(self, stream=None) -> None:
        (stream or torch.cuda.current_stream(self.end.device)).wait_event(self.end)

    def _retire(self) -> None:
        self._done = True
        self._keepalive = None
        self.owner.device_time += self.start.elapsed_time(self.end) / 1e3
        newest = self.owner.newest_completed
        if newest is None or newest.number < self.number:
            self.owner.newest_completed = self


class RelocationExecutor:
    """Copy batches by id: submit(id, src, dst), poll() -> completed ids, fence(ids).

    check=True (--kv-check-invariants) verifies I1 on every batch as it completes: the
    destination slots hold exactly the bytes the source slots held at submit, in every layer.
    """

    def __init__(self, kv_caches: torch.Tensor, force_sync: bool = False,
                 backend: Optional[str] = None, check: bool = False):
        self.kv_caches = kv_caches
        self.force_sync = force_sync
        self.backend = backend                 # None: kernels/ops.py picks (see its table)
        self.check = check
        self.stream = torch.cuda.Stream(kv_caches.device) if kv_caches.is_cuda else None
        if kv_caches.is_cuda and backend in (None, "cuda"):
            ops._available("cuda")             # JIT-build the CUDA op now, not at the first copy
        self.copy_time = 0.0                   # host seconds inside submit (CPU: the copy itself)
        self.blocked_time = 0.0                # host seconds blocked waiting for the device
        self.device_time = 0.0                 # device seconds of completed copies (CUDA)
        self.launches = 0
        self.slots_moved = 0
        self.newest_completed: Optional[CudaCopyEvent] = None   # since the last pre_attention
        self.in_flight: Dict[int, CopyEvent] = {}
        self._before: Dict[int, tuple] = {}    # I1: batch id -> (dst, payload at submit)

    def submit(self, batch_id: int, src: torch.Tensor, dst: torch.Tensor) -> CopyEvent:
        if self.check:
            self._before[batch_id] = (dst.clone(), self.kv_caches[:, src].clone())
        t0 = time.perf_counter()
        event = self._launch(src, dst)
        self.copy_time += time.perf_counter() - t0
        self.launches += 1
        self.slots_moved += len(src)
        if self.force_sync:
            event.synchronize()
        self.in_flight[batch_id] = event
        return event

    def _launch(self, src: torch.Tensor, dst: torch.Tensor) -> CopyEvent:
        if self.stream is None:
            ops.relocate_kv(self.kv_caches, src, dst, self.backend)
            return CopyEvent(done=True)
        return self._submit_cuda(src, dst)

    def _submit_cuda(self, src: torch.Tensor, dst: torch.Tensor) -> CudaCopyEvent:
        device = self.kv_caches.device
        self.stream.wait_stream(torch.cuda.current_stream(device))
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            idx = torch.stack([src, dst]).to(torch.int64)
            idx = idx.pin_memory().to(device, non_blocking=True) if not idx.is_cuda else idx
            start.record()
            ops.relocate_kv(self.kv_caches, idx[0], idx[1], self.backend)
            end.record()
        return CudaCopyEvent(self, self.launches, start, end, keepalive=idx)

    def execute(self, copies) -> Set[int]:
        """One engine step's worth: fence, submit the step's CopyBatch (may be None), poll ->
        ids of batches completed since the last call; the next attention waits on them (I3)."""
        if copies is not None:
            self.fence(copies.fence)
            if copies.batch_id is not None:
                self.submit(copies.batch_id, torch.from_numpy(copies.src),
                            torch.from_numpy(copies.dst))
        done = self.poll()
        self.pre_attention()
        return done

    def step(self) -> None:
        """Called once per engine step, before polling (advances simulated delays)."""

    def poll(self) -> Set[int]:
        self.step()
        done = {b for b, e in self.in_flight.items() if e.query()}
        for b in done:
            del self.in_flight[b]
            if self.check:
                self._check_conservation(b)
        return done

    def fence(self, batch_ids: List[int]) -> None:
        """Blocks of these batches' requests were freed: order the next writer after them."""
        for b in batch_ids:
            event = self.in_flight.get(b)
            if event is not None:
                event.wait()

    def _check_conservation(self, batch_id: int) -> None:
        dst, before = self._before.pop(batch_id)
        if not torch.equal(kv_quant.bytes_(self.kv_caches)[:, dst], kv_quant.bytes_(before)):
            raise AssertionError(f"relocation batch {batch_id}: I1 violated, the moved tokens' "
                                 f"K/V differ from their sources")

    def pre_attention(self, stream=None) -> None:
        """Call before the next attention (or graph replay): the compute stream waits on the
        batches completed since the last call, whose moves the KV manager may have applied."""
        if self.newest_completed is not None:
            self.newest_completed.wait(stream)
            self.newest_completed = None

    def sleep(self) -> None:
        """The pool is about to be released: wait for the copies still running, then keep only
        the pool's shape and dtype (a meta tensor: stats() still answers, no copy can run)."""
        for event in self.in_flight.values():
            event.synchronize()
        self.in_flight.clear()
        self._before.clear()
        self.newest_completed = None
        self.kv_caches = self.kv_caches.to("meta")

    def wake_up(self, kv_caches: torch.Tensor) -> None:
        """Copy within the new pool from now on (its shape is the released one's)."""
        assert kv_caches.shape == self.kv_caches.shape, "the pool came back in another shape"
        self.kv_caches = kv_caches

    def stats(self) -> dict:
        slot_bytes = self.kv_caches[:, 0].numel() * self.kv_caches.element_size()
        return {"copy_launches": self.launches, "copy_time_s": self.copy_time,
                "copy_blocked_s": self.blocked_time, "copy_device_s": self.device_time,
                "bytes_moved": self.slots_moved * slot_bytes}


class _DelayedEvent(CopyEvent):
    def __init__(self, executor: "DelayedRelocationExecutor", src, dst, steps: int):
        super().__init__(done=False)
        self.executor, self.src, self.dst, self.steps_left = executor, src, dst, steps

    def land(self) -> None:
        if not self._done:
            ops.relocate_kv(self.executor.kv_caches, self.src, self.dst)
            self._done = True
            self.executor.landed += 1

    def synchronize(self) -> None:
        self.land()

    def wait(self, stream=None) -> None:
        self.land()          # whatever runs after this sees the copy


class DelayedRelocationExecutor(RelocationExecutor):
    """The copy lands N engine steps after submit (0: at once). Until then the destination
    slots hold poison (NaN), so any attention that read them early would corrupt the output."""

    def __init__(self, kv_caches: torch.Tensor, delay_steps: int, check: bool = True):
        super().__init__(kv_caches, check=check)
        self.delay_steps = delay_steps
        self.pending: List[_DelayedEvent] = []
        self.fresh: List[_DelayedEvent] = []      # submitted this step: their count starts next
        self.landed = 0

    def _launch(self, src: torch.Tensor, dst: torch.Tensor) -> CopyEvent:
        if kv_quant.is_fp8(self.kv_caches):     # 0x7f: NaN in e4m3fn and in e5m2
            kv_quant.bytes_(self.kv_caches)[:, dst] = 0x7F
        else:
            self.kv_caches[:, dst] = float("nan")
        event = _DelayedEvent(self, src.clone(), dst.clone(), self.delay_steps)
        if self.delay_steps <= 0:
            event.land()
        else:
            self.fresh.append(event)
        return event

    def step(self) -> None:
        for event in self.pending:
            event.steps_left -= 1
            if event.steps_left <= 0:
                event.land()
        self.pending = [e for e in self.pending + self.fresh if not e.query()]
        self.fresh = []
