"""Llama family (Llama, Mistral, Qwen2): GQA, RoPE (incl. Llama-3 scaling), RMSNorm, SiLU MLP.

With tensor parallelism (a TPGroup of N ranks) each rank holds its heads, its MLP columns and
its vocabulary rows (model_executor/tp_shards.py): O and down are row-parallel, their partial
sums all-reduced before the residual add; the embedding is vocabulary-parallel (each rank looks
up its rows, zeros elsewhere, all-reduced) and the logits are gathered on rank 0. The C decode
layer fuses a whole layer, so it runs at N = 1 only.

Weights are kept pre-transposed ([in, out], contiguous) because `x @ Wt` is up to 2x faster than
`F.linear(x, W)` for decode-shaped GEMMs on CPU. Q/K/V and gate/up are fused into one GEMM each.
In float32 on CPU a KernelPlan (vllm/kernels/cpu_kernel_plan.py), timed once at load, picks per batch
band the GEMM path (C on packed panels, MKL packed, or x @ Wt), the decode attention and whether
a decode step runs each layer as one C call; each weight is kept only in the layouts it uses.
With --quantization gguf the GEMM weights the GGUF holds in Q8_0 / Q4_0 / Q4_1 blocks stay in
them (QuantLinear, model_executor/quant_linear.py); the C decode layer multiplies them in their
blocks too (vq_gemm_parts, called through a pointer in its layer struct). bf16 weights (a
GGUF's BF16 tensors, --dtype bfloat16 on the CPU) come the same way, as BF16 QuantWeights, and run
as BF16Linear (the float32 GEMM on bf16 panels; the layer struct's bf16 flag). With
quant_keep_float32 (--quantization auto; --dtype auto on a bf16 checkpoint) the model holds both:
steps of fewer rows than `quant_below` run the blocks (`quant_layers`, `quant_head`), larger ones
the float32 layers, the crossover timed once at load on this CPU; a side that wins no band is
dropped.
"""
import ctypes
import logging
import math
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from vllm.kernels import ops
from vllm.kernels import cpu_kernel_plan, cpu_kernels, quant_kernels
from vllm.attention import kv_quant
from vllm.attention.backend import AttentionMetadata, paged_attention, write_kv
from vllm.kernels.cpu_kernel_plan import KernelPlan, band
from vllm.distributed.tp_group import TPGroup
from vllm.model_executor.quant_linear import QuantLinear, QuantWeight, block_linear, group
from vllm.weight_arena import WeightArena

logger = logging.getLogger(__name__)
# --quantization auto: the decode batch sizes timed blocks against float32 (a step of 64 rows
# already runs both compute-bound, as a prefill does; 256 would add seconds to every load)
CROSSOVER_ROWS = tuple(m for m in cpu_kernel_plan.TIMED_ROWS if m <= 64)
# the float32 layers (4-8x the blocks' bytes) are kept only from a row count where their step is
# this much faster: with ties going to float32, a noisy load-time timing on the AMD EPYC AVX2
# host kept them from 16 rows, where the default then ran 0.92x the blocks' tok/s
CROSSOVER_MARGIN = 0.05


