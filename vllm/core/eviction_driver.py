"""EvictionDriver: runs each request's policy after a step and frees blocks with no live token.

The step order of the spec: the new tokens' KV is written and attended (model step), then the
policy reads this step's attention statistics and names dead logical ids, which the token table
hides from the next step on. Blocks are never a policy's business: a block whose tokens are all
dead goes back to the pool here (that is all Naive-Evict can do); repacking partially live
blocks is the reclamation backend's job.
"""
from typing import Dict, List, Optional

import numpy as np

from vllm.attention.backend import AttentionMetadata
from vllm.config import KVEvictionConfig
from vllm.core.block_manager import BlockManager
from vllm.core.eviction import POLICY_CLASSES, make_policy
from vllm.sequence import Sequence


class EvictionDriver:
    def __init__(self, config: KVEvictionConfig, block_manager: BlockManager,
                 num_layer_heads: int):
        self.config = config
        self.bm = block_manager
        self.num_layer_heads = num_layer_heads
        cls = POLICY_CLASSES.get(config.policy)
        self.needs_stats = bool(cls and cls.needs_attention_stats)
        self.evicted_tokens = 0
        self.busy_blocks = lambda seq_id: set()     # set by the reclamation backend

    def after_step(self, rows, meta: AttentionMetadata) -> None:
        """rows: the step's StepRows; num_computed_tokens already includes this step."""
        for r in rows:
            evict = self._run_policy(r, meta)
            if len(evict):
                self.bm.token_table.evict_tokens(r.seq.seq_id, evict)
                r.seq.eviction_log.append(evict)
                r.seq.kv_stats["evicted_tokens"] = \
                    r.seq.kv_stats.get("evicted_tokens", 0) + len(evict)
                self.evicted_tokens += len(evict)
                self.free_dead_blocks(r.seq)

    def _run_policy(self, r, meta: AttentionMetadata) -> np.ndarray:
        seq = r.seq
        if seq.policy is None:       # admission or re-prefill after preemption
            seq.policy = make_policy(self.config, seq.seq_id, self.num_layer_heads)
            seq.prefill_end = seq.num_tokens
            seq.prefill_colsum = np.zeros(seq.num_tokens, np.float32) if self.needs_stats else None
        stats = self._stats(r, meta)
        n = seq.num_computed_tokens
        if n - r.num_new < seq.prefill_end:                       # a prompt chunk
            if stats is not None:
                seq.prefill_colsum[r.view_ids] += stats
            if n < seq.prefill_end:
                return np.empty(0, np.int64)                      # defer to the prompt's end
            colsum = seq.prefill_colsum[r.view_ids] if stats is not None else None
            seq.prefill_colsum = None
            return seq.policy.on_prefill(r.view_ids, colsum, n)
        return seq.policy.on_decode(r.view_ids, stats, n)

    def _stats(self, r, meta: AttentionMetadata) -> Optional[np.ndarray]:
        if not meta.collect_stats:
            return None
        if r.is_decode:
            return meta.decode_mass[r.stats_row, :len(r.view_ids)].numpy()
        return meta.prefill_colsum[r.stats_row].numpy()

    def free_dead_blocks(self, seq: Sequence) -> None:
        tt = self.bm.token_table
        occupancy = tt.block_occupancy(seq.seq_id, seq.block_ids)
        keep = {tt.tail_block(seq.seq_id)} | self.busy_blocks(seq.seq_id)
        dead = [b for b, live in zip(seq.block_ids, occupancy) if live == 0 and b not in keep]
        self.bm.free_blocks(seq, dead)
