"""ReclamationBackend: eligibility -> plan -> copies for the worker -> apply_moves -> free blocks.

The copies themselves run in the worker (worker/relocation.py); this side only plans and keeps
the books, and hands the worker a CopyBatch (plain arrays, defined with the step input it travels
in). One plan per request at a time, in three states:

    after_step k   plan eligible requests                          -> pending
    schedule k+1   take_copies(): one CopyBatch, sent in the step input -> in flight
    worker         submits the batch, later reports it complete (in a step's output)
    complete()     after that step's forward: apply_moves, free the emptied blocks -> done

Until a copy completes the token table keeps pointing at the source slots, so attention reads
the old (still valid) copies; sources are not freed and destinations not reused before then
(their blocks are "busy": no eviction frees them, no hole filling writes them). A request that
leaves with a batch in flight has its blocks freed at once; the worker is told to fence the
batch (order the next forward after it) before anything can write those blocks again.

Two triggers. Without pressure, after each step, a request is planned once the dead share of
its candidate blocks passes --kv-frag-threshold (nothing copies while the pool has room to
spare). Under pressure (the scheduler cannot admit or append for lack of blocks), relieve()
plans at a dead share of zero -- any plan that frees a block -- taking the requests whose plans
free the most blocks (then move the fewest tokens) first, until the plans pending and in flight
cover the shortfall; the scheduler then waits for them instead of preempting or refusing.
"""
import itertools
import time
from typing import Dict, List, Optional, Set

import numpy as np

from vllm.config import KVEvictionConfig
from vllm.core.block_manager import BlockManager
from vllm.core.reclaim.eligibility import candidate_blocks, is_eligible
from vllm.core.reclaim.planner import BlockSnapshot, RelocationPlan, plan
from vllm.core.request_kv import RequestKV
from vllm.core.token_table import block_positions
from vllm.worker.step_input import CopyBatch   # a plain value of the step protocol


