"""CpuDecodeModel: the CPU decode machinery any decoder family shares, model-agnostic.

  - the load-time KernelPlan (vllm/kernels/cpu_kernel_plan.py): per batch band the GEMM path,
    the decode attention and whether a decode step runs each layer as one C call;
  - the weight twin (--quantization auto, a bf16 checkpoint under --dtype auto): GGUF blocks or
    bf16 weights beside the float32 layers, steps of fewer rows than `quant_below` on the
    blocks, the crossover timed once at load on this CPU; a side that wins no band is dropped
    (on a later load, with the crossover read from the cached plan, not built at all);
  - the whole-stack C decode: a decode-only step in a band the plan gives it runs every layer
    in C (cpu_kernels.decode_layers), where every layer has a C view (`fused`): one call for
    the stack, or per run of layers of one kind on a hybrid model.

The protocol a family implements (LlamaForCausalLM is the reference):

    layers, lm_head, norm, eps, embed, rotary    modules and parameters as named
    layer.fused                                  the layer's C view, or None (per-op path)
    layer.window, layer.scores                   its sliding window and whether it scores
    layer(x, cos, sin, rotary, kv_cache, meta)   one decoder layer, per op
    build_layers(quant, dense)                   the twin's layers: GEMMs from `quant` where
                                                 it has them, the rest shared with `dense`
    forward(ids, positions, kv_caches, meta), compute_logits(hidden)
"""
import logging
import time
from typing import Callable, List, Optional, Sequence

import torch
from torch import nn

from vllm.attention.backend import AttentionMetadata
from vllm.kernels import cpu_kernel_plan, cpu_kernels, ops, quant_kernels
from vllm.model_executor.quant_linear import QuantLinear, block_linear, group

logger = logging.getLogger(__name__)
# --quantization auto: the decode batch sizes timed blocks against float32 (a step of 64 rows
# already runs both compute-bound, as a prefill does; 256 would add seconds to every load)
CROSSOVER_ROWS = tuple(m for m in cpu_kernel_plan.TIMED_ROWS if m <= 64)
# the float32 layers (4-8x the blocks' bytes) are kept only from a row count where their step is
# this much faster (ties go to the blocks: a noisy timing must not keep 4x the bytes)
CROSSOVER_MARGIN = 0.05


