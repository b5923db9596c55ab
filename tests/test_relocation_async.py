"""The asynchronous relocation protocol end to end (I3), with a copy executor whose completion
is delayed by N engine steps and whose destinations hold NaN until the copy lands:

- decoding continues while plans are in flight (requests decode tokens during their window);
- attention keeps reading the old slots: no view or write slot touches an in-flight copy's
  slots, and every slot a step reads is finite;
- apply_moves and block freeing wait for completion: token-table slots and block_ids stay
  unchanged while pending, apply_moves only sees landed copies, no freed block holds one;
- greedy outputs are token-identical to Naive-Evict with the same policy.
Plus the executor's CPU state machine."""
import numpy as np
import pytest
import torch

from tests.conftest import random_prompts
from vllm import LLM, SamplingParams
from vllm.worker.relocation import CopyEvent, DelayedRelocationExecutor, RelocationExecutor

GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
ARGS = dict(kv_eviction_policy="random", kv_eviction_ratio=0.5, kv_min_tokens=0,
            kv_check_invariants=True,
            kv_frag_threshold=0.0)


class ProbeExecutor(DelayedRelocationExecutor):
    """Delayed executor that checks the engine's state every step while copies are in flight."""

    def __init__(self, kv_caches, delay_steps):
        super().__init__(kv_caches, delay_steps)
        self.kv = None                       # the engine's KV manager, set once installed
        self.batches = []                    # (event, src, dst)
        self.windows = {}                    # plan -> tokens computed by its request, seen pending

    def submit(self, batch_id, src, dst):
        event = super().submit(batch_id, src, dst)
        self.batches.append((event, src.clone(), dst.clone()))
        return event

    def pending_slots(self, which: int) -> np.ndarray:
        """Slots of copies not yet landed: which=1 sources, which=2 destinations."""
        pending = [b[which] for b in self.batches if not b[0].query()]
        return torch.cat(pending).numpy() if pending else np.empty(0, np.int64)

    def step(self):   # first thing of every poll, before completions are reported
        tt = self.kv.token_table
        for seq_id, plan in self.kv.reclaimer.in_flight.items():
            seq = self.kv.seqs[seq_id]
            assert (tt.all_slots(seq_id)[plan.token_ids] == plan.src_slots).all(), \
                "moved before completion"
            assert set(plan.freed_blocks) <= set(self.kv.requests[seq_id].block_ids), \
                "freed before completion"
            self.windows.setdefault(id(plan), set()).add(seq.num_computed_tokens)
        super().step()


def read_and_written_slots(meta):
    """(slots the step's attention reads, slots its new tokens are written to), as numpy."""
    real = meta.decode_bias.reshape(meta.decode_slots.shape) == 0
    reads = [meta.decode_slots[real]] + [p.kv_slots for p in meta.prefills]
    return torch.cat(reads).numpy(), meta.slot_mapping.numpy()


