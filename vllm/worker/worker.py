"""Worker: one per rank. It owns its model shard, its KV cache shard (its KV heads), the model
runner and the relocation executor, and runs one StepInput at a time:

    engine (scheduler, token tables, policies, plans)      worker (this file)
    ------------------------------------------------------  ------------------------------------
    StepInputBuilder.build(scheduler output) -> StepInput --> execute_step:
                                                                fence, submit copies, poll (I3)
                                                                views += deltas, forward, logits
    KV manager <- copies done, statistics  <-- StepOutput <--  statistics, completed copy ids

Nothing here (nor in the model, attention or runner) imports vllm/core or vllm/sequence: a step
arrives as numbers, so the same code serves any number of ranks.

With tensor parallelism every rank runs the same StepInput (the same copies and views: a block
id means the same everywhere) and one all-reduce agrees on what the engine sees: each row's
attention statistics summed over ranks (each holds part of the heads), and a copy batch counted
complete only once every rank has completed it.

Sizing the KV pool is the worker's too: only it knows its bytes per block and, on CUDA, what a
profiling forward of its model leaves free (upstream's determine_num_available_blocks).
"""
import gc
import itertools
import os
from typing import Dict, List, Optional, Set, Tuple

import numpy as np
import torch

from vllm import huge_pages
from vllm.attention import kv_quant
from vllm.config import VllmConfig
from vllm.distributed.tp_group import TPGroup
from vllm.model_executor.layers.attention import kv_groups
from vllm.model_executor.model_loader import DTYPES, get_model
from vllm.worker.cuda_graph_runner import CudaGraphRunner
from vllm.worker.input_buffers import patch_chunk
from vllm.worker.model_runner import ModelRunner, profile_forward
from vllm.worker.relocation import RelocationExecutor
from vllm.worker.step_input import StepInput
from vllm.worker.step_output import RowStats, StepOutput


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


def runner_buffer_bytes(max_tokens: int, max_seqs: int, max_view_len: int, graphs: bool) -> int:
    """Device bytes the model runner holds besides the pool and what a forward allocates, all
    made after sizing: its InputBuffers (int64: input_ids, positions, slot_mapping [max_tokens],
    view_lens [max_seqs], the view table [max_seqs, max_view_len] and the patch staging area,
    2 * patch_chunk), a step's decode mass (float32 [max_seqs, max_view_len], made per step)
    and, with CUDA graphs, the graph runner's own mass table of that shape."""
    grid = max_seqs * max_view_len
    inputs = 8 * (3 * max_tokens + max_seqs + 2 * patch_chunk(max_tokens, max_seqs) + grid)
    return inputs + 4 * grid * (2 if graphs else 1)


