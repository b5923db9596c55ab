"""Property tests: random appends, evictions, plans, delayed completions, preemptions and aborts
against the token table, block manager and reclamation backend; I1, I2, I4 and block accounting
hold after every step."""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from vllm.config import KVEvictionConfig
from vllm.core.kv_manager import KVManager
from vllm.core.reclaim.planner import BlockSnapshot, plan
from vllm.sampling_params import SamplingParams
from vllm.sequence import Sequence
from vllm.worker.relocation import DelayedRelocationExecutor

BS = 4
NUM_BLOCKS = 48
LAYERS = 2


class Harness:
    """The KV plane without a model: every token's K/V payload is its (seq, id) fingerprint.
    The KV manager plans, a delayed executor copies, as the engine wires them."""

    def __init__(self, delay: int, frag: float, fill: bool = False):
        cfg = KVEvictionConfig(policy="random", frag_threshold=frag, check_invariants=True,
                               min_tokens=0,
                               reclamation="vtoken-fill" if fill else "vtoken")
        self.kvm = KVManager(NUM_BLOCKS, BS, False, cfg, num_layer_heads=1)
        self.bm = self.kvm.bm
        self.backend = self.kvm.reclaimer
        self.kv = torch.zeros(LAYERS, NUM_BLOCKS * BS, 2, 1, 2)
        self.executor = DelayedRelocationExecutor(self.kv, delay, check=True)
        self.running = []
        self.next_id = 0

    def payload(self, seq: Sequence, ids: np.ndarray) -> torch.Tensor:
        base = torch.tensor(ids, dtype=torch.float32) + 1000.0 * int(seq.seq_id)
        return base[None, :, None, None, None].expand(LAYERS, -1, 2, 1, 2)

    def write(self, seq: Sequence, start: int, end: int) -> None:
        """A forward writing this step's K/V: as in the worker, the step's copies and fences
        (a request that left with a batch in flight) run first, since its freed blocks may
        already belong to the request written here."""
        self.step_copies()
        slots = torch.from_numpy(self.bm.token_table.slots(seq.seq_id, start, end).astype(np.int64))
        self.kv[:, slots] = self.payload(seq, np.arange(start, end))
        seq.num_computed_tokens = end

    def add(self, n: int) -> None:
        seq = Sequence(str(self.next_id), str(self.next_id), 0, None, list(range(n)),
                       SamplingParams(), None)
        self.next_id += 1
        self.kvm.add_request(seq.seq_id)
        if not self.kvm.can_allocate(seq, [], n):
            self.kvm.drop_request(seq.seq_id)
            return
        self.kvm.allocate(seq, [], n)
        self.write(seq, 0, n)
        self.running.append(seq)

    def append(self, i: int, n: int) -> None:
        seq = self.running[i]
        if not self.kvm.can_append(seq, n):
            return
        seq.token_ids += [7] * n
        start = seq.num_computed_tokens
        self.kvm.append_slots(seq, n)
        self.write(seq, start, start + n)

    def evict(self, i: int, frac: float, seed: int) -> None:
        seq = self.running[i]
        live = self.bm.token_table.live_ids(seq.seq_id)[:-1]      # the newest token stays
        pick = np.random.default_rng(seed).permutation(live)[:int(frac * len(live))]
        self.bm.token_table.evict_tokens(seq.seq_id, np.sort(pick))
        self.kvm.eviction.free_dead_blocks(self.state(seq))

    def reclaim(self) -> None:
        """One engine step's worth: plan (after a step), copies (schedule), execute, apply."""
        self.backend.plan_step([self.state(s) for s in self.running])
        self.step_copies()

    def step_copies(self) -> None:
        self.kvm.copies_done(self.executor.execute(self.kvm.take_copies()))

    def remove(self, i: int) -> None:
        seq = self.running.pop(i)
        self.kvm.free(seq)
        self.kvm.drop_request(seq.seq_id)

    def state(self, seq: Sequence):
        """The sequence's KV state (RequestKV)."""
        return self.kvm.requests[seq.seq_id]

    def check(self) -> None:
        tt = self.bm.token_table
        self.kvm.check_invariants({s.seq_id for s in self.running})   # I2, accounting, no leak
        for seq in self.running:
            ids = tt.live_ids(seq.seq_id)
            slots = torch.from_numpy(tt.live_slots(seq.seq_id).astype(np.int64))
            assert torch.equal(self.kv[:, slots], self.payload(seq, ids)), seq.seq_id  # I1
        for plan_ in self.backend.in_flight.values():                           # I4: pinned
            assert all(self.bm.pool.ref_cnt[b] > 0 for b in plan_.freed_blocks)
        assert set(tt.request_ids()) == {s.seq_id for s in self.running}


ops = st.lists(st.tuples(st.sampled_from(["add", "append", "evict", "reclaim", "remove"]),
                         st.integers(0, 10 ** 6), st.floats(0.0, 0.9)), min_size=5, max_size=60)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, delay=st.integers(0, 3), frag=st.sampled_from([0.0, 0.25, 0.6]),
       fill=st.booleans())
