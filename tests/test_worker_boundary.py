"""The worker boundary (issue 25's foundation): the engine talks to an executor, the executor's
workers get one plain, picklable StepInput per step and never touch the core.

- the worker side (vllm/worker, vllm/attention, vllm/model_executor/models) imports neither
  vllm/core nor vllm/sequence, directly or through any vllm module it imports;
- every StepInput of a run with eviction, relocation, prompt logprobs and chunked prefill holds
  numpy arrays and ints only, survives pickling, and drives a fresh worker to the same logits;
- decode steps send view deltas (one slot per row), rebuilt views go whole, and the engine's
  views and the worker's agree after every run (check_invariants catches a stray delta);
- the parallel flags: upstream's names, errors that name the flag, before any model loads.
"""
import argparse
import ast
import copy
import dataclasses
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import random_prompts
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.executor.uniproc_executor import UniProcExecutor
from vllm.worker.step_input import CopyBatch, StepInput
from vllm.worker.view_store import ViewStore
from vllm.worker.worker import Worker

ROOT = Path(__file__).resolve().parent.parent
WORKER_SIDE = ["vllm/worker", "vllm/attention", "vllm/model_executor/models"]
FORBIDDEN = ("vllm.core", "vllm.sequence", "vllm.engine", "vllm.executor", "vllm.entrypoints")
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
EVICT = dict(kv_eviction_policy="h2o", kv_eviction_ratio=0.5, kv_min_tokens=0,
             kv_reclamation="vtoken", kv_frag_threshold=0.0, kv_check_invariants=True)


# ---- imports ----------------------------------------------------------------------------------
def _module_file(name: str):
    base = ROOT / Path(*name.split("."))
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.exists():
            return f
    return None


def _vllm_imports(path: Path):
    """Every vllm module the file imports, at any depth of its code (lazy imports too)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        yield from (n for n in names if n == "vllm" or n.startswith("vllm."))


def test_worker_side_never_imports_core_or_sequence():
    todo = [p for d in WORKER_SIDE for p in sorted((ROOT / d).glob("*.py"))]
    seen, reached = set(todo), {}
    while todo:
        path = todo.pop()
        for name in _vllm_imports(path):
            if name == "vllm":
                continue      # the package itself (its __init__ is the user-facing API)
            reached.setdefault(name, str(path.relative_to(ROOT)))
            f = _module_file(name)
            if f is not None and f not in seen:
                seen.add(f)
                todo.append(f)
    bad = {n: by for n, by in reached.items() if n.startswith(FORBIDDEN)}
    assert not bad, f"the worker side reaches engine-side modules: {bad}"
    assert "vllm.worker.step_input" in reached and "vllm.attention.backend" in reached


# ---- the step input ---------------------------------------------------------------------------
def _plain(value, where):
    if isinstance(value, (bool, int, np.integer, type(None))):
        return
    if isinstance(value, np.ndarray):
        assert value.dtype != object, where
        return
    if isinstance(value, list):
        for v in value:
            _plain(v, where)
        return
    assert isinstance(value, CopyBatch), f"{where}: {type(value).__name__} is not plain"
    for f in dataclasses.fields(value):
        _plain(getattr(value, f.name), f"{where}.{f.name}")


def record_steps(llm):
    """Wrap the executor: every (StepInput, StepOutput) of the engine's steps, deep-copied."""
    ex, steps = llm.llm_engine.model_executor, []
    original = ex.execute_model

    def recorded(step):
        sent = copy.deepcopy(step)
        out = original(step)
        steps.append((sent, out))
        return out
    ex.execute_model = recorded
    return steps