class ReclamationBackend:
    def __init__(self, config: KVEvictionConfig, block_manager: BlockManager):
        self.config = config
        self.bm = block_manager
        self.pending: Dict[str, RelocationPlan] = {}
        self.in_flight: Dict[str, RelocationPlan] = {}
        self.batch_of: Dict[str, int] = {}
        self.fences: List[int] = []
        self._batch_ids = itertools.count()
        self.events = 0
        self.pressure_events = 0
        self.tokens_moved = 0
        self.blocks_freed = 0
        self.planner_time = 0.0
        self.rewrite_time = 0.0

    def busy_blocks(self, seq_id: str) -> Set[int]:
        p = self.pending.get(seq_id) or self.in_flight.get(seq_id)
        if p is None:
            return set()
        return set(p.freed_blocks) | set(p.dst_blocks)

    def has_plan(self, seq_id: str) -> bool:
        return seq_id in self.pending or seq_id in self.in_flight

    def blocks_coming(self) -> int:
        """Blocks the plans pending and in flight free once their copies complete."""
        return sum(len(p.freed_blocks) for plans in (self.pending, self.in_flight)
                   for p in plans.values())

    # ---- planning --------------------------------------------------------------------------------
    def relieve(self, holding: List[RequestKV], shortfall: int) -> int:
        """holding: the KV of every sequence that holds blocks (so for plan_step)."""
        t0 = time.perf_counter()
        coming = self.blocks_coming()
        if coming < shortfall:
            plans = [p for p in (self._plan(r, frag_threshold=0.0) for r in holding
                                 if not self.has_plan(r.seq_id)) if p is not None]
            plans.sort(key=lambda p: (-len(p.freed_blocks), len(p.token_ids)))
            for p in plans:
                if coming >= shortfall:
                    break
                self.pending[p.seq_id] = p
                self.pressure_events += 1
                coming += len(p.freed_blocks)
        self.planner_time += time.perf_counter() - t0
        return coming

    def plan_step(self, holding: List[RequestKV]) -> None:
        t0 = time.perf_counter()
        for req in holding:
            if req.seq_id not in self.pending and req.seq_id not in self.in_flight:
                p = self._plan(req)
                if p is not None:
                    self.pending[req.seq_id] = p
        self.planner_time += time.perf_counter() - t0

    def _plan(self, req: RequestKV,
              frag_threshold: Optional[float] = None) -> Optional[RelocationPlan]:
        tt = self.bm.token_table
        if tt.num_live(req.seq_id) == tt.length(req.seq_id):
            return None                               # nothing evicted: nothing to repack
        blocks = candidate_blocks(req, self.bm, busy=set())
        if len(blocks) < 2:
            return None
        bs = self.bm.block_size
        ids, slots = tt.live_ids(req.seq_id), tt.live_slots(req.seq_id).astype(np.int64)
        inside = block_positions(slots, blocks, bs) >= 0
        threshold = self.config.frag_threshold if frag_threshold is None else frag_threshold
        if not is_eligible(len(blocks), int(inside.sum()), bs, threshold):
            return None
        snap = BlockSnapshot(req.seq_id, tt.version(req.seq_id), blocks, ids[inside],
                             slots[inside], bs, receivable=~self.bm.cached_mask(blocks))
        return plan(snap)

    # ---- copies (with the scheduler output) ----------------------------------------------------
    def take_copies(self) -> Optional[CopyBatch]:
        batch = CopyBatch(fence=self.fences)
        self.fences = []
        if self.pending:
            plans = list(self.pending.values())
            batch.batch_id = next(self._batch_ids)
            batch.src = np.concatenate([p.src_slots for p in plans]).astype(np.int64)
            batch.dst = np.concatenate([p.dst_slots for p in plans]).astype(np.int64)
            for p in plans:
                self.in_flight[p.seq_id] = p
                self.batch_of[p.seq_id] = batch.batch_id
                self.events += 1
                self.tokens_moved += len(p.token_ids)
            self.pending = {}
        return batch if batch.batch_id is not None or batch.fence else None

    def complete(self, batch_ids: Set[int], requests: Dict[str, RequestKV]) -> None:
        """Batches the worker reports done: repoint their tokens, free the emptied blocks."""
        t0 = time.perf_counter()
        tt = self.bm.token_table
        for seq_id in [s for s, b in self.batch_of.items() if b in batch_ids]:
            p, req = self.in_flight.pop(seq_id), requests[seq_id]
            del self.batch_of[seq_id]
            assert (tt.all_slots(seq_id)[p.token_ids] == p.src_slots).all(), \
                f"request {seq_id}: I4 violated, planned tokens moved by someone else"
            tt.apply_moves(seq_id, p.moves)
            self.bm.free_blocks(req, p.freed_blocks)
            self.blocks_freed += len(p.freed_blocks)
            req.kv_stats["relocated_tokens"] = \
                req.kv_stats.get("relocated_tokens", 0) + len(p.token_ids)
        self.rewrite_time += time.perf_counter() - t0

    def drop(self, seq_id: str) -> None:
        """A request leaves (finish, abort, preemption): forget its plan; fence a sent batch."""
        self.pending.pop(seq_id, None)
        if self.in_flight.pop(seq_id, None) is not None:
            self.fences.append(self.batch_of.pop(seq_id))

    @staticmethod
    def idle_stats() -> Dict[str, float]:
        """The figures of a backend that never ran (Native, Naive-Evict)."""
        return ReclamationBackend(None, None).stats()

    def stats(self) -> Dict[str, float]:
        return {"relocation_events": self.events, "pressure_relocations": self.pressure_events,
                "relocated_tokens": self.tokens_moved,
                "blocks_reclaimed": self.blocks_freed, "planner_time_s": self.planner_time,
                "table_rewrite_time_s": self.rewrite_time}