class Linear(nn.Module):
    """y = x @ W (+ bias) (+ residual) on the path `plan` picks for x's rows: "c" (W as the C
    GEMM's panels, cpu_kernels), "mkl" (W packed by MKL for the band's largest row count) or
    "torch" (W as [in, out]). W is kept only in the layouts its paths use; no plan: "torch"."""

    def __init__(self, wt: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 plan: Optional[KernelPlan] = None, arena: Optional[WeightArena] = None):
        super().__init__()
        self.in_features, self.out_features = wt.shape
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.paths = self.paths_for(wt.shape, plan)
        self.plan = plan            # its prefetch choice is made after the model is built
        self.wt = self.packed = None
        if "c" in self.paths:
            out = arena.take(cpu_kernels.packed_shape(*wt.shape)) if arena else None
            self.packed = nn.Parameter(cpu_kernels.pack_weight(wt, out), requires_grad=False)
        if "torch" in self.paths:
            wt = arena.take(wt.shape).copy_(wt) if arena else wt.contiguous()
            self.wt = nn.Parameter(wt, requires_grad=False)
        self.mkl = {rows: cpu_kernel_plan._mkl_pack(wt, rows)      # rows -> MKL's packing
                    for rows, path in zip(cpu_kernel_plan.TIMED_ROWS, self.paths) if path == "mkl"}

    @staticmethod
    def paths_for(shape: Tuple[int, int], plan: Optional[KernelPlan]) -> List[str]:
        return plan.gemm[cpu_kernel_plan.shape_name(*shape)] if plan else ["torch"]

    @classmethod
    def arena_floats(cls, shape: Tuple[int, int], plan: Optional[KernelPlan]) -> int:
        """Floats a weight of this shape takes in a WeightArena (its c and torch layouts)."""
        paths = cls.paths_for(shape, plan)
        return (math.prod(cpu_kernels.packed_shape(*shape)) if "c" in paths else 0) + \
            (math.prod(shape) if "torch" in paths else 0)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        m = x.shape[0]
        path = self.paths[band(m)] if len(self.paths) > 1 else self.paths[0]
        if path == "c":
            return cpu_kernels.packed_gemm(x, self.packed, self.out_features, self.bias, residual,
                                           self.plan.prefetch_next(m))
        if path == "mkl":
            rows = cpu_kernel_plan.TIMED_ROWS[band(m)]
            y = cpu_kernel_plan.mkl_gemm(x, self.mkl[rows], rows, self.out_features,
                                         self.in_features)
            y = y if self.bias is None else y + self.bias
        else:
            y = x @ self.wt if self.bias is None else torch.addmm(self.bias, x, self.wt)
        return y if residual is None else residual + y


