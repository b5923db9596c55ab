"""ReclamationBackend: eligibility -> plan -> one batched copy -> apply_moves -> free blocks.

Per step: poll in-flight copies (apply the moves and free emptied blocks of every completed
plan), then plan eligible requests and submit all of this step's moves in one executor call.
Until a copy completes, the token table keeps pointing at the source slots, so attention reads
the old (still valid) copies; sources are not freed and destinations not reused before then.
"""
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
import torch

from vllm.config import KVEvictionConfig
from vllm.core.block_manager import BlockManager
from vllm.core.reclaim.eligibility import candidate_blocks, is_eligible
from vllm.core.reclaim.planner import BlockSnapshot, RelocationPlan, plan
from vllm.sequence import Sequence


@dataclass
class InFlight:
    seq: Sequence
    plan: RelocationPlan
    event: object
    kv_before: Optional[torch.Tensor] = None    # I1 check: payload of the plan-time live tokens
    ids_before: Optional[np.ndarray] = None


class ReclamationBackend:
    def __init__(self, config: KVEvictionConfig, block_manager: BlockManager, executor,
                 check_invariants: bool = False):
        self.config = config
        self.bm = block_manager
        self.executor = executor
        self.check_invariants = check_invariants
        self.in_flight: Dict[str, InFlight] = {}
        self.events = 0
        self.tokens_moved = 0
        self.blocks_freed = 0
        self.planner_time = 0.0
        self.rewrite_time = 0.0
        bytes_per_slot = executor.kv_caches[:, 0].numel() * executor.kv_caches.element_size()
        self.bytes_per_token = bytes_per_slot
        block_manager.before_free.append(self.before_free)

    def busy_blocks(self, seq_id: str) -> set:
        f = self.in_flight.get(seq_id)
        if f is None:
            return set()
        return set(f.plan.freed_blocks) | set(f.plan.dst_blocks)

    # ---- per step -----------------------------------------------------------------------------
    def step(self, running: List[Sequence]) -> None:
        self.executor.step()
        self._complete_finished()
        t0 = time.perf_counter()
        plans = [p for p in (self._plan(s) for s in running if s.seq_id not in self.in_flight) if p]
        self.planner_time += time.perf_counter() - t0
        if plans:
            self._submit(plans, {s.seq_id: s for s in running})
            self._complete_finished()

    def _plan(self, seq: Sequence) -> Optional[RelocationPlan]:
        blocks = candidate_blocks(seq, self.bm, busy=set())
        if len(blocks) < 2:
            return None
        tt, bs = self.bm.token_table, self.bm.block_size
        ids, slots = tt.live_ids(seq.seq_id), tt.live_slots(seq.seq_id).astype(np.int64)
        # which live slots lie in a candidate block: a lookup table over block ids, not a sort
        is_candidate = np.zeros(max(int(slots.max(initial=0)) // bs, int(blocks.max())) + 1, bool)
        is_candidate[blocks] = True
        inside = is_candidate[slots // bs]
        if not is_eligible(seq, len(blocks), int(inside.sum()), bs, self.config.frag_threshold):
            return None
        snap = BlockSnapshot(seq.seq_id, tt.version(seq.seq_id), blocks, ids[inside],
                             slots[inside], bs)
        return plan(snap)

    def _submit(self, plans: List[RelocationPlan], seqs: Dict[str, Sequence]) -> None:
        src = torch.from_numpy(np.concatenate([p.src_slots for p in plans]))
        dst = torch.from_numpy(np.concatenate([p.dst_slots for p in plans]))
        snapshots = {p.seq_id: self._payload(p.seq_id) for p in plans} if self.check_invariants \
            else {}
        for p in plans:      # receiving blocks stop matching their prefix-cache hash
            for b in p.dst_blocks:
                self.bm.pool.uncache(b)
        event = self.executor.submit(src, dst)
        for p in plans:
            kv, ids = snapshots.get(p.seq_id, (None, None))
            self.in_flight[p.seq_id] = InFlight(seqs[p.seq_id], p, event, kv, ids)
            self.events += 1
            self.tokens_moved += len(p.token_ids)

    def _complete_finished(self) -> None:
        for seq_id in [s for s, f in self.in_flight.items() if f.event.query()]:
            f = self.in_flight.pop(seq_id)
            t0 = time.perf_counter()
            tt = self.bm.token_table
            assert (tt.slots(seq_id, 0, tt.length(seq_id))[f.plan.token_ids] == f.plan.src_slots).all(), \
                f"request {seq_id}: I4 violated, planned tokens moved by someone else"
            tt.apply_moves(seq_id, f.plan.moves)
            self.bm.free_blocks(f.seq, f.plan.freed_blocks)
            self.blocks_freed += len(f.plan.freed_blocks)
            f.seq.kv_stats["relocated_tokens"] = \
                f.seq.kv_stats.get("relocated_tokens", 0) + len(f.plan.token_ids)
            self.rewrite_time += time.perf_counter() - t0
            if f.kv_before is not None:
                self._check_conservation(f)

    def before_free(self, seq: Sequence) -> None:
        """A request leaving (finish, abort, preemption) waits for its copy, then drops the plan."""
        f = self.in_flight.pop(seq.seq_id, None)
        if f is not None:     # the blocks' next writer runs on the compute stream: order it after
            f.event.wait()

    # ---- invariant I1 -------------------------------------------------------------------------
    def _payload(self, seq_id: str):
        tt = self.bm.token_table
        ids = tt.live_ids(seq_id).copy()
        slots = torch.from_numpy(tt.live_slots(seq_id).astype(np.int64))
        return self.executor.kv_caches[:, slots].clone(), ids

    def _check_conservation(self, f: InFlight) -> None:
        tt = self.bm.token_table
        now_ids = tt.live_ids(f.plan.seq_id)
        still = np.isin(f.ids_before, now_ids)
        slots = tt.slots(f.plan.seq_id, 0, tt.length(f.plan.seq_id))[f.ids_before[still]]
        after = self.executor.kv_caches[:, torch.from_numpy(slots.astype(np.int64))]
        if not torch.equal(after, f.kv_before[:, torch.from_numpy(still)]):
            raise AssertionError(f"request {f.plan.seq_id}: I1 violated, live tokens' K/V changed "
                                 f"across relocation")

    def stats(self) -> Dict[str, float]:
        return {"relocation_events": self.events, "relocated_tokens": self.tokens_moved,
                "bytes_moved": self.tokens_moved * self.bytes_per_token,
                "blocks_reclaimed": self.blocks_freed, "planner_time_s": self.planner_time,
                "copy_time_s": self.executor.copy_time, "table_rewrite_time_s": self.rewrite_time,
                "copy_launches": self.executor.launches}
