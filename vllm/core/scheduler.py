"""Scheduler: continuous batching, chunked prefill, FCFS, preemption by recompute.

Each step hands out a token budget (--max-num-batched-tokens): running sequences first (one
decode token each, or the next chunk of an unfinished prefill), then waiting sequences in
arrival order. When blocks run out, the most recently admitted running sequence is preempted:
its blocks and token table are freed and it is prefilled again later (prompt + generated).
"""
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, Iterable, List, Tuple

from vllm.config import SchedulerConfig
from vllm.core.block_manager import BlockManager
from vllm.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: List[Tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)
    preempted: List[Sequence] = field(default_factory=list)
    ended: List[Sequence] = field(default_factory=list)   # could never grow: finished as "length"

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 headroom_blocks: int = 0):
        self.config = config
        self.block_manager = block_manager
        self.headroom_blocks = headroom_blocks    # kept free for relocation before admitting
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
            self.block_manager.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = status
        seq.finish_reason = "abort" if status == SequenceStatus.FINISHED_ABORTED else status.value

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._make_room(seq, n, out):
                break
            bm.append_slots(seq, n)
            out.scheduled.append((seq, n))
            budget -= n
            i += 1
        return budget

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Preempt from the back of the running list until seq can append n tokens."""
        while not self.block_manager.can_append(seq, n):
            victim = self.running.pop()
            if victim is seq and not self.running:
                # Alone and still out of blocks: it can never grow further.
                self.running.append(seq)
                self.finish(seq, SequenceStatus.FINISHED_LENGTH)
                out.ended.append(seq)
                return False
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hits = bm.computed_blocks(seq)
            remaining = seq.num_tokens - len(hits) * bm.block_size
            n = min(remaining, budget)
            if n < remaining and not self.config.enable_chunked_prefill:
                break
            if not bm.can_allocate(seq, hits, n, reserve=self.headroom_blocks):
                break
            self.waiting.popleft()
            bm.allocate(seq, hits, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