def _fused_cpu(x: torch.Tensor, width: int = 16) -> bool:
    """Whether the C kernels take x (their vector loops need rows of a multiple of 16)."""
    return x.dtype == torch.float32 and not x.is_cuda and width % 16 == 0 \
        and ops.cpu_kernels_enabled()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _fused_cpu(x, x.shape[-1]):
        return cpu_kernels.rms_norm(x, weight, eps)
    # one op on CUDA; bitwise equal to x * rsqrt(mean(x^2) + eps) * weight in float32
    return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if _fused_cpu(gate_up, gate_up.shape[-1] // 2):
        return cpu_kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rope_parameters(config) -> Tuple[float, dict]:
    """(theta, scaling) from a transformers 4.x or 5.x config."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        theta = 10000.0
    params.update(scaling)
    kind = params.get("rope_type", params.get("type", "default"))
    return float(theta), {**params, "rope_type": kind}


def inv_frequencies(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    # float32 throughout, as transformers computes it, so greedy outputs match it bit for bit
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = scaling["rope_type"]
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    raise ValueError(f"--model: rope scaling type {kind!r} is not supported")


class Rotary(nn.Module):
    """cos/sin tables indexed by logical position (positions never change under eviction);
    buffers, so they live on the model's device. Computed in float32 on the CPU, as transformers
    computes its frequencies, then moved."""

    def __init__(self, head_dim: int, max_pos: int, theta: float, scaling: dict, dtype,
                 device: torch.device = torch.device("cpu")):
        super().__init__()
        inv = inv_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(device=device, dtype=dtype), persistent=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


def local_heads(cfg, tp: TPGroup) -> Tuple[int, int]:
    """(attention heads, KV heads) on one rank (KV heads replicated when N exceeds them)."""
    n = tp.world_size
    return cfg.num_attention_heads // n, max(cfg.num_key_value_heads // n, 1)


# each fused GEMM of a decoder layer: its weights (after "model.layers.N."), in output order
LAYER_GEMMS = {"qkv": [f"self_attn.{n}_proj" for n in "qkv"], "o": ["self_attn.o_proj"],
               "gate_up": ["mlp.gate_proj", "mlp.up_proj"], "down": ["mlp.down_proj"]}


def _quant_group(quant: Optional[Dict[str, QuantWeight]], p: str,
                 gemm: str) -> Optional[List[QuantWeight]]:
    return group(quant, [f"{p}.{n}.weight" for n in LAYER_GEMMS[gemm]])


class DecoderLayer(nn.Module):
    def __init__(self, cfg, w: Dict[str, torch.Tensor], p: str, plan: Optional[KernelPlan],
                 arena: Optional[WeightArena] = None, tp: TPGroup = TPGroup(),
                 quant: Optional[Dict[str, QuantWeight]] = None,
                 dense: Optional["DecoderLayer"] = None):
        """dense: the float32 twin of a layer built with `quant`; the GEMMs not kept in blocks
        are shared with it, not copied."""
        super().__init__()
        self.plan, self.tp = plan, tp
        self.num_heads, self.num_kv_heads = local_heads(cfg, tp)
        self.head_dim = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        qkv_b = None
        if f"{p}.self_attn.q_proj.bias" in w:
            qkv_b = torch.cat([w[f"{p}.self_attn.{n}_proj.bias"] for n in "qkv"])
        o_bias = w.get(f"{p}.self_attn.o_proj.bias") if tp.rank == 0 else None  # added once

        def linear(gemm: str, bias: Optional[torch.Tensor] = None):
            qw = _quant_group(quant, p, gemm)
            if qw is not None:
                return block_linear(qw, bias, plan)
            if dense is not None:
                return getattr(dense, gemm)
            wt = torch.cat([w[f"{p}.{n}.weight"] for n in LAYER_GEMMS[gemm]]).t()
            return Linear(wt, bias, plan, arena)
        self.qkv = linear("qkv", qkv_b)
        self.o = linear("o", o_bias)
        self.gate_up = linear("gate_up")
        self.down = linear("down")
        intermediate = self.gate_up.out_features // 2
        self.ln1 = nn.Parameter(w[f"{p}.input_layernorm.weight"], requires_grad=False)
        self.ln2 = nn.Parameter(w[f"{p}.post_attention_layernorm.weight"], requires_grad=False)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.fused = self._fused_weights(intermediate) if tp.world_size == 1 else None

    def _fused_weights(self, intermediate: int) -> Optional[cpu_kernels.LayerWeights]:
        """The C decode layer's view of this layer, where every piece of it runs in C (a GEMM
        packed in float32 or bf16, all four alike, or kept in GGUF blocks)."""
        linears = (self.qkv, self.o, self.gate_up, self.down)
        if any(lin.packed is None and not isinstance(lin, QuantLinear) for lin in linears) or \
                any(n % 16 for n in (self.head_dim, self.ln1.numel(), intermediate)):
            return None
        bf16 = {lin.packed.dtype == torch.bfloat16 for lin in linears if lin.packed is not None}
        if len(bf16) > 1:
            return None
        ptr = lambda t: None if t is None else t.data_ptr()      # noqa: E731
        blocks = lambda lin: (ctypes.pointer(lin.block_weight)   # noqa: E731
                              if isinstance(lin, QuantLinear) else None)
        return cpu_kernels.LayerWeights(
            hidden=self.ln1.numel(), heads=self.num_heads, kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, intermediate=intermediate, eps=self.eps, scale=self.scale,
            ln1=ptr(self.ln1), qkv=ptr(self.qkv.packed), qkv_bias=ptr(self.qkv.bias),
            o=ptr(self.o.packed), o_bias=ptr(self.o.bias), ln2=ptr(self.ln2),
            gate_up=ptr(self.gate_up.packed), down=ptr(self.down.packed),
            qkv_q=blocks(self.qkv), o_q=blocks(self.o), gate_up_q=blocks(self.gate_up),
            down_q=blocks(self.down), bf16=int(True in bf16))

    def forward(self, x, cos, sin, rotary, kv_cache, meta: AttentionMetadata):
        t = x.shape[0]
        h = rms_norm(x, self.ln1, self.eps)
        qkv = self.qkv(h)
        if _fused_cpu(qkv):
            q = cpu_kernels.rope_write_kv(qkv, cos, sin, meta.slot_mapping, kv_cache,
                                          self.num_heads)
        else:   # rotate q and k heads together: [T, H + KVH, D]
            qk = rotary(qkv[:, :self.q_size + self.kv_size].view(t, -1, self.head_dim),
                        cos[:, None], sin[:, None])
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            if kv_quant.spreads(kv_cache):       # an fp8 cache's keys, and queries to match
                q, k = kv_quant.spread(q), kv_quant.spread(k)
            v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
            write_kv(kv_cache, meta.slot_mapping, k, v)
        decode_path = self.plan.attention_path(meta.num_decodes) if self.plan else None
        attn = paged_attention(q, kv_cache, meta, self.scale, decode_path)
        x = self._row_parallel(self.o, attn.reshape(t, self.q_size), x)
        h = rms_norm(x, self.ln2, self.eps)
        return self._row_parallel(self.down, silu_mul(self.gate_up(h)), x)

    def _row_parallel(self, linear: nn.Module, x: torch.Tensor, residual: torch.Tensor):
        """residual + x @ W, W's rows split over the ranks: partial products summed first."""
        if self.tp.world_size == 1:
            return linear(x, residual=residual)
        return residual + self.tp.all_reduce(linear(x))


