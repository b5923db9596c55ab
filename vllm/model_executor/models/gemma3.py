"""Gemma 3 (text): the Llama layer with
  - four norms per layer: input and post-attention around attention, pre- and post-feedforward
    around the MLP, each output normed before its residual add;
  - RMSNorm as x * (1 + w), folded into w once at load (float32), so one kernel serves it;
  - per-head q/k RMSNorm before RoPE; attention scale query_pre_attn_scalar ** -0.5;
  - GeGLU (tanh GELU); embeddings times sqrt(hidden); a tied LM head (the unscaled embedding);
  - layer_types: 5 sliding-window layers per full one by default, each type with its own RoPE
    (rope_parameters keyed by layer type: theta 10k local, 1M global).
"""
from typing import Dict, Optional

import torch

from vllm.model_executor.layers.layernorm import gemma_weight, rms_norm
from vllm.model_executor.models.llama import DecoderLayer, LlamaForCausalLM

class Gemma3DecoderLayer(DecoderLayer):
    def __init__(self, cfg, w, p, *args, **kwargs):
        super().__init__(cfg, w, p, *args, **kwargs)
        self.ln_pre_ffn = torch.nn.Parameter(w[f"{p}.pre_feedforward_layernorm.weight"],
                                             requires_grad=False)
        self.ln_post_ffn = torch.nn.Parameter(w[f"{p}.post_feedforward_layernorm.weight"],
                                              requires_grad=False)
        self.refresh_fused()

    def c_layer_extras(self):
        if not hasattr(self, "ln_post_ffn") or self.act != "gelu_tanh":
            return None                                   # (before its norms are set)
        return dict(post_attn=self.ln2.data_ptr(), pre_ffn=self.ln_pre_ffn.data_ptr(),
                    post_ffn=self.ln_post_ffn.data_ptr(), gelu=1)

    def forward(self, x, cos, sin, rotary, kv_cache, meta):
        h = rms_norm(x, self.ln1, self.eps)
        h = self._row_parallel(self.o, self.attention(h, cos, sin, rotary, kv_cache, meta))
        x = x + rms_norm(h, self.ln2, self.eps)            # ln2: post_attention_layernorm
        h = rms_norm(x, self.ln_pre_ffn, self.eps)
        return x + rms_norm(self.feed_forward(h), self.ln_post_ffn, self.eps)

class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_class = Gemma3DecoderLayer
    layer_norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                   "post_feedforward_layernorm")
    head_norms = ("self_attn.q_norm", "self_attn.k_norm")
    norm_identity = 0.0

    def __init__(self, cfg, *args, **kwargs):
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(cfg, name, None) is not None:
                raise ValueError(f"--model: Gemma {name}={getattr(cfg, name)} is not supported")
        super().__init__(cfg, *args, **kwargs)

    def prepare_weights(self, w: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return {k: (gemma_weight(v).to(v.dtype) if k.endswith("norm.weight") else v)
                for k, v in w.items()}

    def attention_scale(self) -> Optional[float]:
        return self.config.query_pre_attn_scalar ** -0.5

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super()._embed(input_ids)
        return x * x.new_tensor(self.config.hidden_size ** 0.5)     # in the embedding's dtype
