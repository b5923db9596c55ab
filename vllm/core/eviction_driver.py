"""EvictionDriver: runs each request's policy after a step and frees blocks with no live token.

The step order of the spec: the new tokens' KV is written and attended (model step), then the
policy reads this step's attention statistics and names dead logical ids, which the token table
hides from the next step on. Blocks are never a policy's business: a block whose tokens are all
dead goes back to the pool here (that is all Naive-Evict can do); repacking partially live
blocks is the reclamation backend's job.

A prompt's chunks are scored together and the policy runs once at the prompt's end, unless the
request streams: with --kv-prefill-chunk N, or in a re-prefill after preemption (the request may
have outgrown the pool), it evicts as it goes (the first chunk is its "prompt", each later chunk one
multi-query "decode" step), so a long prompt never holds more than its budget plus one chunk.

Under --kv-evict-scope generated the first prompt holds nothing the policy may evict: it is not
scored (every policy takes prefix-cache hits on it), not streamed, and the policy first runs on
the first generated token. A re-prefill after preemption holds generated tokens, so it runs as
under scope all.

Each method takes the Sequence (its tokens, preemptions) and its RequestKV (policy state, block
list, figures), which it reads and writes.
"""
from typing import Callable, Optional, Set

import numpy as np

from vllm.config import KVEvictionConfig
from vllm.core.block_manager import BlockManager
from vllm.core.eviction import EvictionPolicy, make_policy
from vllm.core.request_kv import RequestKV
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
    def policy(self, seq: Sequence, req: RequestKV) -> Optional[EvictionPolicy]:
        """The request's policy (its own settings or the engine's); None: it never evicts."""
        if req.policy is None:
            req.policy = make_policy(req.kv_config, seq.seq_id, self.num_layer_heads,
                                     seq.num_prompt_tokens)
        return req.policy

    @staticmethod
    def evicts(req: RequestKV) -> bool:
        return req.kv_config.enabled

    @staticmethod
    def prompt_only(seq: Sequence, req: RequestKV) -> bool:
        """This admission prefills the prompt alone under scope generated: nothing to evict."""
        return req.kv_config.scope == "generated" and not seq.num_preemptions

    def streams(self, seq: Sequence, req: RequestKV) -> bool:
        """Its prompt (or re-prefill) evicts chunk by chunk instead of once at the end."""
        return self.evicts(req) and not self.prompt_only(seq, req) and (
            seq.num_preemptions > 0 or req.kv_config.prefill_chunk is not None)

    def scored_queries(self, seq: Sequence, req: RequestKV) -> int:
        """How many of the last prompt queries the policy scores with (0: none, ALL: every)."""
        if not self.evicts(req) or self.prompt_only(seq, req):
            return 0
        p = self.policy(seq, req)
        if not (p.needs_attention_stats and p.needs_prefill_stats):
            return 0
        return ALL if p.prefill_query_window is None else p.prefill_query_window

    def max_cache_hits(self, seq: Sequence, req: RequestKV) -> Optional[int]:
        """Prefix-cache hits must not skip a query the policy scores with: a hit's queries never
        run, so their attention would be missing and the eviction decisions would change."""
        if not self.evicts(req) or self.prompt_only(seq, req):
            return None
        if req.kv_config.prefill_chunk is not None:
            return 0                      # a hit would move where the chunks (and evictions) fall
        window = self.scored_queries(seq, req)
        if window == 0:
            return None
        if seq.num_preemptions:           # a re-prefill scores every chunk
            return 0
        return max(seq.num_tokens - window, 0) // self.bm.block_size

    def on_admit(self, seq: Sequence, req: RequestKV) -> None:
        if not self.evicts(req):
            return
        req.policy_ran = False
        req.prefill_end = seq.num_tokens
        req.prefill_colsum = None
        if self.scored_queries(seq, req) and not seq.num_preemptions:
            req.prefill_colsum = np.zeros(seq.num_tokens, np.float32)
        if self.keep_log:
            req.eviction_log = []

    # ---- per step -----------------------------------------------------------------------------
    def request_scores(self, seq: Sequence, req: RequestKV, num_new: int,
                       asked: ScoreRequest) -> None:
        """Add what this sequence's policy reads from a step of num_new tokens to `asked`."""
        if not self.evicts(req):
            return
        p = self.policy(seq, req)
        if p.key_statistic is not None and self._evicts_after(seq, req, num_new):
            asked.key_statistic[seq.seq_id] = p.key_statistic
        if not p.needs_attention_stats:
            return
        start = seq.num_computed_tokens
        if start >= req.prefill_end:
            asked.decode |= p.needs_decode_stats
            return
        first = self._first_scored(seq, req, start, num_new)
        if first is not None:
            asked.prefill_from[seq.seq_id] = first

    def _evicts_after(self, seq: Sequence, req: RequestKV, num_new: int) -> bool:
        """The policy runs after this step and the request will be over its budget."""
        start, n = seq.num_computed_tokens, seq.num_computed_tokens + num_new
        runs = start >= req.prefill_end or n >= self._segment_end(seq, req, start, num_new)
        if not runs:
            return False
        p = self.policy(seq, req)  # under scope generated the prompt is all live, not counted
        counted = self.bm.token_table.num_live(seq.seq_id) - min(p.scope_start, n)
        return p.over_budget(counted, n) > 0

    def _segment_end(self, seq: Sequence, req: RequestKV, start: int, num_new: int) -> int:
        """The prompt position after which the policy next runs, for a chunk starting at
        `start`: the prompt's end; with --kv-prefill-chunk C the next multiple of C (fixed
        positions, so batching never moves them); in a re-prefill the end of each chunk."""
        if seq.num_preemptions:
            return start + num_new
        chunk = req.kv_config.prefill_chunk
        if chunk is None or self.prompt_only(seq, req):
            return req.prefill_end
        return min((start // chunk + 1) * chunk, req.prefill_end)

    def _first_scored(self, seq: Sequence, req: RequestKV, start: int,
                      num_new: int) -> Optional[int]:
        """Index in a prompt chunk [start, start + num_new) of its first query the policy scores
        with (None: none of them)."""
        window = self.scored_queries(seq, req)
        if self.streams(seq, req) and req.policy_ran and not window and \
                self.policy(seq, req).needs_decode_stats:
            window = ALL                                 # a later streamed segment: a decode step
        if not window:
            return None
        first = max(self._segment_end(seq, req, start, num_new) - window, start) - start
        return first if first < num_new else None

    def after_step(self, row: SeqStepStats, req: RequestKV) -> None:
        if not self.evicts(req):
            return
        seq, policy = row.seq, self.policy(row.seq, req)
        if row.key_statistic is not None:
            policy.observe_key_statistic(row.view_ids, row.key_statistic)
        evict = self._run_policy(row, req)
        req.kv_stats["budget_tokens"] = policy.scope_start + policy.budget(seq.num_computed_tokens)
        if len(evict) == 0:
            return
        if req.clean_tokens is None:
            req.clean_tokens = seq.num_computed_tokens
        self.bm.token_table.evict_tokens(seq.seq_id, evict)
        if req.eviction_log is not None:
            req.eviction_log.append(evict)
        req.kv_stats["evicted_tokens"] = req.kv_stats.get("evicted_tokens", 0) + len(evict)
        self.evicted_tokens += len(evict)
        self.free_dead_blocks(req)

    def _run_policy(self, r: SeqStepStats, req: RequestKV) -> np.ndarray:
        seq, policy = r.seq, self.policy(r.seq, req)
        n = seq.num_computed_tokens
        start = n - r.num_new
        if start >= req.prefill_end:   # scores may be there for another request's policy
            return policy.on_decode(r.view_ids,
                                    r.scores if policy.needs_decode_stats else None, n)
        scored = self._first_scored(seq, req, start, r.num_new) is not None
        scores = r.scores if scored else None          # (a decode row may bring unasked mass)
        if req.prefill_colsum is not None:             # a segment's chunks are scored together
            if scores is not None:
                req.prefill_colsum[r.view_ids] += scores
            scores = req.prefill_colsum[r.view_ids]   # a copy
        if n < self._segment_end(seq, req, start, r.num_new):
            return np.empty(0, np.int64)                          # defer to the segment's end
        if req.prefill_colsum is not None:
            req.prefill_colsum = None if n >= req.prefill_end else \
                np.zeros_like(req.prefill_colsum)
        if req.policy_ran:                             # a later segment of a streamed prompt
            return policy.on_decode(r.view_ids, scores, n)
        req.policy_ran = True
        if self.prompt_only(seq, req):                 # nothing it may evict (not scored)
            return np.empty(0, np.int64)
        return policy.on_prefill(r.view_ids, scores, n)

    def free_dead_blocks(self, req: RequestKV) -> None:
        tt = self.bm.token_table
        occupancy = tt.block_occupancy(req.seq_id, req.block_ids)
        keep = {tt.tail_block(req.seq_id)} | self.busy_blocks(req.seq_id)
        dead = [b for b, live in zip(req.block_ids, occupancy) if live == 0 and b not in keep]
        self.bm.free_blocks(req, dead)
