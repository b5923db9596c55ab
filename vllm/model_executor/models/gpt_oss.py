"""gpt-oss: a Llama-shaped decoder with
  - q/k/v/o biases and learned attention sinks (self_attn.sinks: a per-head logit in every
    softmax's denominator, attention/backend.py);
  - layer_types alternating sliding (window 128) and full attention (two KV groups);
  - YaRN rotary scaling (layers/rotary_embedding.py);
  - a mixture-of-experts block in every layer: a biased router, the top experts_per_token
    logits then a softmax over them, experts with biases and the clamped SwiGLU
    (up + 1) * g * sigmoid(1.702 g), g = min(gate, 7), up clamped to [-7, 7].

The checkpoint fuses every layer's experts: mlp.experts.gate_up_proj [E, H, 2I] with gate and
up interleaved (columns g0 u0 g1 u1 ...), gate_up_proj_bias [E, 2I], down_proj [E, I, H],
down_proj_bias [E, H], and names the router mlp.router; they are split into the canonical
per-expert [out, in] weights at load. MXFP4 experts (*_blocks / *_scales) are dequantized
once when read (layers/mxfp4.py). Canonical names (a converted GGUF, dummy weights) pass as
they are.
"""
import re
from typing import Dict

import torch

from vllm.model_executor.layers.fused_moe import MoESpec, expert_name
from vllm.model_executor.models.qwen3_moe import MoEDecoderLayer, MoEForCausalLM

_FUSED_RE = re.compile(r"(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")


def split_experts(w: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The fused expert tensors as canonical per-expert ones; the router renamed."""
    out: Dict[str, torch.Tensor] = {}
    for name, t in w.items():
        m = _FUSED_RE.match(name)
        if m is None:
            out[name.replace(".mlp.router.", ".mlp.gate.")] = t
            continue
        p, fused, bias = m[1], m[2], m[3] is not None
        suffix = "bias" if bias else "weight"
        for e in range(t.shape[0]):
            if fused == "down_proj":
                out[expert_name(p, e, "down").replace("weight", suffix)] = \
                    t[e] if bias else t[e].t().contiguous()
                continue
            for proj, half in (("gate", t[e][..., 0::2]), ("up", t[e][..., 1::2])):
                out[expert_name(p, e, proj).replace("weight", suffix)] = \
                    half.contiguous() if bias else half.t().contiguous()
    return out


class GptOssDecoderLayer(MoEDecoderLayer):
    @staticmethod
    def moe_spec(cfg) -> MoESpec:
        return MoESpec(cfg.num_local_experts, cfg.num_experts_per_tok, "topk_softmax", True,
                       "swiglu_clamped", float(getattr(cfg, "swiglu_alpha", 1.702)),
                       float(cfg.swiglu_limit))

    @staticmethod
    def is_sparse(cfg, i: int) -> bool:
        return True


class GptOssForCausalLM(MoEForCausalLM):
    layer_class = GptOssDecoderLayer
    attention_sinks = True

    @staticmethod
    def expert_size(cfg) -> int:
        return cfg.intermediate_size

    @classmethod
    def layer_shapes(cls, cfg, i: int) -> Dict[str, tuple]:
        shapes = super().layer_shapes(cfg, i)
        biases = {name.removesuffix("weight") + "bias": shape[:1]
                  for name, shape in shapes.items() if name.startswith("mlp.")}
        return {**shapes, **biases, "self_attn.sinks": (cfg.num_attention_heads,),
                "self_attn.o_proj.bias": (cfg.hidden_size,)}

    @staticmethod
    def canonical_weights(w: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return split_experts(w)
