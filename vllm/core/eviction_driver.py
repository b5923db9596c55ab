"""EvictionDriver: runs each request's policy after a step and frees blocks with no live token.

The step order of the spec: the new tokens' KV is written and attended (model step), then the
policy reads this step's attention statistics and names dead logical ids, which the token table
hides from the next step on. Blocks are never a policy's business: a block whose tokens are all
dead goes back to the pool here (that is all Naive-Evict can do); repacking partially live
blocks is the reclamation backend's job.

A prompt's chunks are scored together and the policy runs once at the prompt's end. A re-prefill
after preemption is different: the request may have outgrown the pool, so it evicts as it goes
(the first chunk is its "prompt", each later chunk one multi-query "decode" step).
"""
from typing import Callable, Optional, Set

import numpy as np

from vllm.config import KVEvictionConfig
from vllm.core.block_manager import BlockManager
from vllm.core.eviction import EvictionPolicy, make_policy
from vllm.core.step_stats import ScoreRequest, SeqStepStats
from vllm.sequence import Sequence

ALL = 1 << 62     # "every prompt query" as a window length


class EvictionDriver:
    def __init__(self, config: KVEvictionConfig, block_manager: BlockManager,
                 num_layer_heads: int, busy_blocks: Callable[[str], Set[int]]):
        self.config = config
        self.bm = block_manager
        self.num_layer_heads = num_layer_heads
        self.busy_blocks = busy_blocks
        self.evicted_tokens = 0
        self.keep_log = config.keep_eviction_log

    # ---- admission ----------------------------------------------------------------------------
    def policy(self, seq: Sequence) -> Optional[EvictionPolicy]:
        """The request's policy (its own settings or the engine's); None: it never evicts."""
        if seq.policy is None:
            seq.policy = make_policy(seq.kv_config or self.config, seq.seq_id,
                                     self.num_layer_heads)
        return seq.policy

    def evicts(self, seq: Sequence) -> bool:
        return (seq.kv_config or self.config).enabled

    def scored_queries(self, seq: Sequence) -> int:
        """How many of the last prompt queries the policy scores with (0: none, ALL: every)."""
        if not self.evicts(seq):
            return 0
        p = self.policy(seq)
        if not (p.needs_attention_stats and p.needs_prefill_stats):
            return 0
        return ALL if p.prefill_query_window is None else p.prefill_query_window

    def max_cache_hits(self, seq: Sequence) -> Optional[int]:
        """Prefix-cache hits must not skip a query the policy scores with: a hit's queries never
        run, so their attention would be missing and the eviction decisions would change."""
        window = self.scored_queries(seq)
        if window == 0:
            return None
        if seq.num_preemptions:           # a re-prefill scores every chunk
            return 0
        return max(seq.num_tokens - window, 0) // self.bm.block_size

    def on_admit(self, seq: Sequence) -> None:
        if not self.evicts(seq):
            return
        seq.policy_ran = False
        seq.prefill_end = seq.num_tokens
        seq.prefill_colsum = None
        if self.scored_queries(seq) and not seq.num_preemptions:
            seq.prefill_colsum = np.zeros(seq.num_tokens, np.float32)
        if self.keep_log:
            seq.eviction_log = []

    # ---- per step -----------------------------------------------------------------------------
    def request_scores(self, seq: Sequence, num_new: int, req: ScoreRequest) -> None:
        """Add what this sequence's policy reads from a step of num_new tokens to `req`."""
        if not self.evicts(seq):
            return
        p = self.policy(seq)
        req.key_norms |= p.needs_key_norms
        if not p.needs_attention_stats:
            return
        start = seq.num_computed_tokens
        if start >= seq.prefill_end:
            req.decode |= p.needs_decode_stats
            return
        first = self._first_scored(seq, start, num_new)
        if first is not None:
            req.prefill_from[seq.seq_id] = first

    def _first_scored(self, seq: Sequence, start: int, num_new: int) -> Optional[int]:
        """Index in a prompt chunk [start, start + num_new) of its first query the policy scores
        with (None: none of them)."""
        window = self.scored_queries(seq)
        if seq.num_preemptions and seq.policy_ran and not window and \
                self.policy(seq).needs_decode_stats:
            window = ALL                                 # a later re-prefill chunk: a decode step
        if not window:
            return None
        if seq.num_preemptions and start + num_new < seq.prefill_end:
            target = start + num_new                     # evicting as it goes: this chunk
        else:
            target = seq.prefill_end
        first = max(target - window, start) - start
        return first if first < num_new else None

    def after_step(self, row: SeqStepStats) -> None:
        if not self.evicts(row.seq):
            return
        if row.key_norms is not None:
            n = row.seq.num_computed_tokens
            self.policy(row.seq).observe_key_norms(np.arange(n - row.num_new, n), row.key_norms)
        evict = self._run_policy(row)
        if len(evict) == 0:
            return
        seq = row.seq
        if seq.clean_tokens is None:
            seq.clean_tokens = seq.num_computed_tokens
        self.bm.token_table.evict_tokens(seq.seq_id, evict)
        if seq.eviction_log is not None:
            seq.eviction_log.append(evict)
        seq.kv_stats["evicted_tokens"] = seq.kv_stats.get("evicted_tokens", 0) + len(evict)
        self.evicted_tokens += len(evict)
        self.free_dead_blocks(seq)

    def _run_policy(self, r: SeqStepStats) -> np.ndarray:
        seq, policy = r.seq, self.policy(r.seq)
        n = seq.num_computed_tokens
        start = n - r.num_new
        if start >= seq.prefill_end:
            return policy.on_decode(r.view_ids, r.scores, n)
        if seq.num_preemptions:                                   # re-prefill: evict as it goes
            if seq.policy_ran:
                return policy.on_decode(r.view_ids, r.scores, n)
            seq.policy_ran = True
            return policy.on_prefill(r.view_ids, r.scores, n)
        if seq.prefill_colsum is not None and r.scores is not None and \
                self._first_scored(seq, start, r.num_new) is not None:
            seq.prefill_colsum[r.view_ids] += r.scores
        if n < seq.prefill_end:
            return np.empty(0, np.int64)                          # defer to the prompt's end
        colsum = None if seq.prefill_colsum is None else seq.prefill_colsum[r.view_ids]
        seq.prefill_colsum = None
        return policy.on_prefill(r.view_ids, colsum, n)

    def free_dead_blocks(self, seq: Sequence) -> None:
        tt = self.bm.token_table
        occupancy = tt.block_occupancy(seq.seq_id, seq.block_ids)
        keep = {tt.tail_block(seq.seq_id)} | self.busy_blocks(seq.seq_id)
        dead = [b for b, live in zip(seq.block_ids, occupancy) if live == 0 and b not in keep]
        self.bm.free_blocks(seq, dead)
