"""Mixtral: the Llama layer (no q/k norm) with a mixture-of-experts block in every layer:
num_local_experts experts of intermediate_size, the top num_experts_per_tok (2) of the float32
softmax, always renormalised. The checkpoint names its block block_sparse_moe and each
expert's gate / down / up w1 / w2 / w3; they are renamed to the canonical names at load."""
import re
from typing import Dict

import torch

from vllm.model_executor.layers.fused_moe import MoESpec
from vllm.model_executor.models.qwen3_moe import MoEDecoderLayer, MoEForCausalLM

# Mixtral's per-expert weight -> the canonical projection (layers/fused_moe.py)
_EXPERT_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_EXPERT_RE = re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.")


def canonical_name(name: str) -> str:
    """block_sparse_moe.experts.3.w1.weight -> mlp.experts.3.gate_proj.weight,
    block_sparse_moe.gate.weight -> mlp.gate.weight; other names as they are."""
    name = _EXPERT_RE.sub(lambda m: f"mlp.experts.{m[1]}.{_EXPERT_PROJ[m[2]]}.", name)
    return name.replace("block_sparse_moe.gate.", "mlp.gate.")


class MixtralDecoderLayer(MoEDecoderLayer):
    @staticmethod
    def moe_spec(cfg) -> MoESpec:
        return MoESpec(cfg.num_local_experts, cfg.num_experts_per_tok, "softmax_topk", True)

    @staticmethod
    def is_sparse(cfg, i: int) -> bool:
        return True


class MixtralForCausalLM(MoEForCausalLM):
    layer_class = MixtralDecoderLayer

    @staticmethod
    def expert_size(cfg) -> int:
        return cfg.intermediate_size

    @staticmethod
    def canonical_weights(w: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return {canonical_name(k): v for k, v in w.items()}
