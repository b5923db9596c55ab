"""Stage 3, planning: pack a request's live tokens out of its sparsest private blocks.

A plan is a plain value computed from one consistent snapshot (I4). Example, block_size 4:

    block   7: [a . b c]   live 3          keep the k = ceil(5 / 4) = 2 densest blocks (7, 2)
    block   2: [. d . .]   live 1   ->     move e (block 9) into the first dead slot of block 7
    block   9: [e . . .]   live 1          block 9 is emptied: 3 blocks -> 2 (strict decrease)

A block registered in the prefix cache may give its tokens away (moving them out leaves its
bytes as its hash says) but never receives any, so it is kept only where it needs no holes.
"""
from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from vllm.core.token_table import block_positions


@dataclass
class BlockSnapshot:
    seq_id: str
    version: int              # token-table version the snapshot was taken at
    blocks: np.ndarray        # candidate blocks (private, not tail, not in flight), request order
    live_ids: np.ndarray      # live tokens inside the candidate blocks
    live_slots: np.ndarray
    block_size: int
    receivable: Optional[np.ndarray] = None   # bool per block; False: prefix-cached, no holes


@dataclass
class RelocationPlan:
    seq_id: str
    version: int
    token_ids: np.ndarray     # tokens to move
    src_slots: np.ndarray
    dst_slots: np.ndarray
    freed_blocks: List[int]   # emptied once the copy completes
    dst_blocks: List[int]     # receive tokens (their prefix-cache hashes become invalid)

    @property
    def moves(self) -> np.ndarray:
        return np.stack([self.token_ids, self.dst_slots], axis=1)


def _without_unmovable(snap: BlockSnapshot) -> BlockSnapshot:
    """Drop the non-receivable blocks whose tokens the receivable ones cannot take: the rest are
    emptied sparsest first while the receivable blocks' slots suffice."""
    bs, rec = snap.block_size, snap.receivable
    pos = block_positions(snap.live_slots, snap.blocks, bs)
    counts = np.bincount(pos, minlength=len(snap.blocks))
    # 2 receivable blocks of 4 slots (8) holding 3 tokens; the others hold [1, 3, 2] live:
    # sparsest first [1, 2, 3] -> loads 4, 6, 9 -> the 3-token block stays, two are emptied
    others = np.flatnonzero(~rec)
    others = others[np.argsort(counts[others], kind="stable")]
    load = counts[rec].sum() + np.cumsum(counts[others])
    stay = others[load > rec.sum() * bs]
    keep = np.ones(len(snap.blocks), bool)
    keep[stay] = False
    live = keep[pos]
    return BlockSnapshot(snap.seq_id, snap.version, snap.blocks[keep], snap.live_ids[live],
                         snap.live_slots[live], bs, rec[keep])


def plan(snap: BlockSnapshot) -> Optional[RelocationPlan]:
    if snap.receivable is not None and not snap.receivable.all():
        snap = _without_unmovable(snap)
    bs = snap.block_size
    nblocks = len(snap.blocks)
    pos = block_positions(snap.live_slots, snap.blocks, bs)   # each live token's block
    counts = np.bincount(pos, minlength=nblocks)
    keep_n = -(-len(snap.live_ids) // bs)
    if keep_n >= nblocks:
        return None                           # I4: the block count must strictly decrease
    receivable = np.ones(nblocks, bool) if snap.receivable is None else snap.receivable
    # receivable blocks first, densest first, ties: earlier block in the request's list first
    rank = np.lexsort((np.arange(nblocks), -counts, ~receivable))
    kept, emptied = rank[:keep_n], rank[keep_n:]
    assert receivable[kept].all(), "a non-receivable block would receive tokens"
    moving = np.isin(pos, emptied)
    occupied = np.zeros((nblocks, bs), dtype=bool)
    occupied[pos, snap.live_slots % bs] = True
    # dead slots of the kept blocks, densest block first, in offset order
    holes = (snap.blocks[kept][:, None] * bs + np.arange(bs))[~occupied[kept]]
    n_move = int(moving.sum())
    assert len(holes) >= n_move, "kept blocks cannot hold the moved tokens"
    dst = holes[:n_move]
    return RelocationPlan(
        seq_id=snap.seq_id, version=snap.version,
        token_ids=snap.live_ids[moving], src_slots=snap.live_slots[moving], dst_slots=dst,
        freed_blocks=snap.blocks[emptied].tolist(),
        dst_blocks=np.unique(dst // bs).tolist())
