"""TokenTable: per-request map from logical token id to physical KV slot plus liveness.

                logical id   0    1    2    3    4    5    6
    slot        (int32)     32   33   34   35   80   81   82     slot = block_id * block_size + offset
    live        (bool)       T    F    T    T    F    T    T

Policies mark tokens dead (`evict_token`); the block manager registers new tokens
(`sync_new_tokens`); the reclamation backend repoints moved tokens (`apply_moves`).
Block occupancy is derived from these same arrays, so liveness and occupancy never disagree.
"""
from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np


def block_positions(slots: np.ndarray, blocks: np.ndarray, block_size: int) -> np.ndarray:
    """Index in `blocks` of each slot's block, -1 where the block is not among them: the one
    slot-to-block lookup (a table over block ids, no sort). Slots must be >= 0."""
    # blocks [9, 4], block_size 4, slots [37, 16, 5] -> their blocks [9, 4, 1] -> [0, 1, -1]
    slot_blocks = np.asarray(slots, np.int64) // block_size
    blocks = np.asarray(blocks, np.int64)
    size = max(int(slot_blocks.max(initial=-1)), int(blocks.max(initial=-1))) + 1
    table = np.full(size, -1, np.int64)
    table[blocks] = np.arange(len(blocks))
    return table[slot_blocks]


class _Entry:
    __slots__ = ("slot", "live", "length", "num_live", "tail_block", "tail_fill", "version")

    def __init__(self, capacity: int = 64):
        self.slot = np.full(capacity, -1, dtype=np.int32)
        self.live = np.zeros(capacity, dtype=bool)
        self.length = 0          # logical tokens registered
        self.num_live = 0
        self.tail_block = -1     # block receiving new tokens
        self.tail_fill = 0       # slots of tail_block handed out
        self.version = 0         # new value on every structural change (unique across entries)

    def grow(self, needed: int) -> None:
        if needed <= len(self.slot):
            return
        cap = max(needed, 2 * len(self.slot))
        self.slot = np.concatenate([self.slot, np.full(cap - len(self.slot), -1, np.int32)])
        self.live = np.concatenate([self.live, np.zeros(cap - len(self.live), bool)])


