"""BlockManager: which physical blocks each sequence owns, prefix caching, and the token table.

Check-then-commit pairs: `can_allocate`/`allocate` for a waiting sequence,
`can_append`/`append_slots` for a running one. Slots for new tokens come from the token
table (`sync_new_tokens`), so the block manager never computes a slot itself. It knows nothing
of eviction: the KV manager (kv_manager.py) decides which blocks may be cached, filled or freed.

Prefix-cache rule: block j of a sequence is registered under the hash of tokens [0, (j+1)*B)
only if all of them were computed before the sequence's first eviction (`RequestKV.clean_tokens`).
Until that eviction no token is dead, so no block was freed, relocated or hole-filled: block j
holds exactly tokens [j*B, (j+1)*B), whose K/V saw the full context.

A sequence's KV state (block list, prefix hashes) is its RequestKV, passed in beside the
Sequence where its tokens matter too.
"""
from typing import List, Optional, Sequence as Seq

import numpy as np

from vllm.core.block_pool import BlockPool
from vllm.core.request_kv import RequestKV
from vllm.core.token_table import TokenTable
from vllm.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.token_table = TokenTable(block_size)
        self.peak_used = 0
        self.cache_hit_blocks = 0       # blocks admitted requests took from the prefix cache
        # upstream's prefix-cache counters, in tokens: looked up at admission / found cached
        self.cache_query_tokens = 0
        self.cache_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    # ---- prefix caching ---------------------------------------------------------------------
    def _block_hashes(self, seq: Sequence, req: RequestKV, num_blocks: int) -> List[int]:
        hashes = req.block_hashes
        bs = self.block_size
        while len(hashes) < num_blocks:
            j = len(hashes)
            prev = hashes[-1] if hashes else None
            hashes.append(hash((prev, tuple(seq.token_ids[j * bs:(j + 1) * bs]))))
        return hashes[:num_blocks]

    def computed_blocks(self, seq: Sequence, req: RequestKV,
                        max_blocks: Optional[int] = None) -> List[int]:
        """Leading prefix-cache hits for a waiting sequence (at most max_blocks); the last
        token is always computed."""
        if not self.enable_prefix_caching:
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        if max_blocks is not None:
            limit = min(limit, max_blocks)
        hits = []
        for h in self._block_hashes(seq, req, limit):
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def cache_full_blocks(self, seq: Sequence, req: RequestKV) -> None:
        if not self.enable_prefix_caching:
            return
        clean = seq.num_computed_tokens if req.clean_tokens is None else req.clean_tokens
        num_full = min(seq.num_computed_tokens, clean) // self.block_size
        hashes = self._block_hashes(seq, req, num_full)
        for j in range(req.num_cached_blocks, num_full):
            self.pool.cache(req.block_ids[j], hashes[j])
        req.num_cached_blocks = max(req.num_cached_blocks, num_full)

    # ---- waiting -> running -----------------------------------------------------------------
    def can_allocate(self, hits: List[int], num_new_tokens: int, extra: int = 0) -> bool:
        return self.allocate_shortfall(hits, num_new_tokens, extra) == 0

    def allocate_shortfall(self, hits: List[int], num_new_tokens: int, extra: int = 0) -> int:
        """Blocks missing to admit a request (0: it fits); extra: more it needs from the pool
        (a hybrid model's sliding-window blocks)."""
        needed = cdiv(num_new_tokens, self.block_size) + extra
        return max(needed - (self.pool.num_free - self.pool.num_free_among(hits)), 0)

    def allocate(self, seq: Sequence, req: RequestKV, hits: List[int],
                 num_new_tokens: int) -> None:
        assert not req.block_ids, f"{seq.seq_id} already holds blocks"
        self.pool.touch(hits)
        self.cache_hit_blocks += len(hits)
        if self.enable_prefix_caching:
            self.cache_query_tokens += seq.num_tokens
            self.cache_hit_tokens += len(hits) * self.block_size
        req.block_ids = list(hits) + self.pool.allocate(cdiv(num_new_tokens, self.block_size))
        seq.num_computed_tokens = len(hits) * self.block_size
        req.num_cached_blocks = len(hits)
        req.shared_blocks = set(hits)
        self.token_table.add_request(seq.seq_id)
        self.token_table.sync_new_tokens(seq.seq_id, req.block_ids,
                                         seq.num_computed_tokens + num_new_tokens)
        self._note_peak()

    # ---- running ----------------------------------------------------------------------------
    def blocks_to_append(self, seq: Sequence, num_new_tokens: int, num_holes: int = 0) -> int:
        spill = num_new_tokens - num_holes - self.token_table.tail_free(seq.seq_id)
        return cdiv(max(spill, 0), self.block_size)

    def can_append(self, seq: Sequence, num_new_tokens: int, num_holes: int = 0,
                   extra: int = 0) -> bool:
        return self.append_shortfall(seq, num_new_tokens, num_holes, extra) == 0

    def append_shortfall(self, seq: Sequence, num_new_tokens: int, num_holes: int = 0,
                         extra: int = 0) -> int:
        """Blocks missing for a running request to append (0: it fits); extra as above."""
        return max(self.blocks_to_append(seq, num_new_tokens, num_holes) + extra -
                   self.pool.num_free, 0)

    def append_slots(self, seq: Sequence, req: RequestKV, num_new_tokens: int,
                     holes: Optional[np.ndarray] = None) -> None:
        """New tokens go into `holes` (dead slots of the sequence's own blocks) first."""
        n_holes = 0 if holes is None else len(holes)
        req.block_ids += self.pool.allocate(self.blocks_to_append(seq, num_new_tokens, n_holes))
        self.token_table.sync_new_tokens(seq.seq_id, req.block_ids,
                                         seq.num_computed_tokens + num_new_tokens, holes)
        self._note_peak()

    # ---- release ----------------------------------------------------------------------------
    def free(self, req: RequestKV) -> None:
        # Reverse order: a prefix's tail blocks leave the cache before its head blocks.
        self.pool.release(list(reversed(req.block_ids)))
        req.block_ids = []
        self.token_table.free_request(req.seq_id)

    def free_blocks(self, req: RequestKV, blocks: Seq[int]) -> None:
        """Return some of a running sequence's blocks (fully dead, or emptied by relocation)."""
        gone = set(blocks)
        if not gone:
            return
        req.block_ids = [b for b in req.block_ids if b not in gone]
        self.token_table.forget_blocks(req.seq_id, gone)
        req.shared_blocks -= gone
        self.pool.release(list(blocks))

    def shared_mask(self, req: RequestKV, blocks: np.ndarray) -> np.ndarray:
        """Blocks another sequence reads too (ref count > 1, or taken from a cache hit)."""
        mask = self.pool.ref_cnt[blocks] > 1
        if req.shared_blocks:
            mask |= np.isin(blocks, np.fromiter(req.shared_blocks, np.int64))
        return mask

    def cached_mask(self, blocks: np.ndarray) -> np.ndarray:
        """Blocks registered in the prefix cache: their bytes must stay what the hash says."""
        return self.pool.hashed[blocks]

    def _note_peak(self) -> None:
        self.peak_used = max(self.peak_used, self.pool.num_used)

    # ---- invariants -------------------------------------------------------------------------
    def check_accounting(self, holding: Seq[RequestKV] = (), other_owned: int = 0) -> None:
        """holding: every sequence's KV that holds blocks; other_owned: pool blocks held outside
        their block lists (sliding windows)."""
        self.pool.check_accounting()
        owned = sum(len(r.block_ids) for r in holding) + other_owned
        refs = int(self.pool.ref_cnt.sum())
        assert owned == refs, f"block accounting broken: sequences own {owned}, refs {refs}"

    def check_prefix_cache(self, req: RequestKV) -> None:
        """Every token a sequence keeps in a cached block is the one the cache entry names: the
        block's hash is that of the token's logical block, and the offset matches."""
        tt, bs = self.token_table, self.block_size
        slots = tt.all_slots(req.seq_id).astype(np.int64)
        ids = np.flatnonzero(slots >= 0)
        slots = slots[ids]
        in_cache = self.pool.hashed[slots // bs]
        ids, slots = ids[in_cache], slots[in_cache]
        hashes = req.block_hashes
        for i, slot in zip(ids.tolist(), slots.tolist()):
            j = i // bs
            if slot % bs != i % bs or j >= len(hashes) or \
                    self.pool.block_hash[slot // bs] != hashes[j]:
                raise AssertionError(
                    f"request {req.seq_id}: token {i} sits in cached block {slot // bs} at "
                    f"offset {slot % bs}: the prefix-cache entry no longer matches its bytes")
