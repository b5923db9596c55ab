"""BlockPool: physical KV blocks, ref counts, a free queue and the prefix-cache hash map."""
from collections import OrderedDict
from typing import Dict, List, Optional

import numpy as np


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_cnt = np.zeros(num_blocks, dtype=np.int32)
        # Free blocks in eviction order (least recently freed first); O(1) removal on a cache hit.
        self._free: "OrderedDict[int, None]" = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block: Dict[int, int] = {}
        self.block_hash: List[Optional[int]] = [None] * num_blocks
        self.hashed = np.zeros(num_blocks, dtype=bool)     # block_hash[b] is not None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> List[int]:
        assert n <= len(self._free), f"allocating {n} blocks with {len(self._free)} free"
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self.uncache(block)
            self.ref_cnt[block] = 1
            out.append(block)
        return out

    def touch(self, blocks: List[int]) -> None:
        """Take a reference on cached blocks (prefix-cache hits), reviving free ones."""
        for b in blocks:
            if self.ref_cnt[b] == 0:
                del self._free[b]
            self.ref_cnt[b] += 1

    def release(self, blocks: List[int]) -> None:
        for b in blocks:
            assert self.ref_cnt[b] > 0, f"block {b} released twice"
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self._free[b] = None

    # ---- prefix cache -----------------------------------------------------------------------
    def lookup(self, block_hash: int) -> Optional[int]:
        return self._hash_to_block.get(block_hash)

    def cache(self, block: int, block_hash: int) -> None:
        if block_hash not in self._hash_to_block:
            self._hash_to_block[block_hash] = block
            self.block_hash[block] = block_hash
            self.hashed[block] = True

    def uncache(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            if self._hash_to_block.get(h) == block:
                del self._hash_to_block[h]
            self.block_hash[block] = None
            self.hashed[block] = False

    def num_free_among(self, blocks: List[int]) -> int:
        return sum(1 for b in blocks if self.ref_cnt[b] == 0)

    def check_accounting(self) -> None:
        used = int((self.ref_cnt > 0).sum())
        assert used + len(self._free) == self.num_blocks, (
            f"block accounting broken: used {used} + free {len(self._free)} != {self.num_blocks}")
        assert all(self.ref_cnt[b] == 0 for b in self._free), "a free block has references"