def test_random_operations_keep_invariants(ops, delay, frag, fill):
    h = Harness(delay, frag, fill)
    for op, k, x in ops:
        if op == "add" or not h.running:
            h.add(1 + k % 40)
        elif op == "append":
            h.append(k % len(h.running), 1 + k % 6)
        elif op == "evict":
            h.evict(k % len(h.running), x, k)
        elif op == "reclaim":
            h.reclaim()
        else:
            h.remove(k % len(h.running))
        h.check()
    while h.running:
        h.remove(0)
    h.check()
    assert h.bm.num_free_blocks == NUM_BLOCKS


def test_reclaim_packs_to_ideal_footprint():
    h = Harness(delay=0, frag=0.0)
    h.add(64)                                          # 16 blocks
    seq = h.running[0]
    h.evict(0, 0.5, seed=3)
    h.reclaim()
    h.check()
    live = h.bm.token_table.num_live(seq.seq_id)
    # the tail block is never a candidate, so ideal = ceil(live outside tail / BS) + tail
    tail = h.bm.token_table.tail_block(seq.seq_id)
    in_tail = int(h.bm.token_table.block_occupancy(seq.seq_id, [tail])[0])
    assert len(h.state(seq).block_ids) == -(-(live - in_tail) // BS) + 1
    assert h.backend.events == 1


def test_delayed_completion_defers_moves_and_frees():
    h = Harness(delay=2, frag=0.0)
    h.add(64)
    seq = h.running[0]
    h.evict(0, 0.5, seed=5)
    before_slots = h.bm.token_table.all_slots(seq.seq_id).copy()
    before_blocks = list(h.state(seq).block_ids)
    h.reclaim()                                        # submits; completes 2 steps later
    assert h.backend.in_flight and list(h.state(seq).block_ids) == before_blocks
    assert (h.bm.token_table.all_slots(seq.seq_id) == before_slots).all()
    h.append(0, 1)                                     # decoding continues meanwhile: a step
    h.check()
    assert h.backend.in_flight                         # 1 step left
    h.reclaim()                                        # lands, moves applied, blocks freed
    assert not h.backend.in_flight and len(h.state(seq).block_ids) < len(before_blocks)
    h.check()


def test_planner_strict_decrease_and_shared_exclusion():
    # live: block 10 -> 3 tokens, block 11 -> 1 token: one block suffices
    snap = BlockSnapshot("r", 1, np.array([10, 11]), np.array([0, 1, 2, 5]),
                         np.array([40, 41, 43, 46]), 4)
    p = plan(snap)
    assert p.freed_blocks == [11] and p.token_ids.tolist() == [5] and p.dst_slots.tolist() == [42]
    full = BlockSnapshot("r", 1, np.array([10, 11]), np.arange(5), np.array([40, 41, 42, 43, 44]), 4)
    assert plan(full) is None                          # 5 live tokens need 2 blocks: no decrease


def test_shared_blocks_never_planned():
    from vllm.core.reclaim.eligibility import candidate_blocks
    h = Harness(delay=0, frag=0.0)
    h.add(32)
    seq = h.running[0]
    shared = h.state(seq).block_ids[:3]
    h.bm.pool.touch(shared)                            # another request holds the prefix
    cands = candidate_blocks(h.state(seq), h.bm, busy=set())
    assert not set(shared) & set(cands.tolist())
    h.bm.pool.release(shared)


def test_hole_filling_reuses_dead_slots_before_growing():
    h = Harness(delay=0, frag=1.0, fill=True)          # frag 1.0: no relocation, only filling
    h.add(32)                                          # 8 full blocks
    seq = h.running[0]
    h.evict(0, 0.25, seed=1)                           # 7 holes
    holes = h.kvm.filler.holes(h.state(seq), 100)
    blocks = list(h.state(seq).block_ids)
    h.append(0, len(holes))                            # all land in holes: no new block
    assert h.state(seq).block_ids == blocks
    assert (h.bm.token_table.slots(seq.seq_id, 32, 32 + len(holes)) == holes).all()
    h.check()
    h.append(0, 1)                                     # no hole left: the tail grows
    assert len(h.state(seq).block_ids) == len(blocks) + 1
    h.check()


def test_hole_filling_skips_in_flight_and_shared_blocks():
    h = Harness(delay=3, frag=0.0, fill=True)
    h.add(40)
    seq = h.running[0]
    h.evict(0, 0.5, seed=2)
    h.reclaim()                                        # plan in flight for 3 steps
    busy = h.backend.busy_blocks(seq.seq_id)
    assert busy
    holes = h.kvm.filler.holes(h.state(seq), 100)
    assert not set((holes // BS).tolist()) & busy
    shared = [b for b in h.state(seq).block_ids if b not in busy][:1]
    h.bm.pool.touch(shared)
    assert not set((h.kvm.filler.holes(h.state(seq), 100) // BS).tolist()) & set(shared)
    h.bm.pool.release(shared)


def test_evict_token_hides_one_token_and_keeps_occupancy_derived():
    h = Harness(delay=0, frag=1.0)
    h.add(8)                                           # blocks of 4: [0..3], [4..7]
    seq = h.running[0]
    tt = h.bm.token_table
    tt.evict_token(seq.seq_id, 5)
    assert tt.live_ids(seq.seq_id).tolist() == [0, 1, 2, 3, 4, 6, 7]
    assert tt.num_live(seq.seq_id) == 7
    assert tt.block_occupancy(seq.seq_id, h.state(seq).block_ids).tolist() == [4, 3]
    with pytest.raises(AssertionError, match="already dead"):
        tt.evict_token(seq.seq_id, 5)
    h.check()