def install_probe(llm, delay):
    eng = llm.llm_engine
    probe = ProbeExecutor(eng.kv_caches, delay)
    eng.set_relocation_executor(probe)
    probe.kv = eng.kv
    counts = {"applied": 0, "relocation_frees": 0, "old_slot_reads": 0}
    prepare, tt, bm = eng.runner.prepare_inputs, eng.kv.bm.token_table, eng.kv.bm

    def checked_prepare(*args, **kwargs):
        inp = prepare(*args, **kwargs)
        reads, writes = read_and_written_slots(inp.meta)
        src, dst = probe.pending_slots(1), probe.pending_slots(2)
        assert not np.isin(reads, dst).any(), "attention reads a destination before it landed"
        assert not np.isin(writes, np.concatenate([src, dst])).any(), "a write hits a copy"
        counts["old_slot_reads"] += bool(np.isin(src, reads).any())   # moved tokens, old slots
        old = torch.from_numpy(np.setdiff1d(reads, writes))     # read before this step's writes
        assert torch.isfinite(eng.kv_caches[:, old]).all(), "a step reads poisoned KV"
        return inp

    def checked_apply(req_id, moves):
        dst = torch.from_numpy(np.asarray(moves)[:, 1].astype(np.int64))
        owner = [e for e, _, d in probe.batches if np.isin(dst.numpy(), d.numpy()).all()]
        assert owner and owner[0].query(), "apply_moves before the copy completed"
        assert torch.isfinite(eng.kv_caches[:, dst]).all()
        counts["applied"] += 1
        return type(tt).apply_moves(tt, req_id, moves)

    def checked_free(seq, blocks):
        pending = np.concatenate([probe.pending_slots(1), probe.pending_slots(2)]) // bm.block_size
        assert not np.isin(np.asarray(list(blocks)), pending).any(), \
            "a block holding an in-flight copy's slots was freed"
        emptied = [s // bm.block_size for _, s, _ in probe.batches]       # sources' blocks
        counts["relocation_frees"] += bool(emptied) and np.isin(blocks, torch.cat(emptied)).any()
        return type(bm).free_blocks(bm, seq, blocks)

    eng.runner.prepare_inputs, tt.apply_moves, bm.free_blocks = \
        checked_prepare, checked_apply, checked_free
    return probe, counts


def generate(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    eng = llm.llm_engine
    eng.check_invariants()
    assert eng.kv.bm.num_free_blocks == eng.kv.bm.num_blocks
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(4, seed=5, lo=100, hi=200)


@pytest.mark.parametrize("delay,blocks", [(1, 96), (3, 96), (5, 52)])   # 52: tight, no preemption
def test_delayed_copies_keep_outputs_and_invariants(tiny_llama, prompts, delay, blocks):
    # No preemption in either run: a preempted request re-runs its policy on re-prefill, so
    # a different preemption schedule (vToken frees more) would legitimately change outputs.
    naive_llm = LLM(tiny_llama, kv_reclamation="none", num_gpu_blocks_override=blocks, **ARGS)
    naive = generate(naive_llm, prompts)
    llm = LLM(tiny_llama, kv_reclamation="vtoken", num_gpu_blocks_override=blocks, **ARGS)
    probe, counts = install_probe(llm, delay)
    assert generate(llm, prompts) == naive
    stats = llm.get_kv_stats()
    assert stats["preemptions"] == naive_llm.get_kv_stats()["preemptions"] == 0
    assert stats["relocation_events"] > 0 and stats["blocks_reclaimed"] > 0
    llm.llm_engine.step()    # delivers the fence of a batch whose request finished mid-copy
    assert probe.landed == probe.launches == len(probe.batches) > 0
    assert counts["applied"] > 0 and counts["relocation_frees"] > 0
    assert counts["old_slot_reads"] > 0      # steps that read moved tokens at their old slots
    # requests kept decoding while their own plan was in flight
    assert max(len(seen) for seen in probe.windows.values()) >= min(delay, 2)
    # a request that left with its copy in flight had it fenced (fence -> wait lands it)
    early = sum(e.steps_left > 0 for e, _, _ in probe.batches)
    print(f"delay {delay}: {len(probe.batches)} batches, {early} landed early at a finish")


# ---- the executor's state machine on CPU --------------------------------------------------------
def kv_and_moves():
    kv = torch.randn(2, 16, 2, 1, 4)
    return kv, torch.tensor([1, 2, 3]), torch.tensor([9, 10, 11])


@pytest.mark.parametrize("force_sync", [False, True])
def test_cpu_executor_completes_at_once(force_sync):
    kv, src, dst = kv_and_moves()
    expect = kv.clone()
    expect[:, dst] = expect[:, src]
    ex = RelocationExecutor(kv, force_sync=force_sync, check=True)
    event = ex.submit(7, src, dst)
    assert isinstance(event, CopyEvent) and event.query() and torch.equal(kv, expect)
    assert ex.poll() == {7} and ex.poll() == set()
    ex.pre_attention()                       # no stream on CPU: a no-op
    ex.fence([7])                            # completed: nothing to wait for
    assert ex.launches == 1 and ex.copy_time > 0 and ex.blocked_time == 0
    assert set(ex.stats()) == {"copy_launches", "copy_time_s", "copy_blocked_s", "copy_device_s",
                               "bytes_moved"}
    assert ex.stats()["bytes_moved"] == 3 * kv[:, 0].numel() * 4


def test_executor_checks_conservation():
    """I1 on the worker side: a copy whose destination bytes differ from its sources fails."""
    kv, src, dst = kv_and_moves()
    ex = DelayedRelocationExecutor(kv, delay_steps=1, check=True)
    ex.submit(0, src, dst)
    assert ex.poll() == set()
    kv[:, src[0]] += 1.0                     # a source overwritten before the copy landed
    with pytest.raises(AssertionError, match="I1"):
        ex.poll()


def test_delayed_executor_poisons_until_it_lands():
    kv, src, dst = kv_and_moves()
    expect = kv.clone()
    expect[:, dst] = expect[:, src]
    ex = DelayedRelocationExecutor(kv, delay_steps=2)
    first = ex.submit(0, src[:2], dst[:2])
    assert ex.poll() == set()                # the step it was submitted in
    second = ex.submit(1, src[2:], dst[2:])
    assert ex.poll() == set()
    assert not first.query() and torch.isnan(kv[:, dst]).all()
    assert ex.poll() == {0}                  # first lands (2 steps later), second is 1 step in
    assert not second.query() and torch.equal(kv[:, dst[:2]], expect[:, dst[:2]])
    ex.fence([1])                            # a leaving request's batch: ordered before reuse
    assert second.query() and torch.equal(kv, expect) and ex.landed == 2
    assert ex.poll() == {1}
    assert DelayedRelocationExecutor(kv, delay_steps=0).submit(0, src, dst).query()
