"""Qwen3: the Llama layer with a per-head RMSNorm of q and k (width head_dim) after the QKV GEMM
and before RoPE, no QKV bias, an explicit head_dim. The q/k norm is read from the checkpoint
by DecoderLayer and runs in the C whole-layer decode too (vtok_layer's q_norm / k_norm)."""
from vllm.model_executor.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    head_norms = ("self_attn.q_norm", "self_attn.k_norm")
