"""KVManager: the one owner of the KV state.

It builds and owns the block manager (pool, prefix cache, token tables), the eviction driver,
the reclamation backend, the hole filler and the monitor, and holds the one busy-block rule.

    scheduler -> can_allocate / allocate / can_append / append_slots / free, take_copies,
                 relieve(shortfall) when the pool is short
    engine    -> after_step(StepStats), copies_done(batch ids), stats(), check_invariants()
    runner    <- score_request(scheduled): which attention statistics the step must collect

Nothing here imports the worker's code or attention: statistics come in as plain arrays
(StepStats), copies go out as plain arrays (CopyBatch, a value of the worker's step protocol,
vllm/worker/step_input.py, which imports numpy only) with the scheduler output.
"""
from typing import Dict, List, Optional, Set, Tuple

from vllm.config import KVEvictionConfig
from vllm.core.block_manager import BlockManager
from vllm.core.eviction_driver import EvictionDriver
from vllm.core.kv_monitor import KVMonitor
from vllm.core.reclaim.backend import CopyBatch, ReclamationBackend
from vllm.core.reclaim.hole_filler import HoleFiller
from vllm.core.sliding_window_blocks import SlidingWindowBlocks
from vllm.core.step_stats import ScoreRequest, StepStats
from vllm.sequence import Sequence

# decode tokens a request appends before a repacking planned after this step frees its blocks
# (copied in the next step, freed after it)
RELIEVE_AHEAD_TOKENS = 2


class KVManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 config: KVEvictionConfig, num_layer_heads: int,
                 sliding: Optional[Tuple[int, int]] = None):
        """sliding: (window, subgroups) of a hybrid model's sliding-window layers, whose blocks
        come from the same pool (SlidingWindowBlocks); None: every layer in the one group."""
        self.config = config
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.sliding = SlidingWindowBlocks(self.bm.pool, block_size, *sliding) if sliding \
            else None
        self.token_table = self.bm.token_table
        self.seqs: Dict[str, Sequence] = {}         # sequences holding KV
        self.reclaimer = ReclamationBackend(config, self.bm) if config.reclaims else None
        # always there: a request may bring its own policy (KVEvictionParams) to any engine
        self.eviction = EvictionDriver(config, self.bm, num_layer_heads, self.busy_blocks)
        self.filler = HoleFiller(self.bm, self.busy_blocks) if config.fills_holes else None
        self.monitor = KVMonitor(self.bm, lambda: self.sliding.held if self.sliding else 0)

    @property
    def block_size(self) -> int:
        return self.bm.block_size

    @property
    def num_blocks(self) -> int:
        return self.bm.num_blocks

    def busy_blocks(self, seq_id: str) -> Set[int]:
        """Blocks of a relocation plan not yet applied: nothing frees or writes them."""
        return self.reclaimer.busy_blocks(seq_id) if self.reclaimer else set()

    # ---- scheduler: waiting -> running --------------------------------------------------------
    def computed_blocks(self, seq: Sequence) -> List[int]:
        if seq.params.prompt_logprobs is not None:
            return []     # (upstream too) every prompt position must run to score the prompt
        hits = self.bm.computed_blocks(seq, self.eviction.max_cache_hits(seq))
        if self.sliding is not None and hits:   # the sliding layers' window before it too
            hits = hits[:self.sliding.usable_hits(seq.block_hashes, len(hits))]
        return hits

    def _sliding_need(self, seq: Sequence, first: int, num_new_tokens: int) -> int:
        if self.sliding is None:
            return 0
        return self.sliding.blocks_needed(seq.seq_id, first, num_new_tokens)

    def can_allocate(self, seq: Sequence, hits: List[int], num_new_tokens: int) -> bool:
        return self.allocate_shortfall(seq, hits, num_new_tokens) == 0

    def allocate_shortfall(self, seq: Sequence, hits: List[int], num_new_tokens: int) -> int:
        extra = self._sliding_need(seq, len(hits) * self.block_size, num_new_tokens)
        if self.sliding is not None:     # cached window blocks taken off the free list
            extra += self.sliding.hit_blocks_free(seq.block_hashes, len(hits))
        return self.bm.allocate_shortfall(hits, num_new_tokens, extra)

    def allocate(self, seq: Sequence, hits: List[int], num_new_tokens: int) -> None:
        # every cached block the hit reads is taken before any fresh block: a fresh one may
        # come off the free list's cached end and would drop a sliding hit block from the cache
        if self.sliding is not None:
            self.sliding.adopt(seq.seq_id, seq.block_hashes, len(hits))
        self.bm.allocate(seq, hits, num_new_tokens)
        if self.sliding is not None:
            self.sliding.allocate(seq.seq_id, seq.num_computed_tokens, num_new_tokens)
        self.seqs[seq.seq_id] = seq
        seq.clean_tokens = None
        self.eviction.on_admit(seq)

    def chunk_bound(self, seq: Sequence) -> Optional[int]:
        """Most tokens the next prefill chunk may take (None: no bound): up to the next multiple
        of the request's --kv-prefill-chunk (any request: fixed chunk positions), on a hybrid
        model at most half the pool (with the chunk's sliding-window blocks), and in an
        evicting re-prefill after preemption at most a quarter of it, so that a request that
        outgrew the pool stays within it."""
        chunk = self.eviction.config_of(seq).prefill_chunk
        bound = None if chunk is None else chunk - seq.num_computed_tokens % chunk
        # a chunk also takes a block per sliding subgroup for each of its logical blocks, all
        # held while it runs: a hybrid model's chunks take at most half the pool
        pages = 1 + (self.sliding.num_groups if self.sliding else 0)
        if self.sliding is not None:
            half = max(self.block_size, self.num_blocks // (2 * pages) * self.block_size)
            bound = half if bound is None else min(bound, half)
        if seq.num_preemptions and self.eviction.evicts(seq):
            quarter = max(self.block_size, self.num_blocks // (4 * pages) * self.block_size)
            bound = quarter if bound is None else min(bound, quarter)
        return bound

    # ---- scheduler: running -------------------------------------------------------------------
    def _holes(self, seq: Sequence, n: int):
        return self.filler.holes(seq, n) if self.filler else None

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.append_shortfall(seq, num_new_tokens) == 0

    def append_shortfall(self, seq: Sequence, num_new_tokens: int) -> int:
        holes = self._holes(seq, num_new_tokens)
        return self.bm.append_shortfall(
            seq, num_new_tokens, 0 if holes is None else len(holes),
            self._sliding_need(seq, seq.num_computed_tokens, num_new_tokens))

    def relieve(self, shortfall: int) -> int:
        """The pool is `shortfall` blocks short: plan repacking (any plan that frees a block)
        until the plans pending and in flight free that many. -> blocks they will free (0
        without reclamation)."""
        if self.reclaimer is None:
            return 0
        return self.reclaimer.relieve(list(self.seqs.values()), shortfall)

    def _relieve_ahead(self) -> None:
        """Plans made now are copied next step and free their blocks for the step after: plan
        for the blocks the decoding requests need over those two steps beyond the free ones,
        so that none waits a step for repacking. (Prefill chunks are sized by the scheduler's
        budget; a chunk that finds the pool short goes through relieve() there.)"""
        need = 0
        for seq in self.seqs.values():
            if seq.num_computed_tokens >= seq.num_tokens:      # its next tokens are decodes
                holes = self._holes(seq, RELIEVE_AHEAD_TOKENS)
                need += self.bm.blocks_to_append(seq, RELIEVE_AHEAD_TOKENS,
                                                 0 if holes is None else len(holes))
                need += self._sliding_need(seq, seq.num_computed_tokens, RELIEVE_AHEAD_TOKENS)
        if need > self.bm.num_free_blocks:
            self.relieve(need - self.bm.num_free_blocks)

    def will_free(self, seq_id: str) -> bool:
        """seq has a relocation plan pending or in flight (it will give blocks back)."""
        return bool(self.reclaimer) and self.reclaimer.has_plan(seq_id)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        holes = self._holes(seq, num_new_tokens)
        self.bm.append_slots(seq, num_new_tokens, holes)
        if holes is not None:
            self.filler.slots_reused += len(holes)
        if self.sliding is not None:
            self.sliding.allocate(seq.seq_id, seq.num_computed_tokens, num_new_tokens)

    def free(self, seq: Sequence) -> None:
        """Finish, abort or preemption: every block and the token table go back."""
        if seq.seq_id not in self.seqs:
            return
        self.monitor.on_finish(seq)
        if self.reclaimer:
            self.reclaimer.drop(seq)
        self.bm.free(seq)
        if self.sliding is not None:
            self.sliding.free(seq.seq_id)
        del self.seqs[seq.seq_id]

    def take_copies(self) -> Optional[CopyBatch]:
        """This step's relocation copies (and fences) for the worker, or None."""
        return self.reclaimer.take_copies() if self.reclaimer else None

    # ---- engine: around the model step --------------------------------------------------------
    def score_request(self, scheduled: List[Tuple[Sequence, int]]) -> ScoreRequest:
        req = ScoreRequest()
        for seq, n in scheduled:
            self.eviction.request_scores(seq, n, req)
        return req

    def copies_done(self, batch_ids: Set[int]) -> None:
        if self.reclaimer and batch_ids:
            self.reclaimer.complete(batch_ids, self.seqs)

    def after_step(self, stats: StepStats) -> None:
        """num_computed_tokens already counts this step's tokens. Cache their full blocks
        (before any eviction they could see), run the policies, plan relocation."""
        self.monitor.before_policies(stats)
        for r in stats.rows:
            self.bm.cache_full_blocks(r.seq)
            self.eviction.after_step(r)
            if self.sliding is not None:        # cached with their full blocks, then freed
                self.sliding.cache(r.seq.seq_id, r.seq.block_hashes[:r.seq.num_cached_blocks])
                self.sliding.release_behind(r.seq.seq_id, r.seq.num_computed_tokens)
        if self.reclaimer:
            self.reclaimer.plan_step(list(self.seqs.values()))
            self._relieve_ahead()
        self.monitor.after_step(self.seqs.values())
        if self.config.check_invariants:
            self.check_invariants()

    # ---- figures and invariants ---------------------------------------------------------------
    def stats(self) -> Dict[str, float]:
        stats = self.monitor.stats()
        stats["evicted_tokens"] = self.eviction.evicted_tokens
        stats["hole_slots_reused"] = self.filler.slots_reused if self.filler else 0
        stats["prefix_cache_hit_blocks"] = self.bm.cache_hit_blocks
        stats["prefix_cache_queries"] = self.bm.cache_query_tokens
        stats["prefix_cache_hits"] = self.bm.cache_hit_tokens
        stats.update(self.reclaimer.stats() if self.reclaimer else ReclamationBackend.idle_stats())
        return stats

    def check_invariants(self) -> None:
        """I2 and the prefix-cache rule for every sequence holding KV, plus block accounting."""
        for seq in self.seqs.values():
            self.token_table.check_invariants(seq.seq_id, seq.block_ids)
            self.bm.check_prefix_cache(seq)
            if self.sliding is not None:
                self.sliding.check_invariants(seq.seq_id, seq.num_computed_tokens)
        self.bm.check_accounting(list(self.seqs.values()),
                                 self.sliding.held if self.sliding else 0)
        tables = set(self.token_table.request_ids())
        assert tables == set(self.seqs), \
            f"token tables {sorted(tables - set(self.seqs))} outlive their requests"
