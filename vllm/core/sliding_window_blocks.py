"""SlidingWindowBlocks: the sliding subgroups' blocks of a hybrid model (layers/attention.py
KVGroups), drawn from the same BlockPool as the full-attention group.

Per request a table [logical block, subgroup] -> pool block (-1: none): logical block j holds
ids j*B .. j*B + B - 1 in every sliding subgroup. Tokens are never evicted or relocated here:
a block is freed once every query to come is past it, its last id <= next position - W:

    W 8, B 4, next position 14: queries see ids >= 7, so blocks 0 (ids 0-3) go and block 1
    (ids 4-7, id 7 still seen) stays; a decode step then holds ceil(W / B) + 1 = 3 blocks

A prompt chunk takes blocks for all its ids (its queries read them) and gives back those behind
its last query's window after the step.

Prefix caching: a logical block whose full-attention block entered the prefix cache (computed
before any eviction, so its sliding K/V are an uncached run's too) is cached in each subgroup
under (subgroup, that block's hash) before the window frees it: a freed block stays findable
until the pool hands it out again, as full blocks do. A hit of m full blocks is usable when the
blocks of the window before position m * B are all cached (usable_hits); admission takes them.
"""
from typing import Dict, List, Optional

import numpy as np

from vllm.core.block_pool import BlockPool