class CpuDecodeModel(nn.Module):
    """Base of the decoder families: the weight twin, its crossover and the C decode stack
    (quant_layers / quant_head: the twin's, below quant_below rows; None: no twin)."""

    # ---- load time ------------------------------------------------------------------------
    def finish_cpu_plan(self, blocks: Optional[dict], keep_float32: bool) -> None:
        """After the layers are built: the decode-layer and int4 choices, then the twin; a
        choice timed here (not read from the cached plan) is cached with the plan, unless other
        processes ran while it was timed."""
        self._decode_scratch = torch.empty(0)          # _scratch(): grown, reused every step
        if self.plan is not None:
            step = self._timed_step if self.layers[0].fused is not None else None
            cpu_kernel_plan.choose_decode_layer(self.plan, step)
        others = cpu_kernel_plan.OthersCpu()
        timed = cpu_kernel_plan.choose_int4(self.plan, _quant_linears(self.layers, self.lm_head))
        self.quant_layers, self.quant_head, self.quant_below = None, None, 0
        if blocks and keep_float32:
            timed |= self._add_quant_twin(blocks)
        if timed and not cpu_kernel_plan.too_busy(others):
            cpu_kernel_plan.remember(self.plan)

    def cached_crossover(self) -> Optional[int]:
        """The crossover (quant_crossover) the CPU kernel plan was read from the cache with, or
        None (no plan, a plan timed by this load, or one cached without a crossover)."""
        if self.plan is None or self.plan.source != "cache":
            return None
        return self.plan.quant_below

    def cached_blocks_everywhere(self, blocks: dict) -> bool:
        """--quantization auto, before any layer is built: whether the cached crossover has the
        blocks win every band, so that the float32 layers would be built only to be dropped."""
        crossover = self.cached_crossover()
        cached = crossover is not None and crossover > CROSSOVER_ROWS[-1]
        if cached:
            logger.info("auto weight format: %s at every batch size (from the cached CPU kernel "
                        "plan)", "bf16 weights" if _all_bf16(blocks) else "GGUF blocks")
        return cached

    def _add_quant_twin(self, blocks: dict) -> bool:
        """Layers running the GGUF blocks (or bf16 weights) beside the float32 ones, and the row
        count below which they are used (quant_crossover); a side that wins no timed band is
        dropped (not built, when the cached plan says so). -> whether a choice was timed (not
        read from the cached plan)."""
        crossover = self.cached_crossover()
        if crossover == 0:
            logger.info("auto weight format: float32 at every batch size (from the cached CPU "
                        "kernel plan)")
            return False
        self.quant_layers = self.build_layers(blocks, self.layers)
        head_q = group(blocks, ["lm_head.weight"])
        self.quant_head = block_linear(head_q, plan=self.plan) if head_q else self.lm_head
        timed = cpu_kernel_plan.choose_int4(self.plan,
                                            _quant_linears(self.quant_layers, self.quant_head))
        kept = "bf16 weights" if _all_bf16(blocks) else "GGUF blocks"
        start = time.perf_counter()
        self.quant_below = self.quant_crossover() if crossover is None else crossover
        if self.plan is not None:
            self.plan.quant_below = self.quant_below
        choice = f"{kept} below {self.quant_below} rows, float32 from there"
        if self.quant_below == 0:                       # float32 wins every band
            self.quant_layers, self.quant_head = None, None
            choice = "float32 at every batch size"
        elif self.quant_below > CROSSOVER_ROWS[-1]:     # blocks win every band
            self.layers, self.lm_head = self.quant_layers, self.quant_head
            self.quant_layers, self.quant_head, self.quant_below = None, None, 0
            choice = f"{kept} at every batch size"
        logger.info("auto weight format: %s (%s)", choice, "from the cached CPU kernel plan"
                    if crossover is not None else f"timed in {time.perf_counter() - start:.1f} s")
        return timed or crossover is None

    def quant_crossover(self, repeats: int = 5) -> int:
        """The smallest row count of CROSSOVER_ROWS from which a decode step (all layers, the
        LM head) on the float32 layers takes at most 1 - CROSSOVER_MARGIN of its time on the
        blocks, in the median of `repeats` rounds taking turns (cpu_kernel_plan.paired); 0 when
        float32 wins at 1 row, past CROSSOVER_ROWS[-1] when it never does. Larger steps
        (prefills) are taken to go the way of the last band timed."""
        for m in CROSSOVER_ROWS:
            steps = {quant: self._timed_forward(m, quant) for quant in (True, False)}
            for step in steps.values():
                step()                                  # warm-up: scratch, page faults
            seconds = {quant: [] for quant in steps}
            for _ in range(repeats):
                for quant, step in steps.items():
                    seconds[quant].append(_seconds(step))
            if cpu_kernel_plan.paired(seconds[False], seconds[True]) <= 1 - CROSSOVER_MARGIN:
                return 0 if m == 1 else m
        return CROSSOVER_ROWS[-1] + 1

    def _timed_forward(self, m: int, quant: bool) -> Callable[[], object]:
        """For timing: a decode step of m rows with 2,048 keys in all (at most 256 a row), on
        the blocks or on the float32 layers (as forward picks its path), with its logits."""
        first = self.layers[0]
        context = min(256, 2048 // m)
        kv_caches = torch.zeros(len(self.layers), m * context + m, 2, first.num_kv_heads,
                                first.head_dim)
        meta = _timing_decode(m, context)
        ids = torch.randint(self.embed.shape[0], (m,))
        positions = torch.full((m,), min(context, len(self.rotary.cos) - 1))

        def step():
            saved, self.quant_below = self.quant_below, (m + 1 if quant else 0)
            try:
                return self.compute_logits(self(ids, positions, kv_caches, meta))
            finally:
                self.quant_below = saved
        return step

    def _timed_step(self, m: int, fused: bool, prefetch: bool,
                    context: int = 256) -> List[Callable[[], object]]:
        """For timing: one call per layer of a decode step of m rows with `context` keys each,
        for the first layers (enough that their weights stream from memory), fused or per op,
        the C GEMMs prefetching their next panels or not."""
        first = self.layers[0]
        layer_bytes = sum(p.numel() * 4 for p in first.parameters())
        layers = self.layers[:cpu_kernel_plan._copies(layer_bytes, len(self.layers))]
        kv = torch.zeros(m * context + m, 2, first.num_kv_heads, first.head_dim)
        meta = _timing_decode(m, context)
        x = self.embed[torch.randint(self.embed.shape[0], (m,))].contiguous()
        position = [min(context, len(self.rotary.cos) - 1)] * m
        cos, sin = self.rotary.cos[position], self.rotary.sin[position]
        if not fused:     # the per-op path's C GEMMs read their plan's prefetch: on until chosen
            assert prefetch
            return [lambda layer=layer: layer(x, cos, sin, self.rotary, kv, meta)
                    for layer in layers]
        scratch = cpu_kernels.decode_scratch(first.fused, m, meta.decode_views)
        return [lambda layer=layer: cpu_kernels.decode_layer(
            layer.fused, x.clone(), cos, sin, meta.slot_mapping, kv, meta.decode_views,
            meta.decode_lens, None, scratch, prefetch) for layer in layers]

    # ---- every step -----------------------------------------------------------------------
    def layers_for(self, num_rows: int) -> nn.ModuleList:
        """The blocks' layers below the crossover, else the float32 ones."""
        return self.quant_layers if num_rows < self.quant_below else self.layers

    def all_in_c(self, layers: nn.ModuleList, meta: AttentionMetadata, num_tokens: int) -> bool:
        """A decode-only step in a band where the plan runs each layer as one C call."""
        return (self.plan is not None and all(layer.fused is not None for layer in layers)
                and not meta.prefills and meta.num_decodes == num_tokens > 0
                and self.plan.use_decode_layer(num_tokens) and ops.cpu_kernels_enabled())

    def decode_in_c(self, layers: nn.ModuleList, x, tables, kv_caches, tensors,
                    meta: AttentionMetadata) -> torch.Tensor:
        """Every layer in C, one call per run of layers that read one window, KV group and
        rotary table from consecutive KV tensors (_c_stack: the whole stack for a model of one
        kind of layer); -> the final norm's output. tables: rotary kind -> (cos, sin) of the
        step; tensors: each layer's KV tensor."""
        x = x.contiguous()
        prefetch = self.plan.prefetch_next(x.shape[0])
        for stack, first, kv in _c_stack(layers, tensors):
            lm = meta.for_layer(first.window, first.scores, first.group)
            cpu_kernels.decode_layers(stack, x, *tables[first.rope], lm.slot_mapping,
                                      kv_caches[kv], lm.decode_views, lm.decode_lens,
                                      lm.decode_mass, self._scratch(x.shape[0], lm.decode_views),
                                      prefetch)
        return ops.rms_norm(x, self.norm, self.eps)

    def _scratch(self, m: int, views: torch.Tensor) -> torch.Tensor:
        """decode_scratch's buffer, kept from step to step and grown when a step needs more."""
        size = cpu_kernels.decode_scratch_floats(self.layers[0].fused, m, views)
        if self._decode_scratch.numel() < size:
            self._decode_scratch = torch.empty(size, dtype=torch.float32)
        return self._decode_scratch


def _all_bf16(blocks: dict) -> bool:
    return all(w.qtype == quant_kernels.BF16 for w in blocks.values())


def _quant_linears(layers: nn.ModuleList, head: nn.Module) -> List[QuantLinear]:
    gemms = [lin for layer in layers for lin in layer.gemms()]
    return [lin for lin in gemms + [head] if isinstance(lin, QuantLinear)]


def _seconds(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _c_stack(layers: nn.ModuleList, tensors: Sequence[int]):
    """The layers' C views for decode_layers, as runs: consecutive layers with one window, KV
    group and rotary table whose KV tensors are consecutive share a C array. Built on first use
    and kept on the list (a model may hold two lists: float32 and blocks). Gemma 3's 18 layers
    (tensors as KVGroups lays them out) are 10 runs: 0-2, 3-4, 5, 6, 7-9, 10, 11, 12-13, 14-16,
    17. -> [(C array, the run's first layer, its slice of the KV tensors)]"""
    runs = layers.__dict__.get("c_stack")
    if runs is None:
        kind = lambda layer: (layer.window, layer.scores, layer.group, layer.rope)  # noqa: E731
        runs, start = [], 0
        for i in range(1, len(layers) + 1):
            if i < len(layers) and kind(layers[i]) == kind(layers[start]) and \
                    tensors[i] == tensors[i - 1] + 1:
                continue
            runs.append((cpu_kernels.layer_stack([layer.fused for layer in layers[start:i]]),
                         layers[start], slice(tensors[start], tensors[i - 1] + 1)))
            start = i
        layers.c_stack = runs
    return runs


def _timing_decode(m: int, context: int) -> AttentionMetadata:
    """For timing: a decode step of m rows, each viewing its own `context` slots (row i slots
    i * context ..) and writing its new token after all of them."""
    return AttentionMetadata(slot_mapping=torch.arange(m * context, m * (context + 1)),
                             num_decodes=m, decode_views=torch.arange(m * context).view(m, -1),
                             decode_lens=torch.full((m,), context))

