"""UniProcExecutor: the single-process executor, one Worker (rank 0 of 1) in the engine's own
process. Each call is a plain method call on the same StepInput a remote rank would receive, so
single-process and multi-rank engines share one code path up to the transport."""
from typing import Dict, Optional, Tuple

import numpy as np

from vllm.config import VllmConfig
from vllm.executor.executor_base import ExecutorBase
from vllm.worker.step_input import StepInput
from vllm.worker.step_output import StepOutput
from vllm.worker.worker import Worker


class UniProcExecutor(ExecutorBase):
    def __init__(self, config: VllmConfig):
        super().__init__(config)
        self.driver_worker = Worker(config, rank=0)

    def determine_num_kv_blocks(self) -> int:
        return self.driver_worker.determine_num_kv_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.driver_worker.initialize_cache(num_blocks)

    @property
    def gpu_memory_profile(self) -> Optional[dict]:
        return self.driver_worker.gpu_memory_profile

    def execute_model(self, step: StepInput) -> StepOutput:
        return self.driver_worker.execute_step(step)

    def sleep(self, level: int) -> None:
        self.driver_worker.sleep(level)

    def wake_up(self, num_blocks: int, tags: Tuple[str, ...]) -> None:
        self.driver_worker.wake_up(num_blocks, tags)

    def held_bytes(self) -> Dict[str, int]:
        return self.driver_worker.held_bytes()

    def set_relocation_executor(self, executor) -> None:
        self.driver_worker.set_relocation_executor(executor)

    def relocation_stats(self) -> Dict[str, float]:
        return self.driver_worker.relocation_stats()

    def engine_info(self) -> Dict:
        return self.driver_worker.info()

    def check_invariants(self, views: Dict[int, np.ndarray]) -> None:
        self.driver_worker.check_views(views)
