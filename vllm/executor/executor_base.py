"""ExecutorBase: what the engine talks to instead of a model. One executor per engine owns the
workers (one per rank) and carries each step's StepInput to every one of them:

    UniProcExecutor            one Worker in the engine's process (world size 1)
    MultiprocExecutor          --distributed-executor-backend mp: rank 0 in the engine's
                               process, one spawned process per other rank
    RayDistributedExecutor     ray: rank 0 in the engine's process, one Ray actor per other
                               rank, placed by a placement group (across nodes)

The engine keeps the scheduler, token tables, policies and relocation plans; the executor gets
plain values (StepInput) and returns plain values (StepOutput, with rank 0's logits and the
statistics summed over ranks). get_class() picks an executor from the parallel config; a setting
none here can run is a ValueError naming the flag.
"""
from abc import ABC, abstractmethod
from typing import Dict, Optional, Tuple, Type

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
        backend = backend or ("mp" if tp > 1 else "uni")
        if backend == "uni" and tp > 1:
            raise ValueError(f"--distributed-executor-backend uni runs one process: it cannot "
                             f"run --tensor-parallel-size {tp}; use mp (the default) or ray")
        if backend == "ray":     # Ray is an optional extra: without it, a ValueError now
            from vllm.executor.ray_distributed_executor import (RayDistributedExecutor,
                                                                import_ray)
            import_ray()
            return RayDistributedExecutor
        if backend == "mp":
            from vllm.executor.multiproc_executor import MultiprocExecutor
            return MultiprocExecutor
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

    # ---- sleep mode: release and restore every rank's pool (and weights) ------------------------
    @abstractmethod
    def sleep(self, level: int) -> None:
        """Level 1: every rank releases its KV pool; level 2: its weights too."""

    @abstractmethod
    def wake_up(self, num_blocks: int, tags: Tuple[str, ...]) -> None:
        """Every rank restores what sleep() released, of tags ("weights": loads them again,
        "kv_cache": a pool of num_blocks)."""

    @abstractmethod
    def held_bytes(self) -> Dict[str, int]:
        """{"kv_cache", "weights"}: bytes held, summed over ranks."""

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

    def check_health(self) -> None:
        """Raises if the executor cannot run further steps (a worker failed); upstream's name."""

    def shutdown(self) -> None:
        """Release the workers (nothing to do in-process)."""
