"""HoleFiller (--kv-reclamation vtoken-fill): new tokens reuse dead slots before the tail grows.

The token table maps any logical id to any slot, so a new token's KV can go straight into a dead
slot of one of the request's own blocks. With a one-in-one-out policy (H2O, StreamingLLM, TOVA)
every eviction leaves exactly the hole the next token needs: the footprint stays packed with no
copies. Only private blocks are written: never a shared or prefix-cached block, and never a
block of an in-flight relocation plan (its holes are reserved as copy destinations).
"""
from typing import Callable, Set

import numpy as np

from vllm.core.block_manager import BlockManager
from vllm.core.request_kv import RequestKV
from vllm.core.token_table import block_positions


class HoleFiller:
    def __init__(self, block_manager: BlockManager, busy_blocks: Callable[[str], Set[int]]):
        self.bm = block_manager
        self.busy_blocks = busy_blocks
        self.slots_reused = 0

    def holes(self, req: RequestKV, limit: int) -> np.ndarray:
        """Up to `limit` reusable dead slots of the sequence, in block-list then offset order."""
        dead = self.bm.token_table.dead_slots(req.seq_id)
        if len(dead) == 0 or limit <= 0:
            return dead[:0]
        blocks = np.asarray(req.block_ids, np.int64)
        usable = ~(self.bm.shared_mask(req, blocks) | self.bm.cached_mask(blocks))
        busy = self.busy_blocks(req.seq_id)
        if busy:
            usable &= ~np.isin(blocks, np.fromiter(busy, np.int64))
        rank = block_positions(dead, blocks, self.bm.block_size)
        ok = rank >= 0
        ok[ok] = usable[rank[ok]]
        dead, rank = dead[ok], rank[ok]
        return dead[np.lexsort((dead, rank))][:limit]