class LlamaForCausalLM(nn.Module):
    """Also serves MistralForCausalLM and Qwen2ForCausalLM (Qwen2 adds q/k/v biases)."""

    def __init__(self, cfg, weights: Dict[str, torch.Tensor], dtype: torch.dtype, max_pos: int,
                 device: torch.device = torch.device("cpu"), tp: Optional[TPGroup] = None,
                 quant: Optional[Dict[str, QuantWeight]] = None,
                 quant_keep_float32: bool = False):
        """quant: HF weight name -> its GGUF blocks or bf16 weight (--quantization gguf, --dtype
        bfloat16; float32 on the CPU, one rank only); those GEMMs run as QuantLinear or
        BF16Linear, the rest as Linear. quant_keep_float32: the float32 layers are kept too, for
        the batch bands where they are faster."""
        super().__init__()
        if getattr(cfg, "head_dim", None) is None:
            cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.config, self.tp = cfg, tp or TPGroup()
        self.num_heads, self.num_kv_heads = local_heads(cfg, self.tp)   # this rank's
        w = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}
        self.embed = nn.Parameter(w["model.embed_tokens.weight"], requires_grad=False)
        head = w.get("lm_head.weight")
        if head is None or getattr(cfg, "tie_word_embeddings", False):
            head = w["model.embed_tokens.weight"]
        on_cpu = dtype == torch.float32 and not self.embed.is_cuda
        quant = quant or None
        assert quant is None or (on_cpu and self.tp.world_size == 1), \
            "GGUF block and bf16 weights run on the CPU in float32 at tensor parallel size 1"
        blocks, quant = quant, (None if quant_keep_float32 else quant)   # quant: self.layers'
        shapes = self._gemm_shapes(cfg, w, head, self.num_heads, self.num_kv_heads, quant)
        self.plan = cpu_kernel_plan.plan_model(
            shapes, self.num_heads, self.num_kv_heads, cfg.head_dim,
            cfg.num_hidden_layers) if on_cpu and ops.cpu_kernels_enabled() else None
        arena = WeightArena(sum(count * Linear.arena_floats(shape, self.plan)
                                for shape, count in shapes.items())) if on_cpu else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, w, f"model.layers.{i}", self.plan, arena,
                                                 self.tp, quant)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = nn.Parameter(w["model.norm.weight"], requires_grad=False)
        head_q = group(quant, ["lm_head.weight"])
        self.lm_head = block_linear(head_q, plan=self.plan) if head_q else \
            Linear(head.t(), plan=self.plan, arena=arena)
        assert arena is None or arena.used == arena.numel
        theta, scaling = rope_parameters(cfg)
        self.rotary = Rotary(cfg.head_dim, max_pos, theta, scaling, dtype, device)
        self.eps = cfg.rms_norm_eps
        self._decode_scratch = torch.empty(0)          # _scratch(): grown, reused every step
        if self.plan is not None:
            step = self._timed_step if self.layers[0].fused is not None else None
            cpu_kernel_plan.choose_decode_layer(self.plan, step)
        cpu_kernel_plan.choose_int4(self.plan, _quant_linears(self.layers, self.lm_head))
        self.quant_layers, self.quant_head, self.quant_below = None, None, 0
        if blocks and quant_keep_float32:
            self._add_quant_twin(cfg, w, blocks)

    def _add_quant_twin(self, cfg, w: Dict[str, torch.Tensor],
                        blocks: Dict[str, QuantWeight]) -> None:
        """Layers running the GGUF blocks (or bf16 weights) beside the float32 ones, and the row
        count below which they are used (quant_crossover); a side that wins no timed band is
        dropped."""
        self.quant_layers = nn.ModuleList(
            DecoderLayer(cfg, w, f"model.layers.{i}", self.plan, None, self.tp, blocks, dense)
            for i, dense in enumerate(self.layers))
        head_q = group(blocks, ["lm_head.weight"])
        self.quant_head = block_linear(head_q, plan=self.plan) if head_q else self.lm_head
        cpu_kernel_plan.choose_int4(self.plan, _quant_linears(self.quant_layers, self.quant_head))
        bf16 = all(w.qtype == quant_kernels.BF16 for w in blocks.values())
        kept = "bf16 weights" if bf16 else "GGUF blocks"
        start = time.perf_counter()
        self.quant_below = self.quant_crossover()
        choice = f"{kept} below {self.quant_below} rows, float32 from there"
        if self.quant_below == 0:                       # float32 wins every band
            self.quant_layers, self.quant_head = None, None
            choice = "float32 at every batch size"
        elif self.quant_below > CROSSOVER_ROWS[-1]:     # blocks win every band
            self.layers, self.lm_head = self.quant_layers, self.quant_head
            self.quant_layers, self.quant_head, self.quant_below = None, None, 0
            choice = f"{kept} at every batch size"
        logger.info("auto weight format: %s (timed in %.1f s)", choice,
                    time.perf_counter() - start)

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

    @staticmethod
    def _gemm_shapes(cfg, w: Dict[str, torch.Tensor], head: torch.Tensor, heads: int,
                     kv_heads: int, quant: Optional[Dict[str, QuantWeight]] = None
                     ) -> Dict[Tuple[int, int], int]:
        """(K, N) of every float32 GEMM weight (this rank's; not those kept quantized) -> how
        many the model has."""
        e, d, layers = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers
        inter = w["model.layers.0.mlp.gate_proj.weight"].shape[0]
        gemm_shapes = {"qkv": (e, (heads + 2 * kv_heads) * d), "o": (heads * d, e),
                       "gate_up": (e, 2 * inter), "down": (inter, e)}
        shapes: Dict[Tuple[int, int], int] = {}
        for i in range(layers):
            for gemm, shape in gemm_shapes.items():
                if _quant_group(quant, f"model.layers.{i}", gemm) is None:
                    shapes[shape] = shapes.get(shape, 0) + 1
        if group(quant, ["lm_head.weight"]) is None:
            shape = (e, head.shape[0])
            shapes[shape] = shapes.get(shape, 0) + 1
        return shapes

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

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = self._embed(input_ids)
        cos = self.rotary.cos[positions]              # [T, D]
        sin = self.rotary.sin[positions]
        layers = self.quant_layers if x.shape[0] < self.quant_below else self.layers
        if self._all_in_c(layers, meta, x.shape[0]):
            return self._decode_in_c(layers, x, cos, sin, kv_caches, meta)
        for i, layer in enumerate(layers):
            x = layer(x, cos, sin, self.rotary, kv_caches[i], meta)
        return rms_norm(x, self.norm, self.eps)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: rank r holds rows r*S .. (r+1)*S; an id elsewhere reads
        zeros, and the sum over ranks is the row. S=4, rank 1, ids [2, 5]: local [-2, 1] ->
        [0, embed[1]]."""
        if self.tp.world_size == 1:
            return self.embed[input_ids]
        local = input_ids - self.tp.rank * self.embed.shape[0]
        mine = (local >= 0) & (local < self.embed.shape[0])
        x = self.embed[local.clamp(0, self.embed.shape[0] - 1)] * mine[:, None]
        return self.tp.all_reduce(x)

    def _all_in_c(self, layers: nn.ModuleList, meta: AttentionMetadata, num_tokens: int) -> bool:
        """A decode-only step in a band where the plan runs each layer as one C call."""
        return (self.plan is not None and layers[0].fused is not None and not meta.prefills
                and meta.num_decodes == num_tokens > 0 and self.plan.use_decode_layer(num_tokens)
                and ops.cpu_kernels_enabled())

    def _decode_in_c(self, layers: nn.ModuleList, x, cos, sin, kv_caches,
                     meta: AttentionMetadata) -> torch.Tensor:
        x = x.contiguous()
        mass = meta.decode_mass
        scratch = self._scratch(x.shape[0], meta.decode_views)
        cpu_kernels.decode_layers(_c_stack(layers), x, cos, sin, meta.slot_mapping, kv_caches,
                                  meta.decode_views, meta.decode_lens, mass, scratch,
                                  self.plan.prefetch_next(x.shape[0]))
        return rms_norm(x, self.norm, self.eps)

    def _scratch(self, m: int, views: torch.Tensor) -> torch.Tensor:
        """decode_scratch's buffer, kept from step to step and grown when a step needs more."""
        size = cpu_kernels.decode_scratch_floats(self.layers[0].fused, m, views)
        if self._decode_scratch.numel() < size:
            self._decode_scratch = torch.empty(size, dtype=torch.float32)
        return self._decode_scratch

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """[rows, vocab] float32 on rank 0 (each rank computes its vocabulary rows, rank 0
        gathers them); None on the other ranks."""
        head = self.quant_head if hidden.shape[0] < self.quant_below else self.lm_head
        logits = head(hidden).float()
        if self.tp.world_size == 1:
            return logits
        return self.tp.gather_vocab(logits.contiguous(), self.config.vocab_size)


def _quant_linears(layers: nn.ModuleList, head: nn.Module) -> List[QuantLinear]:
    gemms = [lin for layer in layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return [lin for lin in gemms + [head] if isinstance(lin, QuantLinear)]


def _seconds(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _c_stack(layers: nn.ModuleList):
    """The layers' C views as one array for decode_layers, built on first use and kept on the
    list (a model may hold two lists: float32 and blocks)."""
    stack = layers.__dict__.get("c_stack")
    if stack is None:
        stack = layers.c_stack = cpu_kernels.layer_stack([layer.fused for layer in layers])
    return stack


def _timing_decode(m: int, context: int) -> AttentionMetadata:
    """For timing: a decode step of m rows, each viewing its own `context` slots (row i slots
    i * context ..) and writing its new token after all of them."""
    return AttentionMetadata(slot_mapping=torch.arange(m * context, m * (context + 1)),
                             num_decodes=m, decode_views=torch.arange(m * context).view(m, -1),
                             decode_lens=torch.full((m,), context))
