"""Qwen3-MoE: the Qwen3 layer (per-head q/k RMSNorm) with a mixture-of-experts feed-forward
block (layers/fused_moe.py) where `decoder_sparse_step` and `mlp_only_layers` put one:

    layer i is sparse  iff  i not in mlp_only_layers and num_experts > 0
                            and (i + 1) % decoder_sparse_step == 0
    else a gated MLP of intermediate_size (the dense names, mlp.gate_proj, ...)

Router: softmax over the experts in float32, the top num_experts_per_tok, divided by their sum
when norm_topk_prob. The reference MoE family: Mixtral and gpt-oss extend MoEDecoderLayer and
MoEForCausalLM with their own spec and checkpoint names (mixtral.py, gpt_oss.py). The
checkpoint's names are the canonical ones (fused_moe.py).
"""
from typing import Dict, List, Optional

import torch
from torch import nn

from vllm.model_executor.layers.fused_moe import FusedMoE, MoESpec, expert_name
from vllm.model_executor.models.llama import DecoderLayer, LlamaForCausalLM


class MoEDecoderLayer(DecoderLayer):
    """A decoder layer whose feed-forward block is a FusedMoE where the family's
    `is_sparse` says so (`moe` None: the gated MLP)."""

    @staticmethod
    def moe_spec(cfg) -> MoESpec:
        return MoESpec(cfg.num_experts, cfg.num_experts_per_tok, "softmax_topk",
                       bool(cfg.norm_topk_prob))

    @staticmethod
    def is_sparse(cfg, i: int) -> bool:
        return (i not in (getattr(cfg, "mlp_only_layers", None) or []) and cfg.num_experts > 0
                and (i + 1) % getattr(cfg, "decoder_sparse_step", 1) == 0)

    def build_mlp(self, cfg, w: Dict[str, torch.Tensor], p: str, linear, plan, arena, quant,
                  dense) -> None:
        self.moe: Optional[FusedMoE] = None
        if not self.is_sparse(cfg, int(p.rsplit(".", 1)[1])):
            super().build_mlp(cfg, w, p, linear, plan, arena, quant, dense)
            return
        self.moe = FusedMoE(self.moe_spec(cfg), w, p, plan, arena, self.tp.rank, quant,
                            dense.moe if dense is not None else None)

    def gemms(self) -> List[nn.Module]:
        if self.moe is None:
            return super().gemms()
        return [self.qkv, self.o] + self.moe.gemms()

    def feed_forward(self, h: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if self.moe is None:
            return super().feed_forward(h, residual)
        y = self.moe(h)
        if self.tp.world_size > 1:
            y = self.tp.all_reduce(y)
        return y if residual is None else residual + y


class MoEForCausalLM(LlamaForCausalLM):
    """A Llama-shaped decoder whose layers are MoEDecoderLayers."""

    layer_class = MoEDecoderLayer

    @classmethod
    def layer_shapes(cls, cfg, i: int) -> Dict[str, tuple]:
        """As LlamaForCausalLM's: a sparse layer's router and experts."""
        if not cls.layer_class.is_sparse(cfg, i):
            return super().layer_shapes(cfg, i)
        spec, h, inter = cls.layer_class.moe_spec(cfg), cfg.hidden_size, cls.expert_size(cfg)
        shapes = {"mlp.gate.weight": (spec.num_experts, h)}
        p = f"model.layers.{i}"
        for e in range(spec.num_experts):
            for proj, shape in (("gate", (inter, h)), ("up", (inter, h)), ("down", (h, inter))):
                shapes[expert_name(p, e, proj).removeprefix(p + ".")] = shape
        return shapes

    @staticmethod
    def expert_size(cfg) -> int:
        """The intermediate size of one expert."""
        return cfg.moe_intermediate_size


class Qwen3MoeForCausalLM(MoEForCausalLM):
    head_norms = ("self_attn.q_norm", "self_attn.k_norm")
