"""ExecutorBase: what the engine talks to instead of a model. One executor per engine owns the
workers (one per rank) and carries each step's StepInput to every one of them:

    UniProcExecutor            one Worker in the engine's process (world size 1)
    (to come) MultiprocExecutor, --distributed-executor-backend mp: one process per rank
    (to come) RayDistributedExecutor, ray: one actor per rank, across nodes

The engine keeps the scheduler, token tables, policies and relocation plans; the executor gets
plain values (StepInput) and returns plain values (StepOutput, with rank 0's logits and the
statistics summed over ranks). get_class() picks an executor from the parallel config; a setting
none here can run is a ValueError naming the flag.
"""
from abc import ABC, abstractmethod
from typing import Dict, Optional, Type

import numpy as np

from vllm.config import ParallelConfig, VllmConfig
from vllm.worker.step_input import StepInput
from vllm.worker.step_output import StepOutput


class ExecutorBase(ABC):
    def __init__(self, config: VllmConfig):
        self.config = config

    @staticmethod
    def get_class(parallel: ParallelConfig) -> Type["ExecutorBase"]:
        tp, backend = parallel.tensor_parallel_size, parallel.distributed_executor_backend
        if tp > 1:
            raise ValueError(f"--tensor-parallel-size {tp}: tensor parallelism is not implemented "
                             f"yet in this build (it needs the multiprocess executor, "
                             f"--distributed-executor-backend mp, which has not landed); use "
                             f"--tensor-parallel-size 1")
        if backend in ("mp", "ray"):
            raise ValueError(f"--distributed-executor-backend {backend}: this executor is not "
                             f"implemented yet in this build; use uni (or leave it unset)")
        from vllm.executor.uniproc_executor import UniProcExecutor
        return UniProcExecutor

    # ---- setup: every rank sizes its pool, all get the smallest ---------------------------------
    @abstractmethod
    def determine_num_kv_blocks(self) -> int:
        """KV blocks every rank can hold (the minimum over ranks)."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate num_blocks on every rank, so a block id means the same everywhere."""

    @property
    def gpu_memory_profile(self) -> Optional[dict]:
        """CUDA pool sizing figures (rank 0's), None off CUDA or with a fixed block count."""
        return None

    # ---- the step -------------------------------------------------------------------------------
    @abstractmethod
    def execute_model(self, step: StepInput) -> StepOutput:
        """Run one step on every rank (also a step of no rows: it still fences, submits and
        polls relocation copies)."""

    # ---- hooks: relocation, figures, invariants -----------------------------------------------
    @abstractmethod
    def set_relocation_executor(self, executor) -> None:
        """Install a copy executor (tests install one whose completion is delayed)."""

    @abstractmethod
    def relocation_stats(self) -> Dict[str, float]:
        """Copy launches, times and bytes moved ({} where nothing relocates)."""

    @abstractmethod
    def engine_info(self) -> Dict:
        """What rank 0 runs on (device, CPU, kernels, kernel plan)."""

    @abstractmethod
    def check_invariants(self, views: Dict[int, np.ndarray]) -> None:
        """Every rank's attention views equal the engine's (handle -> slots)."""

    def shutdown(self) -> None:
        """Release the workers (nothing to do in-process)."""

    @staticmethod
    def _check_views(rank: int, held: Dict[int, np.ndarray],
                     expected: Dict[int, np.ndarray]) -> None:
        assert held.keys() == expected.keys(), \
            f"rank {rank} holds views {sorted(held)}, the engine {sorted(expected)}"
        for h, slots in expected.items():
            assert np.array_equal(held[h], slots), \
                f"rank {rank}: view {h} differs from the engine's (its deltas went astray)"