class TokenTable:
    """All requests' token tables (canonical copy on the CPU), keyed by request id."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._entries: Dict[str, _Entry] = {}
        self._clock = 0          # source of versions: a re-added request never reuses one

    def _bump(self, e: _Entry) -> None:
        self._clock += 1
        e.version = self._clock

    # ---- lifecycle -------------------------------------------------------------------------
    def add_request(self, req_id: str) -> None:
        assert req_id not in self._entries, f"token table for {req_id} already exists"
        self._entries[req_id] = e = _Entry()
        self._bump(e)

    def free_request(self, req_id: str) -> None:
        self._entries.pop(req_id, None)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def request_ids(self) -> List[str]:
        return list(self._entries)

    # ---- the paper's interface --------------------------------------------------------------
    def sync_new_tokens(self, req_id: str, block_ids: Sequence[int], total_len: int,
                        holes: Optional[np.ndarray] = None) -> np.ndarray:
        """Register logical ids [length, total_len); returns their slots.

        New tokens take the given dead `holes` first (hole filling), then continue the tail:
        the rest of the current tail block, then each block after it in block_ids.
        """
        e = self._entries[req_id]
        n_new = total_len - e.length
        assert n_new >= 0, f"{req_id}: total_len {total_len} < registered {e.length}"
        if n_new == 0:
            return np.empty(0, dtype=np.int32)
        reused = np.empty(0, np.int64) if holes is None else np.asarray(holes, np.int64)[:n_new]
        slots = np.concatenate([reused, self._tail_slots(e, block_ids, n_new - len(reused))])
        assert len(slots) == n_new, f"{req_id}: blocks hold {len(slots)} new slots, need {n_new}"
        e.grow(total_len)
        e.slot[e.length:total_len] = slots
        e.live[e.length:total_len] = True
        e.length = total_len
        e.num_live += n_new
        if len(slots) > len(reused):
            last = int(slots[-1])
            e.tail_block, e.tail_fill = last // self.block_size, last % self.block_size + 1
        return slots.astype(np.int32)

    def _tail_slots(self, e: _Entry, block_ids: Sequence[int], n: int) -> np.ndarray:
        if n == 0:
            return np.empty(0, np.int64)
        bs = self.block_size
        if e.tail_block >= 0:
            after = len(block_ids) - 1 - list(reversed(block_ids)).index(e.tail_block)
            head = np.arange(e.tail_block * bs + e.tail_fill, (e.tail_block + 1) * bs)
        else:
            after, head = -1, np.empty(0, dtype=np.int64)
        fresh = np.asarray(block_ids[after + 1:], dtype=np.int64)
        # fresh blocks [7, 2], block_size 4 -> slots [28, 29, 30, 31, 8, 9, 10, 11]
        body = (fresh[:, None] * bs + np.arange(bs)).ravel()
        return np.concatenate([head, body])[:n]

    def forget_blocks(self, req_id: str, blocks: Iterable[int]) -> None:
        """Dead tokens whose block left the request point nowhere (-1) from now on."""
        e = self._entries[req_id]
        n = e.length
        gone = np.isin(e.slot[:n] // self.block_size, np.asarray(list(blocks), np.int64))
        assert not (gone & e.live[:n]).any(), f"{req_id}: freeing a block with live tokens"
        e.slot[:n][gone] = -1

    def dead_slots(self, req_id: str) -> np.ndarray:
        """Slots that hold only dead tokens' KV (reusable), ascending."""
        e = self._entries[req_id]
        if e.num_live == e.length:
            return np.empty(0, np.int64)
        n = e.length
        dead = e.slot[:n][~e.live[:n]]
        return np.setdiff1d(dead[dead >= 0], e.slot[:n][e.live[:n]]).astype(np.int64)

    def evict_token(self, req_id: str, token_id: int) -> None:
        self.evict_tokens(req_id, np.array([token_id], dtype=np.int64))

    def evict_tokens(self, req_id: str, token_ids: np.ndarray) -> None:
        e = self._entries[req_id]
        token_ids = np.asarray(token_ids, dtype=np.int64)
        if len(token_ids) == 0:
            return
        assert token_ids.max() < e.length and token_ids.min() >= 0, f"{req_id}: evicting unknown id"
        assert e.live[token_ids].all(), f"{req_id}: evicting a token that is already dead"
        e.live[token_ids] = False
        e.num_live -= len(np.unique(token_ids))
        self._bump(e)

    def apply_moves(self, req_id: str, moves: np.ndarray) -> None:
        """moves: int64 [M, 2] rows of (token_id, new_slot); repoints all of them at once.

        A token evicted while its copy was in flight moves too: its source slot must be vacated.
        """
        e = self._entries[req_id]
        moves = np.asarray(moves, dtype=np.int64).reshape(-1, 2)
        ids, dst = moves[:, 0], moves[:, 1]
        assert len(np.unique(ids)) == len(ids), f"{req_id}: a token moved twice in one plan"
        e.slot[ids] = dst
        self._bump(e)

    # ---- views ------------------------------------------------------------------------------
    def length(self, req_id: str) -> int:
        return self._entries[req_id].length

    def num_live(self, req_id: str) -> int:
        return self._entries[req_id].num_live

    def version(self, req_id: str) -> int:
        return self._entries[req_id].version

    def tail_block(self, req_id: str) -> int:
        return self._entries[req_id].tail_block

    def tail_free(self, req_id: str) -> int:
        """Unused slots left in the tail block (0 before the first block)."""
        e = self._entries.get(req_id)
        if e is None or e.tail_block < 0:
            return 0
        return self.block_size - e.tail_fill

    def live_ids(self, req_id: str) -> np.ndarray:
        e = self._entries[req_id]
        if e.num_live == e.length:
            return np.arange(e.length, dtype=np.int64)
        return np.flatnonzero(e.live[:e.length])

    def live_slots(self, req_id: str) -> np.ndarray:
        """Attention view: slots of live tokens in logical order."""
        e = self._entries[req_id]
        if e.num_live == e.length:
            return e.slot[:e.length]
        return e.slot[:e.length][e.live[:e.length]]

    def slots(self, req_id: str, start: int, end: int) -> np.ndarray:
        return self._entries[req_id].slot[start:end]

    def all_slots(self, req_id: str) -> np.ndarray:
        """Slots of every registered token, dead ones included (their KV still occupies them)."""
        e = self._entries[req_id]
        return e.slot[:e.length]

    def block_occupancy(self, req_id: str, block_ids: Sequence[int]) -> np.ndarray:
        """Live tokens per block, aligned with block_ids (tokens in other blocks are ignored)."""
        pos = block_positions(self.live_slots(req_id), block_ids, self.block_size)
        # block_ids [9, 4, 7], live tokens in blocks [4, 4, 9] -> pos [1, 1, 0] -> [1, 2, 0]
        return np.bincount(pos[pos >= 0], minlength=len(block_ids))

    # ---- invariant I2 -----------------------------------------------------------------------
    def check_invariants(self, req_id: str, block_ids: Sequence[int]) -> None:
        e = self._entries[req_id]
        bs = self.block_size
        live_slots = e.slot[:e.length][e.live[:e.length]].astype(np.int64)
        if e.num_live != len(live_slots):
            raise AssertionError(f"request {req_id}: num_live {e.num_live} != {len(live_slots)} live")
        if len(np.unique(live_slots)) != len(live_slots):
            raise AssertionError(f"request {req_id}: I2 violated, a slot is mapped by two live tokens")
        owned = np.isin(live_slots // bs, np.asarray(block_ids, dtype=np.int64))
        if not owned.all():
            bad = live_slots[~owned][:4].tolist()
            raise AssertionError(f"request {req_id}: I2 violated, live slots {bad} outside its blocks")
