"""HoleFiller (--kv-reclamation vtoken-fill): new tokens reuse dead slots before the tail grows.

The token table maps any logical id to any slot, so a new token's KV can go straight into a dead
slot of one of the request's own blocks. With a one-in-one-out policy (H2O, StreamingLLM, TOVA)
every eviction leaves exactly the hole the next token needs: the footprint stays packed with no
copies. Only private blocks are written: never a shared or prefix-cached block, and never a
block of an in-flight relocation plan (its holes are reserved as copy destinations).
"""
import numpy as np

from vllm.core.block_manager import BlockManager
from vllm.sequence import Sequence


class HoleFiller:
    def __init__(self, block_manager: BlockManager):
        self.bm = block_manager
        self.busy_blocks = lambda seq_id: set()     # set by the reclamation backend
        self.slots_reused = 0

    def holes(self, seq: Sequence) -> np.ndarray:
        """Reusable dead slots of the sequence, in block-list order then offset order."""
        tt = self.bm.token_table
        dead = tt.dead_slots(seq.seq_id)
        if len(dead) == 0:
            return dead
        blocks = np.asarray(seq.block_ids, np.int64)
        pool = self.bm.pool
        busy = self.busy_blocks(seq.seq_id)
        usable = ~self.bm.shared_mask(seq, blocks) & np.array(
            [pool.block_hash[b] is None and b not in busy for b in seq.block_ids], dtype=bool)
        # rank of each dead slot's block in the request's block list (-1: not its block)
        order = np.argsort(blocks)
        pos = np.searchsorted(blocks[order], dead // self.bm.block_size)
        pos = np.minimum(pos, len(blocks) - 1)
        rank = order[pos]
        ok = (blocks[rank] == dead // self.bm.block_size) & usable[rank]
        dead, rank = dead[ok], rank[ok]
        return dead[np.lexsort((dead, rank))]
