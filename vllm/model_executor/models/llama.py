"""Llama family (Llama, Mistral, Qwen2): GQA, RoPE (incl. Llama-3 scaling), RMSNorm, SiLU MLP;
the reference decoder that other families extend (qwen3.py, gemma3.py).

With tensor parallelism (a TPGroup of N ranks) each rank holds its heads, its MLP columns and
its vocabulary rows (model_executor/tp_shards.py): O and down are row-parallel, their partial
sums all-reduced before the residual add; the embedding is vocabulary-parallel (each rank looks
up its rows, zeros elsewhere, all-reduced) and the logits are gathered on rank 0. The C decode
layer fuses a whole layer, so it runs at N = 1 only.

Q/K/V and gate/up are fused into one GEMM each (layers/linear.py). With --quantization gguf the
GEMM weights the GGUF holds in blocks stay in them (QuantLinear); bf16 weights run as
BF16Linear. The load-time kernel plan, the weight twin and the whole-stack C decode are the
family-agnostic CpuDecodeModel's (model_executor/cpu_decode.py).

Each layer reads its AttentionSpec (layers/attention.py): a sliding layer attends to the keys
with position - W < id <= position, through AttentionMetadata.for_layer.
"""
import ctypes
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from vllm.attention.backend import AttentionMetadata, paged_attention
from vllm.distributed.tp_group import TPGroup
from vllm.kernels import cpu_kernel_plan, cpu_kernels, ops
from vllm.kernels.cpu_kernel_plan import KernelPlan
from vllm.model_executor.cpu_decode import CpuDecodeModel
from vllm.model_executor.layers.activation import act_mul, gated_activation
from vllm.model_executor.layers.attention import (FULL, AttentionSpec, attention_specs,
                                                  kv_groups, scores_from)
from vllm.model_executor.layers.fused_moe import expert_name
from vllm.model_executor.layers.layernorm import rms_norm
from vllm.model_executor.layers.linear import Linear
from vllm.model_executor.layers.rotary_embedding import Rotary, rope_parameters
from vllm.model_executor.quant_linear import QuantLinear, QuantWeight, block_linear, group
from vllm.weight_arena import WeightArena


def local_heads(cfg, tp: TPGroup) -> Tuple[int, int]:
    """(attention heads, KV heads) on one rank (KV heads replicated when N exceeds them)."""
    n = tp.world_size
    return cfg.num_attention_heads // n, max(cfg.num_key_value_heads // n, 1)


# each fused GEMM of a decoder layer: its weights (after "model.layers.N."), in output order
LAYER_GEMMS = {"qkv": [f"self_attn.{n}_proj" for n in "qkv"], "o": ["self_attn.o_proj"],
               "gate_up": ["mlp.gate_proj", "mlp.up_proj"], "down": ["mlp.down_proj"]}


def layer_gemm_names(w: Dict[str, torch.Tensor], p: str) -> List[List[str]]:
    """The weight names of each fused GEMM of layer prefix p: attention's, then the gated
    MLP's or every expert's (layers/fused_moe.py)."""
    gemms = ["qkv", "o"] + (["gate_up", "down"] if f"{p}.mlp.gate_proj.weight" in w else [])
    names = [[f"{p}.{n}.weight" for n in LAYER_GEMMS[g]] for g in gemms]
    e = 0
    while expert_name(p, e, "gate") in w:
        names += [[expert_name(p, e, "gate"), expert_name(p, e, "up")],
                  [expert_name(p, e, "down")]]
        e += 1
    return names


def _quant_group(quant: Optional[Dict[str, QuantWeight]], p: str,
                 gemm: str) -> Optional[List[QuantWeight]]:
    return group(quant, [f"{p}.{n}.weight" for n in LAYER_GEMMS[gemm]])