class Worker:
    def __init__(self, config: VllmConfig, rank: int = 0, tp: Optional[TPGroup] = None):
        self.config = config
        self.rank = rank
        self.tp = tp or TPGroup()
        mc = config.model_config
        self.device = self.tp.device if self.tp.world_size > 1 else torch.device(mc.device)
        kv_quant.check_device(config.cache_config.kv_cache_dtype, self.device, DTYPES[mc.dtype])
        if self.device.type == "cuda":
            if self.device.index is None:    # "cuda": the current device, named by its index
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        self.simulated = mc.load_format == "simulate"
        torch.manual_seed(mc.seed)
        self._load_model_in_turn()
        self.unconfirmed: List[int] = []     # copy batches submitted, not yet done everywhere
        self.done_here: Set[int] = set()     # ... of which this rank has completed
        self.gpu_memory_profile: Optional[dict] = None   # CUDA pool sizing
        self.kv_caches: Optional[torch.Tensor] = None
        self.model_runner: Optional[ModelRunner] = None
        self.relocation: Optional[RelocationExecutor] = None   # where vToken reclaims

    def _load_model_in_turn(self) -> None:
        for turn in range(self.tp.world_size):   # ranks load (and time kernels) in turn
            if turn == self.rank:
                self.model = self._load_model()
            self.tp.barrier()

    def _load_model(self) -> torch.nn.Module:
        mc = self.config.model_config
        if self.simulated:   # no model math: the engine's KV plane runs for real
            from vllm.model_executor.models.simulated import SimulatedModel
            return SimulatedModel(mc.hf_config, mc.seed)
        return get_model(mc.model, mc.hf_config, mc.dtype, mc.max_model_len, mc.load_format,
                         mc.seed, self.device, self.tp)

    @property
    def num_kv_heads(self) -> int:
        """This rank's KV heads (all of them at world size 1)."""
        return getattr(self.model, "num_kv_heads", self.model.config.num_key_value_heads)

    # ---- sizing -------------------------------------------------------------------------------
    @property
    def kv_dtype(self) -> torch.dtype:
        """The pool's element type: the model's dtype, or fp8 (--kv-cache-dtype)."""
        return kv_quant.cache_dtype(self.config.cache_config.kv_cache_dtype,
                                    DTYPES[self.config.model_config.dtype])

    @property
    def kv_groups(self):
        """How the layers share the pool (one page per KV tensor: layers/attention.py)."""
        return kv_groups(self.model.config)

    def block_bytes(self) -> int:
        """One block: a page in each KV tensor (every layer; a hybrid model's full layers)."""
        cfg = self.model.config
        elem = torch.finfo(self.kv_dtype).bits // 8
        return (self.kv_groups.num_tensors * 2 * self.num_kv_heads * cfg.head_dim * elem
                * self.config.cache_config.block_size)

    def determine_num_kv_blocks(self) -> int:
        """The blocks this rank can hold, then the minimum over ranks."""
        blocks = torch.tensor([self._num_kv_blocks()], dtype=torch.int64, device=self.device)
        return int(self.tp.all_reduce(blocks, "min"))

    def _num_kv_blocks(self) -> int:
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
        less the peak a profiling forward of the largest steps reaches (weights, activations,
        logits: profile_forward), what is held outside torch's allocator (CUDA context, other
        processes) and the model runner's buffers, which are made after the pool
        (runner_buffer_bytes)."""
        sc, c = self.config.scheduler_config, self.config
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        scratch = profile_forward(self.model, sc.max_num_batched_tokens, sc.max_model_len,
                                  sc.max_num_seqs)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - scratch
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        outside = max(total - free - torch.cuda.memory_allocated(), 0)
        graphs = not c.model_config.enforce_eager and self.tp.world_size == 1
        buffers = runner_buffer_bytes(sc.max_num_batched_tokens, sc.max_num_seqs,
                                      sc.max_model_len, graphs=graphs)
        self.gpu_memory_profile = {"total": total, "peak": peak, "outside": outside,
                                   "buffers": buffers}
        return kv_blocks_for_memory(total, peak + outside + buffers,
                                    c.cache_config.gpu_memory_utilization, self.block_bytes())

    def initialize_cache(self, num_blocks: int) -> None:
        """The KV pool of num_blocks blocks (the same number on every rank, so block ids mean the
        same everywhere), and what reads it: the model runner, CUDA graphs, relocation."""
        c = self.config
        cfg, block_size = self.model.config, c.cache_config.block_size
        groups = self.kv_groups
        shape = (1, num_blocks * block_size, 2, 1, 1) if self.simulated else \
            (groups.num_tensors, num_blocks * block_size, 2, self.num_kv_heads, cfg.head_dim)
        self.kv_caches = huge_pages.zeros(shape, self.kv_dtype) if self.device.type == "cpu" \
            else torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        if kv_quant.is_fp8(self.kv_caches):
            kv_quant.register(self.kv_caches, c.cache_config.calculate_kv_scales)
        sc = c.scheduler_config
        self.model_runner = ModelRunner(self.model, self.kv_caches, sc.max_num_batched_tokens,
                                        sc.max_num_seqs, sc.max_model_len,
                                        groups.window if groups.hybrid else None)
        # CUDA graphs capture one rank's kernels; with tensor parallelism the all-reduces
        # between them run eagerly (capturing NCCL collectives is not done here)
        if self.device.type == "cuda" and not c.model_config.enforce_eager \
                and self.tp.world_size == 1:
            self.model_runner.graphs = CudaGraphRunner(self.model, self.kv_caches,
                                                       self.model_runner.buffers, sc.max_num_seqs)
            self.model_runner.graphs.capture_all()
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
        out = StepOutput()
        if step.num_rows:
            runner = self.model_runner
            inp = runner.prepare_inputs(step)
            hidden = runner.execute(inp, self.relocation)
            out.logits, out.prompt_logits = runner.compute_logits(hidden, step)
            out.rows = runner.step_stats(inp)
        if self.tp.world_size > 1:
            done = self._agree(step, done, out.rows)
        out.completed_copies = sorted(done)
        return out

    def _agree(self, step: StepInput, done: Set[int], rows: List[RowStats]) -> Set[int]:
        """One all-reduce (sum) over ranks of [each row's scores and key statistic, a 1 per
        unconfirmed copy batch this rank has completed]; rows are updated in place, and the
        batches every rank completed (their sum is N) returned. Scores are partial sums over
        this rank's heads; key statistics are means over its KV heads (the same count on every
        rank), so their mean over ranks is the whole mean."""
        n = self.tp.world_size
        if step.copies is not None and step.copies.batch_id is not None:
            self.unconfirmed.append(step.copies.batch_id)
        self.done_here |= done
        parts = [p for r in rows for p in (r.scores, r.key_statistic) if p is not None]
        flags = np.array([b in self.done_here for b in self.unconfirmed], np.float32)
        flat = np.concatenate([p.astype(np.float32).ravel() for p in parts] + [flags])
        summed = self.tp.all_reduce(torch.from_numpy(flat).to(self.device)).cpu().numpy()
        at = 0
        for r in rows:
            if r.scores is not None:
                r.scores, at = summed[at:at + len(r.scores)], at + len(r.scores)
            if r.key_statistic is not None:
                r.key_statistic, at = summed[at:at + len(r.key_statistic)] / n, \
                    at + len(r.key_statistic)
        everywhere = {b for b, c in zip(self.unconfirmed, summed[at:]) if c == n}
        self.unconfirmed = [b for b in self.unconfirmed if b not in everywhere]
        self.done_here -= everywhere
        return everywhere

    # ---- sleep mode ---------------------------------------------------------------------------
    def sleep(self, level: int) -> None:
        """Level 1: release the KV pool and what reads it (the model runner, CUDA graphs);
        level 2: the model's weights too. What the pool held is lost (the engine lets no request
        hold KV across it). A relocation copy still running is waited for first."""
        if self.relocation is not None:
            self.relocation.sleep()
        self.unconfirmed, self.done_here = [], set()   # their batches' requests are gone
        self.model_runner = self.kv_caches = None
        if level >= 2:
            self.model = None
        gc.collect()         # modules and graphs hold reference cycles
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self, num_blocks: int, tags: Tuple[str, ...]) -> None:
        """Restore what sleep() released, of tags: "weights" loads them again from the model
        directory as the first time (same dtype and quantization); "kv_cache" allocates a
        zeroed pool of num_blocks and its runner (the weights must be there). The relocation
        executor (and its counters) is kept."""
        if "weights" in tags and self.model is None:
            self._load_model_in_turn()
        if "kv_cache" not in tags or self.kv_caches is not None:
            return
        assert self.model is not None, "the KV cache comes back with or after the weights"
        relocation = self.relocation
        self.initialize_cache(num_blocks)
        if relocation is not None:
            relocation.wake_up(self.kv_caches)
            self.relocation = relocation

    def held_bytes(self) -> Dict[str, int]:
        """Bytes this engine holds, summed over ranks: the KV pool, and the storages the model's
        parameters and buffers live in (a weight arena counts whole)."""
        kv = self.kv_caches.numel() * self.kv_caches.element_size() \
            if self.kv_caches is not None else 0
        storages = {}
        if self.model is not None:
            for t in itertools.chain(self.model.parameters(), self.model.buffers()):
                storage = t.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        held = torch.tensor([kv, sum(storages.values())], dtype=torch.int64, device=self.device)
        if self.tp.world_size > 1:
            held = self.tp.all_reduce(held)
        return {"kv_cache": int(held[0]), "weights": int(held[1])}

    # ---- hooks for the engine and tests -------------------------------------------------------
    def check_views(self, expected: Dict[int, np.ndarray]) -> None:
        """Every attention view this rank holds equals the engine's (I1 per rank)."""
        if self.model_runner is None:      # asleep: no pool, so no view
            assert not expected, f"rank {self.rank} sleeps, yet the engine has views"
            return
        held = self.view_snapshot()
        assert held.keys() == expected.keys(), \
            f"rank {self.rank} holds views {sorted(held)}, the engine {sorted(expected)}"
        for h, slots in expected.items():
            assert np.array_equal(held[h], slots), \
                f"rank {self.rank}: view {h} differs from the engine's (its deltas went astray)"
        self.model_runner.buffers.check_views(held)

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
        from vllm.kernels import cpu_kernels
        plan = getattr(self.model, "plan", None)
        return {"device": str(self.device), "cpu": cpu_kernels.cpu_name(),
                "cpu_kernels": cpu_kernels.active_isa() if cpu_kernels.available() else "off",
                "kernel_plan": plan.as_dict() if plan is not None else None}
