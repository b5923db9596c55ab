"""--distributed-executor-backend ray (RayDistributedExecutor) on a local Ray cluster, CPU, fp32:

- TP=2 on Ray produces the greedy tokens and the eviction logs of TP=1 (no eviction; H2O with
  vToken reclamation, invariants on every rank each step), with late arrivals and an abort;
- shutdown kills the actors and removes the placement group (the cluster's resources come back
  whole); a Ray session the executor started itself is shut down with it;
- a killed actor, or one that raises, fails the next call within seconds with WorkerFailed
  naming rank 1; the engine stays failed;
- a placement group the cluster cannot hold is a ValueError naming the flag after the timeout;
- without Ray importable the flag is a ValueError that says how to install it, before any model
  is looked at.

Ray starts once for the module (2 CPUs: bundle 0 for rank 0, bundle 1 for rank 1's actor); the
test of a session the executor starts itself runs before it.
"""
import sys
import time

import pytest

ray = pytest.importorskip("ray")

from tests.test_tensor_parallel import GREEDY, PROMPTS, run  # noqa: E402
from vllm import LLM  # noqa: E402
from vllm.config import ParallelConfig  # noqa: E402
from vllm.executor.executor_base import ExecutorBase  # noqa: E402
from vllm.executor.tp_driver_executor import WorkerFailed  # noqa: E402
from vllm.executor import ray_distributed_executor  # noqa: E402
from vllm.executor.ray_distributed_executor import RayDistributedExecutor  # noqa: E402

RAY = dict(tensor_parallel_size=2, distributed_executor_backend="ray")
EVICT = dict(kv_eviction_policy="h2o", kv_eviction_ratio=0.5, kv_min_tokens=0,
             kv_reclamation="vtoken", kv_frag_threshold=0.0, block_size=4)


def _rank_actors_alive() -> int:
    from ray._private import state
    return sum(a["State"] != "DEAD" and a.get("ActorClassName", "").endswith("RankActor")
               for a in state.actors().values())


def _assert_all_released(timeout_s: float = 15.0) -> None:
    """No rank actor alive, no placement group's resources left, every CPU free again."""
    deadline = time.monotonic() + timeout_s
    while True:
        free, total = ray.available_resources(), ray.cluster_resources()
        groups = [k for k in free if "_group_" in k]
        alive = _rank_actors_alive()
        if not alive and not groups and free.get("CPU") == total.get("CPU"):
            return
        assert time.monotonic() < deadline, (alive, groups, free, total)
        time.sleep(0.2)


# ---- without a cluster ------------------------------------------------------------------------
def test_without_ray_the_flag_is_a_value_error_naming_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)      # import ray -> ImportError
    with pytest.raises(ValueError, match=r"--distributed-executor-backend ray needs Ray.*"
                                         r"pip install '\.\[ray\]'.*requirements-ray\.txt"):
        LLM("/nonexistent/model", **RAY)                # before the model is looked at
    with pytest.raises(ValueError, match="pip install"):
        ExecutorBase.get_class(ParallelConfig(2, distributed_executor_backend="ray"))


class _FailsToUnpickle:
    """Pickles on rank 0; unpickling it (rank 1) raises ValueError."""

    def __reduce__(self):
        return int, ("not a number",)


def test_raising_actor_fails_fast_and_the_session_the_executor_started_ends(tiny_llama,
                                                                          monkeypatch):
    """The executor starts Ray itself. Rank 1 then raises (it cannot read the call) while rank 0
    waits in a collective with it: the actor closes its group on the way out, so rank 0 fails
    at once (not at the group's timeout), naming rank 1; Ray ends with the executor."""
    if ray.is_initialized():
        pytest.skip("Ray is already running in this process")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)      # a local cluster of its own
    llm = LLM(tiny_llama, num_gpu_blocks_override=32, **RAY)
    executor = llm.llm_engine.model_executor
    assert isinstance(executor, RayDistributedExecutor) and ray.is_initialized()
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)

    def broadcast_then_wait():
        executor.tp.broadcast_object(("determine_num_kv_blocks", (_FailsToUnpickle(),)))
        executor.tp.barrier()
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed, match=r"tensor-parallel worker rank 1 failed \(Ray actor "
                                           r"on .*: ValueError: invalid literal"):
        executor._guard(broadcast_then_wait)
    assert time.monotonic() - t0 < 30
    llm.llm_engine.shutdown()
    assert not ray.is_initialized()


# ---- on a local cluster started once ----------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():
        pytest.skip("Ray is already running in this process")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level="warning")
    yield ray
    ray.shutdown()


@pytest.mark.parametrize("cfg", [{}, EVICT], ids=["no-eviction", "h2o-vtoken"])
def test_tp2_on_ray_equals_tp1_and_shutdown_releases_everything(cluster, tiny_llama, cfg):
    cfg = dict(num_gpu_blocks_override=64, max_num_batched_tokens=16, **cfg)
    tp1, stats1 = run(tiny_llama, 1, **cfg)
    tp2, stats2 = run(tiny_llama, 2, distributed_executor_backend="ray", **cfg)  # shuts down
    assert tp2 == tp1
    assert any(log for _, log in tp1.values()) == bool(cfg.get("kv_eviction_policy"))
    for key in ("evicted_tokens", "relocation_events", "hole_slots_reused", "preemptions"):
        assert stats2.get(key) == stats1.get(key), key
    _assert_all_released()
    assert ray.is_initialized()            # the fixture's session: not the executor's to end


def test_killed_actor_is_an_error_naming_rank_1_and_nothing_is_left(cluster, tiny_llama):
    llm = LLM(tiny_llama, num_gpu_blocks_override=32, **RAY)
    eng = llm.llm_engine
    (actor,) = eng.model_executor.actors
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
    ray.kill(actor)
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed, match=r"tensor-parallel worker rank 1 failed \(Ray actor "
                                           r"on .*: the actor died"):
        llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY, use_tqdm=False)
    assert time.monotonic() - t0 < 30
    with pytest.raises(WorkerFailed):          # the engine stays failed: no step runs half
        llm.generate([{"prompt_token_ids": PROMPTS[2]}], GREEDY, use_tqdm=False)
    with pytest.raises(WorkerFailed):
        eng.check_health()
    eng.shutdown()
    _assert_all_released()


def test_a_placement_the_cluster_cannot_hold_is_a_value_error_and_leaves_nothing(
        cluster, tiny_llama, monkeypatch):
    """4 ranks of 1 CPU on a 2-CPU cluster: the placement group never fits; the executor gives
    up after its timeout (2 s here) naming the flag, and removes the group."""
    monkeypatch.setattr(ray_distributed_executor, "PLACEMENT_TIMEOUT_S", 2.0)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 4 --distributed-executor-"
                                         r"backend ray: the Ray cluster could not place 4"):
        LLM(tiny_llama, num_gpu_blocks_override=32, tensor_parallel_size=4,
            distributed_executor_backend="ray")
    _assert_all_released()