def test_step_inputs_are_plain_and_replay_on_a_fresh_worker(tiny_llama):
    """Everything a rank needs is in the StepInput: a second worker fed the pickled inputs
    computes the same logits and statistics (with the same relocation copies, fences, views)."""
    llm = LLM(tiny_llama, num_gpu_blocks_override=40, max_num_batched_tokens=48, **EVICT)
    steps = record_steps(llm)
    prompts = random_prompts(4, seed=11, lo=40, hi=90)
    params = [GREEDY, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                     prompt_logprobs=2)] * 2
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.check_invariants()
    assert llm.get_kv_stats()["relocation_events"] > 0
    eng = llm.llm_engine
    replica = Worker(eng.model_executor.config, rank=0)
    replica.initialize_cache(eng.kv.num_blocks)
    kinds = set()
    for sent, out in steps:
        for f in dataclasses.fields(StepInput):
            _plain(getattr(sent, f.name), f.name)
        again = replica.execute_step(pickle.loads(pickle.dumps(sent)))
        assert again.completed_copies == out.completed_copies
        for a, b in ((again.logits, out.logits), (again.prompt_logits, out.prompt_logits)):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
        for a, b in zip(again.rows, out.rows, strict=True):
            for x, y in ((a.scores, b.scores), (a.key_statistic, b.key_statistic)):
                assert (x is None) == (y is None) and (x is None or np.array_equal(x, y))
        kinds.update(k for k, present in (
            ("copies", sent.copies is not None and sent.copies.batch_id is not None),
            ("prefill", sent.num_rows > sent.num_decodes), ("prompt_logits",
                                                            len(sent.prompt_logit_spans) > 0),
            ("masked", len(sent.mask_view_ids) > 0), ("mass", sent.decode_mass),
            ("no rows", sent.num_rows == 0)) if present)
    assert kinds >= {"copies", "prefill", "prompt_logits", "masked", "mass"}
    assert torch.equal(replica.kv_caches, eng.kv_caches)      # the same bytes in every slot
    assert replica.view_snapshot().keys() == eng.worker.view_snapshot().keys()


def test_decode_steps_send_one_slot_per_row(tiny_llama):
    """Native: after a request's first step its view only grows, so a decode step carries one
    slot per row, however long the context."""
    llm = LLM(tiny_llama, num_gpu_blocks_override=64)
    steps = record_steps(llm)
    prompts = random_prompts(3, seed=2, lo=30, hi=60)
    llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    decode = [s for s, _ in steps if s.num_rows and s.num_decodes == s.num_rows]
    assert len(decode) >= GREEDY.max_tokens - 2
    for s in decode:
        assert (s.view_new_lens == 1).all() and (s.view_keep > 0).all()
        assert len(s.view_new_slots) == s.num_rows and np.array_equal(s.view_new_slots,
                                                                      s.slot_mapping)
    sizes = [len(pickle.dumps(s)) for s in decode]
    assert max(sizes) - min(sizes) < 200        # O(rows), not O(context)
    assert llm.get_kv_stats()["translation_rebuilds"] == len(prompts)
    llm.llm_engine.check_invariants()


def test_evictions_travel_as_positions_and_a_stray_delta_is_caught(tiny_llama):
    """H2O: a decode row whose tokens were evicted sends their positions and its new slot, not
    its view (unless a relocation moved its tokens: then the view from the first moved one)."""
    llm = LLM(tiny_llama, num_gpu_blocks_override=64, **EVICT)
    steps = record_steps(llm)
    llm.generate([{"prompt_token_ids": p} for p in random_prompts(2, seed=4, lo=40, hi=60)],
                 GREEDY, use_tqdm=False)
    decode = [s for s, _ in steps if s.num_rows and s.num_decodes == s.num_rows]
    evicting = [s for s in decode if s.view_drop_lens.sum() > 0]
    assert len(evicting) > 2
    for s in evicting:
        plain = (s.view_drop_lens > 0) & (s.view_new_lens == 1)
        assert plain.any() and (s.view_keep[plain] > 0).all()
        assert len(s.view_drops) == s.view_drop_lens.sum()
    eng = llm.llm_engine
    eng.check_invariants()
    views = eng.runner.views._views
    if not views:
        pytest.skip("no view held after the run")
    handle = next(iter(views))
    views[handle].slots[0] += 1              # a view the engine did not send
    with pytest.raises(AssertionError, match="differs from the engine"):
        eng.check_invariants()