class SlidingWindowBlocks:
    def __init__(self, pool: BlockPool, block_size: int, window: int, num_groups: int):
        self.pool, self.block_size, self.window, self.num_groups = pool, block_size, window, \
            num_groups
        self.tables: Dict[str, np.ndarray] = {}     # seq id -> [logical blocks, groups] int64
        self.cached: Dict[str, int] = {}            # seq id -> logical blocks cached so far
        self.held = 0                               # pool blocks held, all requests

    def max_blocks_per_request(self) -> int:
        """Blocks per subgroup a request holds after a decode step, at most."""
        return -(-self.window // self.block_size) + 1

    # ---- check / commit ----------------------------------------------------------------------
    def blocks_needed(self, seq_id: str, first: int, num_new: int) -> int:
        """Pool blocks the ids first .. first + num_new - 1 need that the request lacks."""
        if num_new <= 0:
            return 0
        lo, hi = first // self.block_size, (first + num_new - 1) // self.block_size
        table = self.tables.get(seq_id)
        have = 0 if table is None else int((table[lo:hi + 1, 0] >= 0).sum())
        return (hi - lo + 1 - have) * self.num_groups

    def allocate(self, seq_id: str, first: int, num_new: int) -> None:
        """Blocks for the ids first .. first + num_new - 1 (the step's new tokens)."""
        if num_new <= 0:
            return
        hi = (first + num_new - 1) // self.block_size
        table = self.tables.get(seq_id)
        if table is None or len(table) <= hi:
            grown = np.full((max(hi + 1, 2 * (0 if table is None else len(table))),
                             self.num_groups), -1, np.int64)
            if table is not None:
                grown[:len(table)] = table
            self.tables[seq_id] = table = grown
        missing = np.flatnonzero(table[first // self.block_size:hi + 1, 0] < 0) + \
            first // self.block_size
        if len(missing):
            blocks = self.pool.allocate(len(missing) * self.num_groups)
            table[missing] = np.asarray(blocks, np.int64).reshape(len(missing), self.num_groups)
            self.held += len(blocks)

    def release_behind(self, seq_id: str, next_position: int) -> None:
        """Free the blocks no query from next_position on can see (last id <= next - W)."""
        table = self.tables.get(seq_id)
        if table is None:
            return
        behind = self._first_visible(next_position)
        rows = np.flatnonzero(table[:behind, 0] >= 0)
        if len(rows):
            self.pool.release(table[rows].ravel().tolist())
            self.held -= rows.size * self.num_groups
            table[rows] = -1

    def free(self, seq_id: str) -> None:
        self.cached.pop(seq_id, None)
        table = self.tables.pop(seq_id, None)
        if table is not None:
            blocks = table[table >= 0]
            self.pool.release(blocks.tolist())
            self.held -= blocks.size

    # ---- prefix cache ---------------------------------------------------------------------------
    @staticmethod
    def _hash(block_hash: int, group: int) -> int:
        return hash(("sliding", group, block_hash))

    def cache(self, seq_id: str, block_hashes: List[int]) -> None:
        """Register the held blocks of the logical blocks block_hashes covers (those whose
        full-attention blocks are cached) under their subgroup's hash."""
        table = self.tables.get(seq_id)
        start = self.cached.get(seq_id, 0)
        if table is None or start >= len(block_hashes):
            return
        for j in range(start, min(len(block_hashes), len(table))):
            for k in range(self.num_groups):
                if table[j, k] >= 0:
                    self.pool.cache(int(table[j, k]), self._hash(block_hashes[j], k))
        self.cached[seq_id] = len(block_hashes)

    def _first_visible(self, position: int) -> int:
        """First logical block a query at `position` sees (ids > position - W)."""
        return max(position - self.window + 1, 0) // self.block_size

    def _lookup(self, block_hashes: List[int], m: int) -> Optional[np.ndarray]:
        """[m - first, groups] cached blocks of the window before a hit of m blocks, or None."""
        lo = self._first_visible(m * self.block_size)
        found = np.empty((m - lo, self.num_groups), np.int64)
        for j in range(lo, m):
            for k in range(self.num_groups):
                block = self.pool.lookup(self._hash(block_hashes[j], k))
                if block is None:
                    return None
                found[j - lo, k] = block
        return found

    def usable_hits(self, block_hashes: List[int], num_hits: int) -> int:
        """The longest prefix of num_hits full-block hits whose window is cached too."""
        for m in range(num_hits, 0, -1):
            if self._lookup(block_hashes, m) is not None:
                return m
        return 0

    def hit_blocks_free(self, block_hashes: List[int], num_hits: int) -> int:
        """Pool blocks adopting this hit takes off the free list (cached, not held)."""
        found = self._lookup(block_hashes, num_hits) if num_hits else None
        return 0 if found is None else self.pool.num_free_among(found.ravel().tolist())

    def adopt(self, seq_id: str, block_hashes: List[int], num_hits: int) -> None:
        """A new request's sliding blocks for the window before its prefix hit of num_hits
        blocks (usable_hits said they are cached): referenced, placed in its table."""
        assert seq_id not in self.tables, f"{seq_id} already holds sliding blocks"
        table = self.tables[seq_id] = np.full((max(num_hits, 1), self.num_groups), -1, np.int64)
        self.cached[seq_id] = num_hits
        if not num_hits:
            return
        found = self._lookup(block_hashes, num_hits)
        assert found is not None, f"{seq_id}: its sliding hit blocks left the cache"
        self.pool.touch(found.ravel().tolist())
        table[self._first_visible(num_hits * self.block_size):num_hits] = found
        self.held += found.size

    # ---- what the step reads -----------------------------------------------------------------
    def slots(self, seq_id: str, ids: np.ndarray) -> np.ndarray:
        """[len(ids), groups] slots of these logical ids in each subgroup (held blocks only)."""
        table = self.tables[seq_id]
        blocks = table[ids // self.block_size]
        assert (blocks >= 0).all(), f"{seq_id}: sliding ids {ids[:4]}... have no block"
        return blocks * self.block_size + (ids % self.block_size)[:, None]

    def num_blocks_of(self, seq_id: str) -> int:
        table = self.tables.get(seq_id)
        return 0 if table is None else int((table[:, 0] >= 0).sum())

    def check_invariants(self, seq_id: str, next_position: int) -> None:
        """No block behind the window of the next query (the pool's accounting counts `held`:
        KVManager.check_invariants)."""
        table = self.tables.get(seq_id)
        if table is None:
            return
        behind = self._first_visible(next_position)
        assert (table[:behind] < 0).all(), f"{seq_id}: a sliding block behind the window"
