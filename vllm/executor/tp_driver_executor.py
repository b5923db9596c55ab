"""TPDriverExecutor: what the tensor-parallel executors share, wherever ranks 1..N-1 live
(spawned processes: multiproc_executor.py; Ray actors: ray_distributed_executor.py).

Rank 0's Worker runs in the engine's process (its logits are the sampler's input, so they never
cross a process boundary). Every call the engine makes is a (method, args) pair that rank 0
broadcasts (TPGroup.broadcast_object) and then runs itself; every other rank runs serve_rank,
the same call on its shard:

    engine --execute_model(step)--> rank 0: broadcast ("execute_step", (step,)), run it
                                    rank r: receive, run it (collectives inside meet rank 0's)

A rank that raises or dies ends the executor: its collective fails at once (a dead or closed
peer), the subclass says which rank failed and why (WorkerFailed names it), the other ranks are
stopped, and every later call raises the same error.
"""
import logging
import os
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from vllm.config import VllmConfig
from vllm.distributed.tp_group import TPGroup
from vllm.executor.executor_base import ExecutorBase
from vllm.model_executor.tp_shards import TPShards
from vllm.worker.step_input import StepInput
from vllm.worker.step_output import StepOutput
from vllm.worker.worker import Worker

logger = logging.getLogger(__name__)

SHUTDOWN = "shutdown"
JOIN_TIMEOUT_S = 5.0


def rank_cores(rank: int, world_size: int, cores: List[int]) -> List[int]:
    """The cores rank `rank` gets: an equal share of this process's, in order (2 cores, 2
    ranks: [c0], [c1]); ranks share cores when there are fewer cores than ranks."""
    if len(cores) < world_size:
        return [cores[rank % len(cores)]]
    per = len(cores) // world_size
    return cores[rank * per:(rank + 1) * per]


def serve_rank(config: VllmConfig, rank: int, tp: TPGroup) -> None:
    """A rank other than 0, in its group: load its shard, then run rank 0's calls until
    shutdown. The group is closed on the way out, an error's way too, so that rank 0's next
    collective fails at once (a closed peer) instead of waiting out the group's timeout."""
    try:
        worker = Worker(config, rank, tp)
        while True:
            method, args = tp.broadcast_object()
            if method == SHUTDOWN:
                return
            getattr(worker, method)(*args)
    finally:
        tp.shutdown()


class WorkerFailed(RuntimeError):
    """A tensor-parallel rank raised or died; the executor cannot run further steps."""


class TPDriverExecutor(ExecutorBase):
    """Rank 0 in the engine's process, ranks 1..N-1 elsewhere running serve_rank. A subclass
    sets self.tp (rank 0's group, not yet connected) and self._finalizer (a weakref.finalize
    that stops the other ranks), starts them, then sets
    self.driver_worker = self._guard(self._start, config); and it answers three questions:
    _failed_worker (which rank ended, why), _check_workers_alive, _join_workers."""

    def __init__(self, config: VllmConfig):
        super().__init__(config)
        n = config.parallel_config.tensor_parallel_size
        if config.model_config.load_format == "simulate":
            raise ValueError("--load-format simulate has no model to shard: use "
                             "--tensor-parallel-size 1")
        TPShards(config.model_config.hf_config, 0, n)    # indivisible heads: ValueError now
        self.cores = sorted(os.sched_getaffinity(0))
        self.threads_before = torch.get_num_threads()
        torch.set_num_threads(len(rank_cores(0, n, self.cores)))
        self.failure: Optional[WorkerFailed] = None

    def _start(self, config: VllmConfig) -> Worker:
        if self.tp.world_size > 1:     # a group of one has nothing to connect to
            self.tp.connect()
        return Worker(config, 0, self.tp)

    # ---- what a subclass answers about its ranks ------------------------------------------------
    def _failed_worker(self) -> Optional[Tuple[int, str, str]]:
        """(rank, why in one line, its report) of the rank 1..N-1 that failed, else None."""
        raise NotImplementedError

    def _check_workers_alive(self) -> None:
        """Raises if a rank 1..N-1 has ended (it never ends before shutdown)."""
        raise NotImplementedError

    def _join_workers(self) -> None:
        """Wait (a bounded time) for ranks 1..N-1 to end after the shutdown call."""
        raise NotImplementedError

    # ---- every call: broadcast, then run on rank 0 ----------------------------------------------
    def _call(self, method: str, *args):
        return self._guard(self._broadcast_and_run, method, *args)

    def _broadcast_and_run(self, method: str, *args):
        self.tp.broadcast_object((method, args))
        return getattr(self.driver_worker, method)(*args)

    def _guard(self, fn, *args):
        if self.failure is not None:
            raise self.failure
        try:
            return fn(*args)
        except BaseException as e:
            self.failure = self._diagnose(e)
            self._kill_workers()
            raise self.failure from e

    def _diagnose(self, error: BaseException) -> WorkerFailed:
        """Which rank failed and why: a worker's report, its exit, or rank 0's own error."""
        found = self._failed_worker()
        if found is not None:
            rank, why, report = found
            logger.error("tensor-parallel rank %d failed:\n%s", rank, report or why)
            return WorkerFailed(f"tensor-parallel worker rank {rank} failed ({why}); "
                                f"the engine cannot continue")
        return WorkerFailed(f"tensor-parallel rank 0 failed ({type(error).__name__}: {error}); "
                            f"the engine cannot continue")

    def _kill_workers(self) -> None:
        self._finalizer()
        self.tp.shutdown()

    # ---- ExecutorBase ---------------------------------------------------------------------------
    def determine_num_kv_blocks(self) -> int:
        return self._call("determine_num_kv_blocks")

    def initialize_cache(self, num_blocks: int) -> None:
        self._call("initialize_cache", num_blocks)

    @property
    def gpu_memory_profile(self) -> Optional[dict]:
        return self.driver_worker.gpu_memory_profile

    def execute_model(self, step: StepInput) -> StepOutput:
        return self._call("execute_step", step)

    def sleep(self, level: int) -> None:
        self._call("sleep", level)

    def wake_up(self, num_blocks: int, tags: Tuple[str, ...]) -> None:
        self._call("wake_up", num_blocks, tags)

    def held_bytes(self) -> Dict[str, int]:
        return self._call("held_bytes")

    def set_relocation_executor(self, executor) -> None:
        raise ValueError("a custom relocation executor is a single-process test hook; it "
                         "cannot be installed at --tensor-parallel-size > 1")

    def relocation_stats(self) -> Dict[str, float]:
        return self.driver_worker.relocation_stats()

    def engine_info(self) -> Dict:
        info = self.driver_worker.info()
        info["tensor_parallel_size"] = self.tp.world_size
        return info

    def check_invariants(self, views: Dict[int, np.ndarray]) -> None:
        self._call("check_views", views)

    def check_health(self) -> None:
        """Raises WorkerFailed once a worker has failed or exited (also while no step runs)."""
        self._guard(self._check_workers_alive)

    def shutdown(self) -> None:
        if self.failure is None and self.tp.pg is not None:
            try:
                self.tp.broadcast_object((SHUTDOWN, ()))
                self._join_workers()
            except Exception:   # noqa: BLE001 -- a worker already gone: killed below
                pass
        self._finalizer()
        self.tp.shutdown()
        torch.set_num_threads(self.threads_before)
        self.failure = self.failure or WorkerFailed("the engine was shut down")
