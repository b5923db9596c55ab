"""KVManager: the one owner of the KV state.

It builds and owns the block manager (pool, prefix cache, token tables), the eviction driver,
the reclamation backend, the hole filler and the monitor, and holds the one busy-block rule.
Each sequence's KV state is a RequestKV (request_kv.py) in `requests`, by seq id, from the
engine's add_request until the engine is done with the sequence (drop_request); the parts
above read and write the RequestKV they are handed.

    engine    -> add_request(seq_id, config) / drop_request(seq_id), request_stats(seq_id),
                 after_step(StepStats), copies_done(batch ids), stats(), check_invariants(live)
    scheduler -> can_allocate / allocate / can_append / append_slots / free / preempt,
                 take_copies, relieve(shortfall) when the pool is short
    runner    <- score_request(scheduled): which attention statistics the step must collect

Nothing here imports the worker's code or attention: statistics come in as plain arrays
(StepStats), copies go out as plain arrays (CopyBatch, a value of the worker's step protocol,
vllm/worker/step_input.py, which imports numpy only) with the scheduler output.
"""
from typing import Collection, Dict, List, Optional, Set, Tuple

from vllm.config import KVEvictionConfig
from vllm.core.block_manager import BlockManager
from vllm.core.eviction_driver import EvictionDriver
from vllm.core.kv_monitor import KVMonitor
from vllm.core.reclaim.backend import CopyBatch, ReclamationBackend
from vllm.core.reclaim.hole_filler import HoleFiller
from vllm.core.request_kv import RequestKV
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
        self.requests: Dict[str, RequestKV] = {}    # every sequence the engine has, by seq id
        self.seqs: Dict[str, Sequence] = {}         # those holding KV (admitted, not freed)
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

    # ---- engine: a sequence's KV state --------------------------------------------------------
    def add_request(self, seq_id: str, config: Optional[KVEvictionConfig] = None) -> RequestKV:
        """A sequence the engine adds (config: its own eviction settings; None: the engine's)."""
        assert seq_id not in self.requests, f"{seq_id} is already known to the KV manager"
        req = self.requests[seq_id] = RequestKV(seq_id, config or self.config)
        return req

    def drop_request(self, seq_id: str) -> None:
        """The engine is done with the sequence (its final output delivered, or aborted)."""
        assert seq_id not in self.seqs, f"{seq_id} is dropped while it holds KV"
        del self.requests[seq_id]

    def request_stats(self, seq_id: str) -> Dict[str, float]:
        """The sequence's KV figures (RequestOutput.kv_stats), a copy."""
        return dict(self.requests[seq_id].kv_stats)

    def _req(self, seq: Sequence) -> RequestKV:
        req = self.requests.get(seq.seq_id)
        assert req is not None, f"{seq.seq_id} was never added to the KV manager (add_request)"
        return req

    def _holding(self) -> List[RequestKV]:
        return [self.requests[s] for s in self.seqs]

    # ---- scheduler: waiting -> running --------------------------------------------------------
    def computed_blocks(self, seq: Sequence) -> List[int]:
        if seq.params.prompt_logprobs is not None:
            return []     # (upstream too) every prompt position must run to score the prompt
        req = self._req(seq)
        hits = self.bm.computed_blocks(seq, req, self.eviction.max_cache_hits(seq, req))
        if self.sliding is not None and hits:   # the sliding layers' window before it too
            hits = hits[:self.sliding.usable_hits(req.block_hashes, len(hits))]
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
            extra += self.sliding.hit_blocks_free(self._req(seq).block_hashes, len(hits))
        return self.bm.allocate_shortfall(hits, num_new_tokens, extra)

    def allocate(self, seq: Sequence, hits: List[int], num_new_tokens: int) -> None:
        # every cached block the hit reads is taken before any fresh block: a fresh one may
        # come off the free list's cached end and would drop a sliding hit block from the cache
        req = self._req(seq)
        if self.sliding is not None:
            self.sliding.adopt(seq.seq_id, req.block_hashes, len(hits))
        self.bm.allocate(seq, req, hits, num_new_tokens)
        if self.sliding is not None:
            self.sliding.allocate(seq.seq_id, seq.num_computed_tokens, num_new_tokens)
        self.seqs[seq.seq_id] = seq
        req.clean_tokens = None
        self.eviction.on_admit(seq, req)

    def chunk_bound(self, seq: Sequence) -> Optional[int]:
        """Most tokens the next prefill chunk may take (None: no bound): up to the next multiple
        of the request's --kv-prefill-chunk (any request: fixed chunk positions), on a hybrid
        model at most half the pool (with the chunk's sliding-window blocks), and in an
        evicting re-prefill after preemption at most a quarter of it, so that a request that
        outgrew the pool stays within it."""
        req = self._req(seq)
        chunk = req.kv_config.prefill_chunk
        bound = None if chunk is None else chunk - seq.num_computed_tokens % chunk
        # a chunk also takes a block per sliding subgroup for each of its logical blocks, all
        # held while it runs: a hybrid model's chunks take at most half the pool
        pages = 1 + (self.sliding.num_groups if self.sliding else 0)
        if self.sliding is not None:
            half = max(self.block_size, self.num_blocks // (2 * pages) * self.block_size)
            bound = half if bound is None else min(bound, half)
        if seq.num_preemptions and self.eviction.evicts(req):
            quarter = max(self.block_size, self.num_blocks // (4 * pages) * self.block_size)
            bound = quarter if bound is None else min(bound, quarter)
        return bound

    def admission_tokens(self, seq: Sequence, remaining: int, chunk: int) -> int:
        """Prefill tokens a waiting request must find blocks for to be admitted beside running
        ones: the chunk, except for a request that was preempted (and no sliding-window group
        frees blocks behind its chunks): that one waits until its whole remaining prefill fits.
        Admitted again on a chunk, it would be the first one preempted when a later chunk finds
        the pool short (without repacking its blocks only grow; with it, the running requests
        grow back into what their last evictions freed: Scissorhands halves a request's live
        tokens at each drop), and prefilled again from the start while the others run."""
        if not seq.num_preemptions or self.sliding is not None:
            return chunk
        return remaining

    # ---- scheduler: running -------------------------------------------------------------------
    def _holes(self, seq: Sequence, n: int):
        return self.filler.holes(self._req(seq), n) if self.filler else None

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
        return self.reclaimer.relieve(self._holding(), shortfall)

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
        self.bm.append_slots(seq, self._req(seq), num_new_tokens, holes)
        if holes is not None:
            self.filler.slots_reused += len(holes)
        if self.sliding is not None:
            self.sliding.allocate(seq.seq_id, seq.num_computed_tokens, num_new_tokens)

    def free(self, seq: Sequence) -> None:
        """Finish, abort or preemption: every block and the token table go back (the
        RequestKV stays, with the final kv_stats, until drop_request)."""
        if seq.seq_id not in self.seqs:
            return
        req = self._req(seq)
        self.monitor.on_finish(req)
        if self.reclaimer:
            self.reclaimer.drop(seq.seq_id)
        self.bm.free(req)
        if self.sliding is not None:
            self.sliding.free(seq.seq_id)
        del self.seqs[seq.seq_id]

    def preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: free, then reset the KV state for the re-prefill (the
        scheduler resets the Sequence's own)."""
        self.free(seq)
        self._req(seq).reset_for_recompute()

    def take_copies(self) -> Optional[CopyBatch]:
        """This step's relocation copies (and fences) for the worker, or None."""
        return self.reclaimer.take_copies() if self.reclaimer else None

    # ---- engine: around the model step --------------------------------------------------------
    def score_request(self, scheduled: List[Tuple[Sequence, int]]) -> ScoreRequest:
        asked = ScoreRequest()
        for seq, n in scheduled:
            self.eviction.request_scores(seq, self._req(seq), n, asked)
        return asked

    def copies_done(self, batch_ids: Set[int]) -> None:
        if self.reclaimer and batch_ids:
            self.reclaimer.complete(batch_ids, self.requests)

    def after_step(self, stats: StepStats) -> None:
        """num_computed_tokens already counts this step's tokens. Cache their full blocks
        (before any eviction they could see), run the policies, plan relocation."""
        rows = [(r, self._req(r.seq)) for r in stats.rows]
        for r, req in rows:
            self.monitor.before_policies(r, req)
        for r, req in rows:
            self.bm.cache_full_blocks(r.seq, req)
            self.eviction.after_step(r, req)
            if self.sliding is not None:        # cached with their full blocks, then freed
                self.sliding.cache(r.seq.seq_id, req.block_hashes[:req.num_cached_blocks])
                self.sliding.release_behind(r.seq.seq_id, r.seq.num_computed_tokens)
        if self.reclaimer:
            self.reclaimer.plan_step(self._holding())
            self._relieve_ahead()
        self.monitor.after_step(self.seqs)
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

    def check_invariants(self, live: Optional[Collection[str]] = None) -> None:
        """I2 and the prefix-cache rule for every sequence holding KV, plus block accounting;
        a RequestKV holds blocks exactly while its sequence holds KV. live: the seq ids of every
        sequence of the engine's unfinished requests (those whose final output is not yet
        delivered); given, the RequestKVs held are exactly theirs (none leaked, none missing)."""
        for seq in self.seqs.values():
            req = self.requests.get(seq.seq_id)
            assert req is not None, f"{seq.seq_id} holds KV without a RequestKV"
            self.token_table.check_invariants(seq.seq_id, req.block_ids)
            self.bm.check_prefix_cache(req)
            if self.sliding is not None:
                self.sliding.check_invariants(seq.seq_id, seq.num_computed_tokens)
        idle = [s for s, r in self.requests.items() if s not in self.seqs and r.block_ids]
        assert not idle, f"requests {sorted(idle)} keep blocks without holding KV"
        self.bm.check_accounting(self._holding(), self.sliding.held if self.sliding else 0)
        tables = set(self.token_table.request_ids())
        assert tables == set(self.seqs), \
            f"token tables {sorted(tables - set(self.seqs))} outlive their requests"
        if live is not None:
            live = set(live)
            assert set(self.requests) == live, \
                f"KV state of {sorted(set(self.requests) - live)} outlives its requests, " \
                f"{sorted(live - set(self.requests))} has none"
