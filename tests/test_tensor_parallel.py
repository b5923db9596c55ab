"""Tensor parallelism (--distributed-executor-backend mp) on CPU, fp32: TP=2 (and TP=4, KV heads
replicated) produce the greedy tokens and the eviction logs of TP=1, with eviction, every
reclamation mode, prefix caching, chunked prefill, requests arriving mid-run, preemption in a
small pool and aborts; invariants (I1 on every rank's views) every step; a killed worker is a
clear error naming its rank, and nothing outlives the engine.

Tolerance: the ranks' partial sums (O and down projections, attention statistics) are added in
another order than one process adds them, so logits differ in the last bits; on these models no
greedy token and no eviction decision depends on them, and the tests hold them equal.
"""
import multiprocessing
import os
import signal
import time
from typing import Dict, Tuple

import pytest

from vllm import LLM, SamplingParams
from vllm.executor.multiproc_executor import MultiprocExecutor
from vllm.executor.tp_driver_executor import WorkerFailed, rank_cores

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
SHARED = [(5 * i + 7) % 500 + 3 for i in range(20)]          # a shared prefix: cache hits
PROMPTS = [SHARED + [11, 12, 13], SHARED + [21, 22], [40 + i for i in range(33)],
           [300 + i for i in range(9)], SHARED[:12] + [99] * 6, [7, 8, 9]]
EVICT = dict(kv_eviction_ratio=0.5, kv_min_tokens=0, kv_frag_threshold=0.0)


def run(model: str, tp: int, **cfg) -> Tuple[Dict[str, tuple], dict]:
    """Half the prompts at once, the rest a few steps later, one aborted mid-run; invariants
    after every step. -> (request id -> (tokens, eviction log), KV stats)."""
    llm = LLM(model, tensor_parallel_size=tp, kv_check_invariants=True, kv_eviction_log=True,
              **cfg)
    eng = llm.llm_engine
    try:
        seqs = {}                  # request id -> (sequence, its RequestKV)

        def add(i):
            eng.add_request(f"r{i}", {"prompt_token_ids": PROMPTS[i]}, GREEDY)
            seq = eng.requests[f"r{i}"].seqs[0]
            seqs[f"r{i}"] = seq, eng.kv.requests[seq.seq_id]
        for i in range(3):
            add(i)
        steps = 0
        while eng.has_unfinished_requests() or steps < 4:
            eng.step()
            eng.check_invariants()
            steps += 1
            if steps == 3:
                for i in range(3, len(PROMPTS)):
                    add(i)
            if steps == 5:
                eng.abort_request("r4")
            assert steps < 500
        assert eng.kv.bm.num_free_blocks == eng.kv.bm.num_blocks
        return ({rid: (tuple(s.output_token_ids), [a.tolist() for a in kv.eviction_log or []])
                 for rid, (s, kv) in seqs.items() if rid != "r4"}, eng.get_kv_stats())
    finally:
        eng.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_tp2_greedy_tokens_equal_tp1(tiny_models, arch):
    cfg = dict(num_gpu_blocks_override=64, enable_prefix_caching=True,
               max_num_batched_tokens=16)
    tp1, _ = run(tiny_models[arch], 1, **cfg)
    tp2, stats = run(tiny_models[arch], 2, **cfg)
    assert tp2 == tp1
    assert stats["prefix_cache_hit_blocks"] > 0


@pytest.mark.parametrize("mode", ["none", "vtoken", "vtoken-fill"])
@pytest.mark.parametrize("policy", ["h2o", "snapkv", "keydiff", "rkv", "value-random"])
def test_tp2_eviction_and_relocation_equal_tp1(tiny_llama, policy, mode):
    """A 26-block pool of 4-token blocks: requests preempt one another; the ranks' statistics
    are summed before the policy sees them, so it evicts the tokens TP=1 evicts."""
    cfg = dict(num_gpu_blocks_override=26, block_size=4, enable_prefix_caching=True,
               max_num_batched_tokens=16, kv_eviction_policy=policy, kv_reclamation=mode,
               kv_budget_tokens=24, **EVICT)
    tp1, stats1 = run(tiny_llama, 1, **cfg)
    tp2, stats2 = run(tiny_llama, 2, **cfg)
    assert tp2 == tp1
    assert any(log for _, log in tp1.values()), "nothing was evicted"
    for key in ("evicted_tokens", "relocation_events", "hole_slots_reused", "blocks_reclaimed",
                "preemptions"):
        assert stats2[key] == stats1[key], key
    if mode != "none" and policy == "h2o":   # evicts while decoding: vtoken repacks sparse
        # blocks, vtoken-fill also writes new tokens into holes
        assert stats2["relocation_events"] + stats2["hole_slots_reused"] > 0
    print(policy, mode, {k: stats2[k] for k in ("evicted_tokens", "relocation_events",
                                                 "hole_slots_reused", "preemptions")})