def test_view_store_applies_drops_and_refuses_deltas_out_of_step():
    store = ViewStore()
    step = StepInput(num_new=np.array([1]), num_decodes=1, view_handles=np.array([7]),
                     view_keep=np.array([0]), view_new_lens=np.array([2]),
                     view_new_slots=np.array([4, 9]))
    assert [v.tolist() for v in store.update(step)] == [[4, 9]]
    step.view_keep, step.view_new_lens, step.view_new_slots = (np.array([2]), np.array([1]),
                                                               np.array([12]))
    assert [v.tolist() for v in store.update(step)] == [[4, 9, 12]]
    step.view_keep, step.view_new_slots = np.array([2]), np.array([13])
    step.view_drop_lens, step.view_drops = np.array([1]), np.array([1])
    assert [v.tolist() for v in store.update(step)] == [[4, 12, 13]]     # 9 evicted
    step.view_drops = np.array([3])
    with pytest.raises(RuntimeError, match="out of step"):
        store.update(step)
    step.view_drop_lens, step.view_keep = np.array([0]), np.array([5])
    with pytest.raises(RuntimeError, match="out of step"):
        store.update(step)


def test_a_failed_step_sends_every_view_whole_next(tiny_llama):
    llm = LLM(tiny_llama, num_gpu_blocks_override=64)
    eng = llm.llm_engine
    for i, p in enumerate(random_prompts(2, seed=3, lo=10, hi=20)):
        eng.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    eng.step()
    builder = eng.input_builder
    sched = eng.scheduler.schedule()
    assert (builder.build(sched.scheduled)[0].view_keep > 0).all()
    builder.forget_views()
    assert (builder.build(sched.scheduled)[0].view_keep == 0).all()
    eng.abort_request(["0", "1"])


# ---- the executor and the flags ---------------------------------------------------------------
def test_engine_runs_through_the_uniproc_executor(tiny_llama):
    eng = LLM(tiny_llama, num_gpu_blocks_override=16,
              distributed_executor_backend="uni").llm_engine
    assert isinstance(eng.model_executor, UniProcExecutor)
    assert not {"model", "kv_caches", "runner"} & set(vars(eng))   # rank 0's, reached through
    assert eng.model is eng.model_executor.driver_worker.model
    assert eng.get_engine_info()["device"] == "cpu"


@pytest.mark.parametrize("kwargs,match", [
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"),
     "--distributed-executor-backend uni runs one process: it cannot run "
     "--tensor-parallel-size 2"),
    (dict(pipeline_parallel_size=2), r"--pipeline-parallel-size: pipeline parallelism is not "
                                     r"supported by this engine \(got 2\)"),
    (dict(data_parallel_size=4), r"--data-parallel-size: data parallelism is not supported"),
    (dict(distributed_executor_backend="nccl"), "--distributed-executor-backend: must be one"),
    (dict(tensor_parallel_size=0), "--tensor-parallel-size: must be >= 1"),
])
def test_parallel_flags_fail_fast_naming_the_flag(kwargs, match):
    # --distributed-executor-backend ray now runs (without Ray installed it is a ValueError
    # saying how to install it): tests/test_ray_executor.py
    with pytest.raises(ValueError, match=match):   # before the (missing) model is looked at
        LLM("/nonexistent/model", **kwargs)


def test_cli_has_upstreams_parallel_flags():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["-tp", "1", "--pipeline-parallel-size", "1", "-dp", "1",
         "--distributed-executor-backend", "uni"]))
    assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size,
            args.distributed_executor_backend) == (1, 1, 1, "uni")
    assert EngineArgs().parallel_config().world_size == 1
    with pytest.raises(SystemExit):
        parser.parse_args(["--distributed-executor-backend", "nccl"])