class DecoderLayer(nn.Module):
    def __init__(self, cfg, w: Dict[str, torch.Tensor], p: str, plan: Optional[KernelPlan],
                 arena: Optional[WeightArena] = None, tp: TPGroup = TPGroup(),
                 quant: Optional[Dict[str, QuantWeight]] = None,
                 dense: Optional["DecoderLayer"] = None,
                 spec: AttentionSpec = AttentionSpec(FULL, None), scores: bool = True,
                 scale: Optional[float] = None, group: int = 0):
        """dense: the float32 twin of a layer built with `quant`; the GEMMs not kept in blocks
        are shared with it, not copied. spec: its attention (window, rotary table); scores:
        whether its attention feeds the eviction statistics; scale: of q.k (head_dim^-0.5);
        group: its KV group (layers/attention.py KVGroups; 0: full attention)."""
        super().__init__()
        self.plan, self.tp = plan, tp
        self.num_heads, self.num_kv_heads = local_heads(cfg, tp)
        self.head_dim = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.window, self.rope, self.scores = spec.sliding_window, spec.layer_type, scores
        self.group = group
        self.act = gated_activation(getattr(cfg, "hidden_activation", None) or
                                    getattr(cfg, "hidden_act", "silu"))
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
        self.build_mlp(cfg, w, p, linear, plan, arena, quant, dense)
        param = lambda name: nn.Parameter(w[f"{p}.{name}.weight"], requires_grad=False)  # noqa
        self.ln1, self.ln2 = param("input_layernorm"), param("post_attention_layernorm")
        # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
        self.q_norm = param("self_attn.q_norm") if f"{p}.self_attn.q_norm.weight" in w else None
        self.k_norm = param("self_attn.k_norm") if self.q_norm is not None else None
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5 if scale is None else scale
        # learned attention sinks (gpt-oss): a per-head logit in every softmax's denominator
        sinks = w.get(f"{p}.self_attn.sinks")
        self.sinks = None if sinks is None else nn.Parameter(sinks.float(), requires_grad=False)
        self.refresh_fused()

    def build_mlp(self, cfg, w: Dict[str, torch.Tensor], p: str, linear, plan, arena, quant,
                  dense) -> None:
        """The feed-forward block's modules: the gated MLP's two fused GEMMs (a family with
        another block, models/qwen3_moe.py, builds its own)."""
        self.gate_up = linear("gate_up")
        self.down = linear("down")

    def gemms(self) -> List[nn.Module]:
        """Every GEMM module of the layer."""
        return [self.qkv, self.o, self.gate_up, self.down]

    def refresh_fused(self) -> None:
        """(Re)build the C decode layer's view (a subclass, once its own weights are set)."""
        if self.tp.world_size > 1 or self.sinks is not None or not hasattr(self, "gate_up"):
            self.fused = None
            return
        self.fused = self._fused_weights(self.gate_up.out_features // 2)

    def c_layer_extras(self) -> Optional[dict]:
        """The C layer's fields beyond the Llama layer's (vtok_layer), or None where it cannot
        run this layer. The Llama layer: SiLU, two norms (a per-head q/k norm runs in C too)."""
        plain = type(self).forward is DecoderLayer.forward and \
            type(self).feed_forward is DecoderLayer.feed_forward
        return {} if plain and self.act == "silu" else None

    def _fused_weights(self, intermediate: int) -> Optional[cpu_kernels.LayerWeights]:
        """The C decode layer's view of this layer, where every piece of it runs in C (a GEMM
        packed in float32 or bf16, all four alike, or kept in GGUF blocks)."""
        linears = (self.qkv, self.o, self.gate_up, self.down)
        extras = self.c_layer_extras()
        if extras is None:
            return None
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
            down_q=blocks(self.down), bf16=int(True in bf16), q_norm=ptr(self.q_norm),
            k_norm=ptr(self.k_norm), **extras)

    def forward(self, x, cos, sin, rotary, kv_cache, meta: AttentionMetadata):
        h = rms_norm(x, self.ln1, self.eps)
        x = self._row_parallel(self.o, self.attention(h, cos, sin, rotary, kv_cache, meta), x)
        return self.feed_forward(rms_norm(x, self.ln2, self.eps), x)

    def feed_forward(self, h: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """(residual +) the feed-forward block of h, summed over the ranks."""
        return self._row_parallel(self.down, act_mul(self.gate_up(h), self.act), residual)

    def attention(self, h, cos, sin, rotary, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """QKV, q/k norm, RoPE and the cache write, attention over the layer's window: [T, H*D]."""
        qkv = self.qkv(h)
        if self.q_norm is not None:
            qkv = self._qk_norm(qkv)
        meta = meta.for_layer(self.window, self.scores, self.group)   # its slots and views
        q = ops.rope_write_kv(qkv, cos, sin, rotary, meta.slot_mapping, kv_cache,
                              self.num_heads, self.head_dim)
        decode_path = self.plan.attention_path(meta.num_decodes) if self.plan else None
        attn = paged_attention(q, kv_cache, meta, self.scale, decode_path, sinks=self.sinks)
        return attn.reshape(h.shape[0], self.q_size)

    def _qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        """Each q and k head through its RMSNorm (weights of width head_dim)."""
        t, d, qs, ks = qkv.shape[0], self.head_dim, self.q_size, self.kv_size
        q = rms_norm(qkv[:, :qs].reshape(-1, d), self.q_norm, self.eps).view(t, qs)
        k = rms_norm(qkv[:, qs:qs + ks].reshape(-1, d), self.k_norm, self.eps).view(t, ks)
        return torch.cat((q, k, qkv[:, qs + ks:]), dim=1)

    def _row_parallel(self, linear: nn.Module, x: torch.Tensor,
                      residual: Optional[torch.Tensor] = None):
        """(residual +) x @ W, W's rows split over the ranks: partial products summed first."""
        if self.tp.world_size == 1:
            return linear(x, residual=residual)
        y = self.tp.all_reduce(linear(x))
        return y if residual is None else residual + y


class LlamaForCausalLM(CpuDecodeModel):
    """Also serves MistralForCausalLM and Qwen2ForCausalLM (Qwen2 adds q/k/v biases)."""

    layer_class = DecoderLayer
    # dummy weights (model_loader.dummy_state_dict): each layer norm's name and the value that
    # makes it the identity (1; 0 where the model multiplies by 1 + w)
    layer_norms = ("input_layernorm", "post_attention_layernorm")
    head_norms: Tuple[str, ...] = ()            # per-head norms, width head_dim
    norm_identity = 1.0
    attention_sinks = False     # learned sinks in every softmax (--load-format simulate reads it)

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
        self.specs, self.kv_groups = attention_specs(cfg), kv_groups(cfg)
        self.num_heads, self.num_kv_heads = local_heads(cfg, self.tp)   # this rank's
        w = self.prepare_weights({k: v.to(device=device, dtype=dtype) for k, v in weights.items()})
        self.embed = nn.Parameter(w["model.embed_tokens.weight"], requires_grad=False)
        head = w.get("lm_head.weight")
        if head is None or getattr(cfg, "tie_word_embeddings", False):
            head = w["model.embed_tokens.weight"]
        on_cpu = dtype == torch.float32 and not self.embed.is_cuda
        quant = quant or None
        assert quant is None or (on_cpu and self.tp.world_size == 1), \
            "GGUF block and bf16 weights run on the CPU in float32 at tensor parallel size 1"
        blocks, quant = quant, (None if quant_keep_float32 else quant)   # quant: self.layers'
        shapes = self._gemm_shapes(w, head, cfg.num_hidden_layers, quant)
        weight_types = tuple(sorted({b.type_name for b in (blocks or {}).values()})) + \
            (("float32 kept",) if blocks and quant_keep_float32 else ())
        self.plan = cpu_kernel_plan.plan_model(
            shapes, self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.num_hidden_layers,
            weight_types, sum(b.blocks.numel() for b in (blocks or {}).values())
        ) if on_cpu and ops.cpu_kernels_enabled() else None
        if blocks and quant_keep_float32 and self.cached_blocks_everywhere(blocks):
            quant_keep_float32, quant = False, blocks
            shapes = self._gemm_shapes(w, head, cfg.num_hidden_layers, quant)
        arena = WeightArena(sum(count * Linear.arena_floats(shape, self.plan)
                                for shape, count in shapes.items())) if on_cpu else None
        self._weights = w
        self.layers = self.build_layers(quant, None, arena)
        self.norm = nn.Parameter(w["model.norm.weight"], requires_grad=False)
        head_q = group(quant, ["lm_head.weight"])
        self.lm_head = block_linear(head_q, plan=self.plan) if head_q else \
            Linear(head.t(), plan=self.plan, arena=arena)
        assert arena is None or arena.used == arena.numel
        self.rotaries = nn.ModuleDict({
            kind: Rotary(cfg.head_dim, max_pos, *rope_parameters(cfg, kind), dtype, device)
            for kind in sorted({s.layer_type for s in self.specs})})
        self.rotary = self.rotaries[FULL if FULL in self.rotaries else self.specs[0].layer_type]
        self.eps = cfg.rms_norm_eps
        self.finish_cpu_plan(blocks, quant_keep_float32)
        del self._weights

    @classmethod
    def layer_shapes(cls, cfg, i: int) -> Dict[str, Tuple[int, ...]]:
        """Dummy weights (model_loader.dummy_state_dict): layer i's tensors beyond attention's
        q/k/v/o and the norms (the feed-forward block's, a family's extras), by name after
        "model.layers.i.", and their shapes (a name ending in "bias" is drawn 0)."""
        inter, h = cfg.intermediate_size, cfg.hidden_size
        return {"mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
                "mlp.down_proj.weight": (h, inter)}

    @staticmethod
    def canonical_weights(w: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The checkpoint's tensors under the names the layers read (model_loader applies it
        as loaded, before any GEMM weight is kept in blocks or bf16); a family whose checkpoint
        names differ renames or splits here (mixtral.py, gpt_oss.py)."""
        return w

    def prepare_weights(self, w: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The checkpoint's tensors as the layers read them (a family folds or renames here)."""
        return w

    def attention_scale(self) -> Optional[float]:
        return None                                 # head_dim ** -0.5

    def build_layers(self, quant: Optional[Dict[str, QuantWeight]],
                     dense: Optional[nn.ModuleList] = None,
                     arena: Optional[WeightArena] = None) -> nn.ModuleList:
        scoring, groups = scores_from(self.specs), self.kv_groups.layer_group
        return nn.ModuleList(
            self.layer_class(self.config, self._weights, f"model.layers.{i}", self.plan, arena,
                             self.tp, quant, dense[i] if dense is not None else None, spec,
                             scoring[i], self.attention_scale(), groups[i])
            for i, spec in enumerate(self.specs))

    @staticmethod
    def _gemm_shapes(w: Dict[str, torch.Tensor], head: torch.Tensor, layers: int,
                     quant: Optional[Dict[str, QuantWeight]] = None
                     ) -> Dict[Tuple[int, int], int]:
        """(K, N) of every float32 GEMM weight (this rank's; not those kept quantized) -> how
        many the model has: each fused GEMM a layer has (an MoE layer's per expert)."""
        shapes: Dict[Tuple[int, int], int] = {}
        for i in range(layers):
            for names in layer_gemm_names(w, f"model.layers.{i}"):
                if group(quant, names) is None:
                    shape = (w[names[0]].shape[1], sum(w[n].shape[0] for n in names))
                    shapes[shape] = shapes.get(shape, 0) + 1
        if group(quant, ["lm_head.weight"]) is None:
            shape = (head.shape[1], head.shape[0])
            shapes[shape] = shapes.get(shape, 0) + 1
        return shapes

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = self._embed(input_ids)
        tables = {kind: (r.cos[positions], r.sin[positions])     # [T, D] each
                  for kind, r in self.rotaries.items()}
        layers = self.layers_for(x.shape[0])
        tensors = self.kv_groups.layer_tensor        # a hybrid model's layers share tensors
        if self.all_in_c(layers, meta, x.shape[0]):
            return self.decode_in_c(layers, x, tables, kv_caches, tensors, meta)
        for i, layer in enumerate(layers):
            cos, sin = tables[layer.rope]
            x = layer(x, cos, sin, self.rotaries[layer.rope], kv_caches[tensors[i]], meta)
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

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """[rows, vocab] float32 on rank 0 (each rank computes its vocabulary rows, rank 0
        gathers them); None on the other ranks."""
        head = self.quant_head if hidden.shape[0] < self.quant_below else self.lm_head
        logits = head(hidden).float()
        if self.tp.world_size == 1:
            return logits
        return self.tp.gather_vocab(logits.contiguous(), self.config.vocab_size)
