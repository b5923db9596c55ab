"""Reclamation driven by pool pressure (scheduler + KV manager, no model). Two requests of 34
tokens in 4-token blocks (9 blocks each: 8 candidates and the tail, room for 2 more tokens) each
lose one token in four of their blocks: 4 dead slots of 32, a dead share of 12.5%, under the default
--kv-frag-threshold (25%), so nothing repacks while the pool has room -- but repacking either
frees a block. When a new request (or a running one's next token) is one block short, the
scheduler plans that repacking and waits for it instead of refusing or preempting."""
import numpy as np

from vllm.config import KVEvictionConfig, SchedulerConfig
from vllm.core.kv_manager import KVManager
from vllm.core.scheduler import Scheduler
from vllm.core.step_stats import StepStats
from vllm.sampling_params import SamplingParams
from vllm.sequence import Sequence

BS = 4


class Sched(Scheduler):
    """The scheduler as the engine drives it: a sequence's KV state is added with it."""

    def add(self, seq: Sequence) -> None:
        self.kv.add_request(seq.seq_id)
        super().add(seq)


def make(num_blocks: int, reclamation: str = "vtoken"):
    cfg = KVEvictionConfig(policy="h2o", reclamation=reclamation, check_invariants=True,
                           min_tokens=0)
    kv = KVManager(num_blocks, BS, False, cfg, num_layer_heads=1)
    return kv, Sched(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128), kv)


def seq(i: int, n: int) -> Sequence:
    return Sequence(f"s{i}", f"r{i}", 0, None, list(range(3, 3 + n)), SamplingParams(), None)


def step(sched: Scheduler, kv: KVManager):
    """One engine step without a model: tokens computed, copies completed at once (CPU)."""
    out = sched.schedule()
    for s, n in out.scheduled:
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.append_token(7)          # the sampled token; its slot comes with the next step
    if out.copies is not None and out.copies.batch_id is not None:
        kv.copies_done({out.copies.batch_id})
    kv.check_invariants()
    return out


def engine_step(sched: Scheduler, kv: KVManager):
    """step() in the engine's order: copies complete, tokens count as computed, the KV
    manager's after_step runs (no statistics: nothing evicts), then the sampled tokens join."""
    out = sched.schedule()
    if out.copies is not None and out.copies.batch_id is not None:
        kv.copies_done({out.copies.batch_id})
    for s, n in out.scheduled:
        s.num_computed_tokens += n
    kv.after_step(StepStats())
    for s, _ in out.scheduled:
        if s.num_computed_tokens == s.num_tokens:
            s.append_token(7)
    return out


def two_sparse_requests(num_blocks: int, reclamation: str = "vtoken"):
    kv, sched = make(num_blocks, reclamation)
    a, b = seq(0, 34), seq(1, 34)
    sched.add(a)
    sched.add(b)
    step(sched, kv)
    for s in (a, b):                   # one dead token in each of blocks 0..3
        kv.token_table.evict_tokens(s.seq_id, np.array([1, 5, 9, 13]))
    if kv.reclaimer is not None:
        kv.reclaimer.plan_step([kv.requests[s] for s in kv.seqs])
        assert not kv.reclaimer.pending, "12.5% dead is under the threshold: no plan"
    return kv, sched, a, b


def test_a_request_one_block_short_is_admitted_after_repacking():
    kv, sched, a, b = two_sparse_requests(num_blocks=19)        # 18 held, 1 free
    c = seq(2, 8)                                               # needs 2 blocks
    sched.add(c)
    out = step(sched, kv)              # plans a repack, sends it, c waits first in line
    assert c not in [s for s, _ in out.scheduled] and out.copies.batch_id is not None
    assert kv.stats()["pressure_relocations"] == 1
    out = step(sched, kv)              # the copy landed: a block came back
    assert c in [s for s, _ in out.scheduled]
    assert len(sched.running) == 3 and sched.num_preemptions == 0
    assert kv.stats()["blocks_reclaimed"] == 1


def test_without_reclamation_the_request_waits_for_a_finish():
    kv, sched, a, b = two_sparse_requests(num_blocks=19, reclamation="none")
    c = seq(2, 8)
    sched.add(c)
    out = step(sched, kv)
    out = step(sched, kv)
    assert sched.waiting[0] is c and c not in [s for s, _ in out.scheduled]


def test_a_running_request_short_of_a_block_waits_instead_of_preempting():
    kv, sched, a, b = two_sparse_requests(num_blocks=18)        # full
    for _ in range(5):                 # tokens 35, 36 fill the tails; 37 needs a block each
        step(sched, kv)
    assert sched.num_preemptions == 0 and kv.stats()["pressure_relocations"] == 2
    assert sched.running == [a, b] and min(a.num_computed_tokens, b.num_computed_tokens) > 36


def test_no_pressure_no_copy():
    """With room to spare nothing repacks that the threshold would not repack."""
    kv, sched, a, b = two_sparse_requests(num_blocks=40)
    c = seq(2, 8)
    sched.add(c)
    out = step(sched, kv)
    assert c in [s for s, _ in out.scheduled]
    assert out.copies is None and kv.stats()["relocation_events"] == 0


def test_victim_is_the_latest_request_without_a_plan(monkeypatch):
    """running [a, b, c], a and c repacking: b is preempted before c, whose blocks come back;
    with every request repacking, the latest (c) goes."""
    kv, sched, a, b = two_sparse_requests(num_blocks=40)
    c = seq(2, 8)
    sched.add(c)
    step(sched, kv)
    assert sched.running == [a, b, c]
    monkeypatch.setattr(kv, "will_free", lambda seq_id: seq_id in ("s0", "s2"))
    assert sched._victim(0) is b and sched._victim(2) is c
    monkeypatch.setattr(kv, "will_free", lambda seq_id: True)
    assert sched._victim(0) is c


def test_repacking_planned_ahead_keeps_every_row_running():
    """Full pool: after token 35 each tail has one free slot, so the next two tokens need a
    block each. The KV manager plans that repacking right after the step; its copies run with
    token 36 and free the blocks token 37 takes: no request ever waits a step."""
    kv, sched, a, b = two_sparse_requests(num_blocks=18)
    for _ in range(5):
        out = engine_step(sched, kv)
        assert [s for s, _ in out.scheduled] == [a, b]
    assert sched.num_preemptions == 0 and kv.stats()["pressure_relocations"] == 2
    assert min(a.num_computed_tokens, b.num_computed_tokens) == 39


def test_planning_ahead_copies_nothing_while_the_pool_has_room():
    """Tokens 35-42 take two blocks each (at 37 and 41): exactly the 4 free ones."""
    kv, sched, a, b = two_sparse_requests(num_blocks=22)
    for _ in range(8):
        engine_step(sched, kv)
    stats = kv.stats()
    assert kv.bm.num_free_blocks == 0 and a.num_computed_tokens == 42
    assert stats["relocation_events"] == 0 and stats["pressure_relocations"] == 0
