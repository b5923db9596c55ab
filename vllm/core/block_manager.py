"""BlockManager: which physical blocks each sequence owns, prefix caching, and the token table.

Check-then-commit pairs: `can_allocate`/`allocate` for a waiting sequence,
`can_append`/`append_slots` for a running one. Slots for new tokens come from the token
table (`sync_new_tokens`), so the block manager never computes a slot itself.
"""
from typing import List, Optional, Sequence as Seq

import numpy as np

from vllm.core.block_pool import BlockPool
from vllm.core.token_table import TokenTable
from vllm.sequence import Sequence


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.token_table = TokenTable(block_size)
        self.peak_used = 0
        self.before_free: List = []     # hooks run before a sequence's blocks are released
        self.hole_filler = None         # vtoken-fill: gives reusable dead slots for new tokens

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    # ---- prefix caching ---------------------------------------------------------------------
    def _block_hashes(self, seq: Sequence, num_blocks: int) -> List[int]:
        hashes = seq.__dict__.setdefault("_block_hashes", [])
        bs = self.block_size
        while len(hashes) < num_blocks:
            j = len(hashes)
            prev = hashes[-1] if hashes else None
            hashes.append(hash((prev, tuple(seq.token_ids[j * bs:(j + 1) * bs]))))
        return hashes[:num_blocks]

    def computed_blocks(self, seq: Sequence) -> List[int]:
        """Leading prefix-cache hits for a waiting sequence; the last token is always computed."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for h in self._block_hashes(seq, (seq.num_tokens - 1) // self.block_size):
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def cache_full_blocks(self, seq: Sequence) -> None:
        if not self.enable_prefix_caching or not seq.blocks_in_order:
            return
        num_full = seq.num_computed_tokens // self.block_size
        hashes = self._block_hashes(seq, num_full)
        for j in range(seq.num_cached_blocks, num_full):
            self.pool.cache(seq.block_ids[j], hashes[j])
        seq.num_cached_blocks = max(seq.num_cached_blocks, num_full)

    # ---- waiting -> running -----------------------------------------------------------------
    def can_allocate(self, seq: Sequence, hits: List[int], num_new_tokens: int,
                     reserve: int = 0) -> bool:
        needed = _cdiv(num_new_tokens, self.block_size)
        return self.pool.num_free - self.pool.num_free_among(hits) - needed >= reserve

    def allocate(self, seq: Sequence, hits: List[int], num_new_tokens: int) -> None:
        assert not seq.block_ids, f"{seq.seq_id} already holds blocks"
        self.pool.touch(hits)
        seq.block_ids = list(hits) + self.pool.allocate(_cdiv(num_new_tokens, self.block_size))
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_cached_blocks = len(hits)
        seq.shared_blocks = set(hits)
        self.token_table.add_request(seq.seq_id)
        self.token_table.sync_new_tokens(seq.seq_id, seq.block_ids,
                                         seq.num_computed_tokens + num_new_tokens)
        self._note_peak()

    # ---- running ----------------------------------------------------------------------------
    def _holes(self, seq: Sequence, num_new_tokens: int):
        if self.hole_filler is None:
            return None
        return self.hole_filler.holes(seq)[:num_new_tokens]

    def blocks_to_append(self, seq: Sequence, num_new_tokens: int, holes=None) -> int:
        reused = 0 if holes is None else len(holes)
        spill = num_new_tokens - reused - self.token_table.tail_free(seq.seq_id)
        return _cdiv(max(spill, 0), self.block_size)

    def can_append(self, seq: Sequence, num_new_tokens: int, reserve: int = 0) -> bool:
        holes = self._holes(seq, num_new_tokens)
        return self.pool.num_free - self.blocks_to_append(seq, num_new_tokens, holes) >= reserve

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        holes = self._holes(seq, num_new_tokens)
        seq.block_ids += self.pool.allocate(self.blocks_to_append(seq, num_new_tokens, holes))
        self.token_table.sync_new_tokens(seq.seq_id, seq.block_ids,
                                         seq.num_computed_tokens + num_new_tokens, holes)
        if holes is not None:
            self.hole_filler.slots_reused += len(holes)
        self._note_peak()

    # ---- release ----------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        for hook in self.before_free:
            hook(seq)
        # Reverse order: a prefix's tail blocks leave the cache before its head blocks.
        self.pool.release(list(reversed(seq.block_ids)))
        seq.block_ids = []
        self.token_table.free_request(seq.seq_id)

    def free_blocks(self, seq: Sequence, blocks: Seq[int]) -> None:
        """Return some of a running sequence's blocks (fully dead, or emptied by relocation)."""
        gone = set(blocks)
        if not gone:
            return
        seq.block_ids = [b for b in seq.block_ids if b not in gone]
        self.token_table.forget_blocks(seq.seq_id, gone)
        seq.blocks_in_order = False
        seq.shared_blocks -= gone
        self.pool.release(list(blocks))

    def is_shared(self, seq: Sequence, block: int) -> bool:
        return self.pool.ref_cnt[block] > 1 or block in seq.shared_blocks

    def shared_mask(self, seq: Sequence, blocks: np.ndarray) -> np.ndarray:
        """is_shared for each of `blocks` (int64 array), in one pass."""
        mask = self.pool.ref_cnt[blocks] > 1
        if seq.shared_blocks:
            mask |= np.isin(blocks, np.fromiter(seq.shared_blocks, np.int64))
        return mask

    def _note_peak(self) -> None:
        self.peak_used = max(self.peak_used, self.pool.num_used)

    def check_accounting(self, running: Seq[Sequence] = ()) -> None:
        self.pool.check_accounting()
        owned = sum(len(s.block_ids) for s in running)
        refs = int(self.pool.ref_cnt.sum())
        assert owned == refs, f"block accounting broken: sequences own {owned}, refs {refs}"
