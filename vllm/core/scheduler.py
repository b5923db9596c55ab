"""Scheduler: continuous batching, chunked prefill, FCFS, preemption by recompute.

Each step hands out a token budget (--max-num-batched-tokens): running sequences first (one
decode token each, or the next chunk of an unfinished prefill), then waiting sequences in
arrival order. When blocks run out and vToken reclaims, the KV manager first plans repacking
for the shortfall (KVManager.relieve): if the copies under way will free enough blocks, the
request waits a step for them (a running one is skipped this step, a waiting one stays first in
line) instead of being preempted or refused. Otherwise the most recently admitted running
sequence without a repacking plan (the last one if all have one) is preempted: its blocks and
token table are freed and it is prefilled again later (prompt + generated): beside running
requests, once its whole prefill fits, not on a first chunk that a later chunk's shortfall would
preempt again.

Under eviction a request's logical length can exceed the pool. Its re-prefill then runs in
bounded chunks and evicts after each (KVManager.chunk_bound); a request that cannot grow
even with the pool to itself is finished as FINISHED_KV_EXHAUSTED, never retried forever.
"""
import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Iterable, List, Optional, Tuple

from vllm.config import SchedulerConfig
from vllm.core.kv_manager import KVManager
from vllm.core.reclaim.backend import CopyBatch
from vllm.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: List[Tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)
    preempted: List[Sequence] = field(default_factory=list)
    ended: List[Sequence] = field(default_factory=list)     # finished here (KV exhausted)
    copies: Optional[CopyBatch] = None                      # relocation copies for the worker

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Room(enum.Enum):
    YES = "yes"          # the sequence can append now
    LATER = "later"      # repacking under way frees the blocks: skip it this step
    GONE = "gone"        # preempted or finished: it left the running list


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager):
        self.config = config
        self.kv = kv
        self.waiting: Deque[Sequence] = deque()
        self.running: List[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq_ids: Iterable[str]) -> List[Sequence]:
        ids = set(seq_ids)
        aborted = [s for s in list(self.waiting) + self.running if s.seq_id in ids]
        for seq in aborted:
            self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return aborted

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = status
        seq.finish_reason = "abort" if status == SequenceStatus.FINISHED_ABORTED else status.value

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.copies = self.kv.take_copies()
        return out

    def _chunk(self, seq: Sequence, remaining: int, budget: int) -> int:
        bound = self.kv.chunk_bound(seq)
        return min(remaining, budget, bound if bound is not None else remaining)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, seq.num_tokens - seq.num_computed_tokens, budget)
            room = self._make_room(i, n, out)
            if room is Room.GONE:
                continue             # seq left the running list; the next one slid into i
            if room is Room.LATER:
                i += 1
                continue
            self.kv.append_slots(seq, n)
            out.scheduled.append((seq, n))
            budget -= n
            i += 1
        return budget

    def _make_room(self, i: int, n: int, out: SchedulerOutput) -> Room:
        """Until running[i] can append n tokens: wait for repacking that covers the shortfall,
        else preempt from running[i:] (not yet scheduled this step)."""
        seq = self.running[i]
        while True:
            shortfall = self.kv.append_shortfall(seq, n)
            if shortfall == 0:
                return Room.YES
            if self.kv.relieve(shortfall) >= shortfall:
                return Room.LATER
            if len(self.running) == 1:                 # alone and still out of blocks
                if self.kv.will_free(seq.seq_id):
                    return Room.LATER                  # its own repacking frees some
                self._exhausted(seq, out)
                return Room.GONE
            victim = self._victim(i)
            self.running.remove(victim)
            self._preempt(victim, out)
            if victim is seq:
                return Room.GONE

    def _victim(self, i: int) -> Sequence:
        """The most recently admitted of running[i:] without a repacking plan (whose blocks
        are about to come back anyway), or the most recent one if all have plans."""
        later = self.running[i:]
        return next((s for s in reversed(later) if not self.kv.will_free(s.seq_id)), later[-1])

    def _exhausted(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.finish(seq, SequenceStatus.FINISHED_KV_EXHAUSTED)
        out.ended.append(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.kv.preempt(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        kv = self.kv
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hits = kv.computed_blocks(seq)
            remaining = seq.num_tokens - len(hits) * kv.block_size
            n = self._chunk(seq, remaining, budget)
            if n < remaining and not self.config.enable_chunked_prefill \
                    and kv.chunk_bound(seq) is None:
                break
            # beside running requests, a preempted one is admitted once all of its prefill
            # fits (KVManager.admission_tokens); alone, on its first chunk
            need = kv.admission_tokens(seq, remaining, n) if self.running else n
            shortfall = kv.allocate_shortfall(seq, hits, need)
            if shortfall:
                if not self.running and not out.scheduled:
                    self._exhausted(self.waiting[0], out)   # the whole pool is not enough
                    continue
                kv.relieve(shortfall)    # repacking under way: admitted once it lands
                break
            self.waiting.popleft()
            kv.allocate(seq, hits, n)
            seq.first_scheduled_time = seq.first_scheduled_time or time.monotonic()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