def test_tp4_replicates_kv_heads(tiny_llama):
    """4 ranks, 2 KV heads: each rank holds one KV head (ranks 0-1 head 0, ranks 2-3 head 1)."""
    cfg = dict(num_gpu_blocks_override=48, kv_eviction_policy="h2o", kv_reclamation="vtoken",
               block_size=4, **EVICT)
    assert run(tiny_llama, 4, **cfg)[0] == run(tiny_llama, 1, **cfg)[0]


def test_rank_cores_split_the_cores():
    assert rank_cores(0, 2, [0, 1]) == [0] and rank_cores(1, 2, [0, 1]) == [1]
    assert rank_cores(1, 2, [0, 1, 2, 3, 4]) == [2, 3]
    assert rank_cores(3, 4, [0, 1]) == [1]           # fewer cores than ranks: shared


def test_indivisible_heads_are_a_value_error_naming_the_flag(tiny_llama):
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 3: the model has 4 attention "
                                         r"heads, 2 KV heads"):
        LLM(tiny_llama, tensor_parallel_size=3)
    assert not multiprocessing.active_children()


def test_killed_worker_is_a_clear_error_and_nothing_is_left(tiny_llama):
    llm = LLM(tiny_llama, tensor_parallel_size=2, num_gpu_blocks_override=32)
    eng = llm.llm_engine
    executor = eng.model_executor
    assert isinstance(executor, MultiprocExecutor)
    (worker,) = executor.procs
    os.kill(worker.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed, match="tensor-parallel worker rank 1 failed"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
    assert time.monotonic() - t0 < 30
    with pytest.raises(WorkerFailed):          # the engine stays failed: no step runs half
        llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY, use_tqdm=False)
    eng.shutdown()
    assert not worker.is_alive() and not multiprocessing.active_children()


def test_a_rank_that_dies_before_joining_is_an_error_at_once():
    """(A script without the __main__ guard: its spawned rank dies importing it.) Rank 0 does
    not wait out the group's timeout."""
    from vllm.distributed.shm_segment import PeerGone
    from vllm.distributed.tp_group import TPGroup
    p = multiprocessing.get_context("spawn").Process(target=os._exit, args=(3,))
    p.start()
    tp = TPGroup(0, 2, connect=False, peer_alive=p.is_alive)
    t0 = time.monotonic()
    try:
        with pytest.raises(PeerGone, match="ended before it joined"):
            tp.connect()
        assert time.monotonic() - t0 < 30 and p.exitcode == 3
    finally:
        tp.shutdown()


def test_shutdown_and_garbage_collection_leave_no_worker(tiny_llama):
    import gc
    llm = LLM(tiny_llama, tensor_parallel_size=2, num_gpu_blocks_override=32)
    executor = llm.llm_engine.model_executor
    (worker,) = executor.procs
    tp = executor.tp                 # sums, logits and step inputs went through shared memory
    shms = [tp.shm, tp.shm_gather, tp.shm_bcast]
    segments = [f"/dev/shm/{shm.name.lstrip('/')}" for shm in shms]
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
    assert all(shm.calls > 0 for shm in shms) and all(map(os.path.exists, segments))
    llm.llm_engine.shutdown()
    assert not worker.is_alive() and not any(map(os.path.exists, segments))
    llm = LLM(tiny_llama, tensor_parallel_size=2, num_gpu_blocks_override=32)
    (worker,) = llm.llm_engine.model_executor.procs
    del llm
    gc.collect()
    worker.join(10)
    assert not worker.is_alive() and not multiprocessing.active_children()
