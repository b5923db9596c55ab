"""Stage 1, eligibility: which running requests are worth planning this step."""
from typing import Set

import numpy as np

from vllm.core.block_manager import BlockManager
from vllm.core.request_kv import RequestKV


def candidate_blocks(req: RequestKV, bm: BlockManager, busy: Set[int]) -> np.ndarray:
    """Blocks a plan may touch: private, not the tail (still filling), not in an in-flight plan."""
    blocks = np.asarray(req.block_ids, dtype=np.int64)
    keep = (blocks != bm.token_table.tail_block(req.seq_id)) & ~bm.shared_mask(req, blocks)
    if busy:
        keep &= ~np.isin(blocks, np.fromiter(busy, np.int64))
    return blocks[keep]


def is_eligible(num_blocks: int, live: int, block_size: int, frag_threshold: float) -> bool:
    """`live` tokens in `num_blocks` candidate blocks: the dead share of their slots passes
    --kv-frag-threshold and packing the live tokens would free at least one block."""
    if num_blocks < 2:                     # (mid-prefill is fine: only computed tokens hold slots)
        return False
    dead_share = 1.0 - live / (num_blocks * block_size)
    return dead_share >= frag_threshold and -(-live // block_size) < num_blocks
