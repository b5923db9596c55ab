"""Worker: one per rank (today rank 0 of 1). It owns the model, the KV cache tensor, the model
runner and the relocation executor, and runs one StepInput at a time:

    engine (scheduler, token tables, policies, plans)      worker (this file)
    ------------------------------------------------------  ------------------------------------
    StepInputBuilder.build(scheduler output) -> StepInput --> execute_step:
                                                                fence, submit copies, poll (I3)
                                                                views += deltas, forward, logits
    KV manager <- copies done, statistics  <-- StepOutput <--  statistics, completed copy ids

Nothing here (nor in the model, attention or runner) imports vllm/core or vllm/sequence: a step
arrives as numbers, so the same code serves any number of ranks.

Sizing the KV pool is the worker's too: only it knows its bytes per block and, on CUDA, what a
profiling forward of its model leaves free (upstream's determine_num_available_blocks).
"""
import os
from typing import Dict, Optional

import numpy as np
import torch

from vllm.config import VllmConfig
from vllm.model_executor.model_loader import DTYPES, get_model
from vllm.worker.cuda_graph_runner import CudaGraphRunner
from vllm.worker.model_runner import ModelRunner, profile_forward
from vllm.worker.relocation import RelocationExecutor
from vllm.worker.step_input import StepInput
from vllm.worker.step_output import StepOutput



def kv_blocks_for_memory(total: int, used: int, utilization: float, block_bytes: int) -> int:
    """KV blocks that fit in utilization * total bytes besides `used` (the profiled peak)."""
    budget = int(total * utilization) - used
    if budget < block_bytes:
        raise ValueError(f"--gpu-memory-utilization {utilization}: {utilization} x "
                         f"{total / 2**30:.1f} GiB leaves {budget / 2**30:.2f} GiB for the KV "
                         f"cache after {used / 2**30:.2f} GiB of weights and activations: no KV "
                         f"block ({block_bytes} bytes) fits; raise it, or lower "
                         f"--max-num-batched-tokens")
    return budget // block_bytes


class Worker:
    def __init__(self, config: VllmConfig, rank: int = 0):
        self.config = config
        self.rank = rank
        mc = config.model_config
        self.device = torch.device(mc.device)
        self.simulated = mc.load_format == "simulate"
        torch.manual_seed(mc.seed)
        if self.simulated:   # no model math: the engine's KV plane runs for real
            from vllm.model_executor.models.simulated import SimulatedModel
            self.model = SimulatedModel(mc.hf_config, mc.seed)
        else:
            self.model = get_model(mc.model, mc.hf_config, mc.dtype, mc.max_model_len,
                                   mc.load_format, mc.seed, self.device)
        self.gpu_memory_profile: Optional[dict] = None   # CUDA pool sizing
        self.kv_caches: Optional[torch.Tensor] = None
        self.model_runner: Optional[ModelRunner] = None
        self.relocation: Optional[RelocationExecutor] = None   # where vToken reclaims

    # ---- sizing -------------------------------------------------------------------------------
    def block_bytes(self) -> int:
        cfg = self.model.config
        elem = torch.finfo(DTYPES[self.config.model_config.dtype]).bits // 8
        return (cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * elem
                * self.config.cache_config.block_size)

    def determine_num_kv_blocks(self) -> int:
        cc = self.config.cache_config
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        if self.device.type == "cuda":
            return self._num_gpu_blocks()
        budget = cc.kv_cache_memory
        if budget is None:   # a fifth of available RAM, at most 2 GiB
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            budget = min(avail // 5, 2 << 30)
        blocks = budget // self.block_bytes()
        if blocks < 1:
            raise ValueError(f"--kv-cache-memory: {budget} bytes hold no KV block "
                             f"({self.block_bytes()} bytes each)")
        return int(blocks)

    def _num_gpu_blocks(self) -> int:
        """Upstream's rule: the pool gets --gpu-memory-utilization of the GPU's total memory
        less the peak a profiling forward of --max-num-batched-tokens reaches (weights,
        activations, logits) and what is held outside torch's allocator (CUDA context, other
        processes)."""
        sc = self.config.scheduler_config
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        scratch = profile_forward(self.model, sc.max_num_batched_tokens, sc.max_model_len,
                                  sc.max_num_seqs)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - scratch
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        outside = max(total - free - torch.cuda.memory_allocated(), 0)
        self.gpu_memory_profile = {"total": total, "peak": peak, "outside": outside}
        return kv_blocks_for_memory(total, peak + outside,
                                    self.config.cache_config.gpu_memory_utilization,
                                    self.block_bytes())

    def initialize_cache(self, num_blocks: int) -> None:
        """The KV pool of num_blocks blocks (the same number on every rank, so block ids mean the
        same everywhere), and what reads it: the model runner, CUDA graphs, relocation."""
        c = self.config
        cfg, block_size = self.model.config, c.cache_config.block_size
        shape = (1, num_blocks * block_size, 2, 1, 1) if self.simulated else \
            (cfg.num_hidden_layers, num_blocks * block_size, 2, cfg.num_key_value_heads,
             cfg.head_dim)
        self.kv_caches = torch.zeros(shape, dtype=DTYPES[c.model_config.dtype],
                                     device=self.device)
        sc = c.scheduler_config
        self.model_runner = ModelRunner(self.model, self.kv_caches, sc.max_num_batched_tokens,
                                        sc.max_num_seqs, sc.max_model_len)
        if self.device.type == "cuda" and not c.model_config.enforce_eager:
            self.model_runner.graphs = CudaGraphRunner(self.model, self.kv_caches,
                                                       self.model_runner.buffers, sc.max_num_seqs)
        if c.kv_config.reclaims:
            self.relocation = RelocationExecutor(self.kv_caches,
                                                 force_sync=c.kv_config.reclaim_force_sync,
                                                 check=c.kv_config.check_invariants)

    # ---- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_step(self, step: StepInput) -> StepOutput:
        """Relocation first (fence, submit this step's copies, poll: completed batches' moves
        are applied by the engine after this step, so this step's views still read their
        sources, which stay valid until then), then the forward."""
        done = self.relocation.execute(step.copies) if self.relocation is not None else set()
        out = StepOutput(completed_copies=sorted(done))
        if step.num_rows == 0:
            return out
        runner = self.model_runner
        inp = runner.prepare_inputs(step)
        hidden = runner.execute(inp, self.relocation)
        out.logits, out.prompt_logits = runner.compute_logits(hidden, step)
        out.rows = runner.step_stats(inp)
        return out

    # ---- hooks for the engine and tests -------------------------------------------------------
    def set_relocation_executor(self, executor: RelocationExecutor) -> None:
        self.relocation = executor

    def relocation_stats(self) -> Dict[str, float]:
        return self.relocation.stats() if self.relocation is not None else {}

    def view_snapshot(self) -> Dict[int, np.ndarray]:
        """handle -> slots of the views this rank holds (the engine compares them with its own)."""
        return self.model_runner.views.snapshot()

    def info(self) -> Dict:
        """What this rank runs on: the CPU, the C kernels' variant and the load-time kernel plan
        (which GEMM / attention path each batch band uses)."""
        from vllm import cpu_kernels
        plan = getattr(self.model, "plan", None)
        return {"device": str(self.device), "cpu": cpu_kernels.cpu_name(),
                "cpu_kernels": cpu_kernels.active_isa() if cpu_kernels.available() else "off",
                "kernel_plan": plan.as_dict() if plan is not None else None}
