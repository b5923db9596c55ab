"""Build a model from a local HF directory (safetensors or .bin weights), or with random weights
from its config alone (--load-format dummy)."""
import glob
import os
from typing import Dict

import torch
from transformers import AutoConfig

from vllm.model_executor.models.llama import LlamaForCausalLM

_ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_hf_config(model_dir: str):
    return AutoConfig.from_pretrained(model_dir)


def load_state_dict(model_dir: str) -> Dict[str, torch.Tensor]:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    weights: Dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file
        for f in files:
            weights.update(load_file(f))
        return weights
    files = sorted(glob.glob(os.path.join(model_dir, "*.bin")))
    if not files:
        raise ValueError(f"--model: no *.safetensors or *.bin weights in {model_dir}")
    for f in files:
        weights.update(torch.load(f, map_location="cpu", weights_only=True))
    return weights


def dummy_state_dict(hf_config, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Seeded random weights with the checkpoint's names and shapes (N(0, initializer_range),
    norms 1, biases 0): paper-scale shapes run from a config.json alone. Float32; the loader
    casts."""
    c = hf_config
    gen = torch.Generator().manual_seed(seed)
    std = getattr(c, "initializer_range", 0.02)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = c.num_key_value_heads * head_dim

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * std

    w = {"model.embed_tokens.weight": rand(c.vocab_size, c.hidden_size),
         "model.norm.weight": torch.ones(c.hidden_size)}
    if not getattr(c, "tie_word_embeddings", False):
        w["lm_head.weight"] = rand(c.vocab_size, c.hidden_size)
    bias = getattr(c, "attention_bias", False) or "Qwen2" in str(getattr(c, "architectures", ""))
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        for name, rows in (("q", c.num_attention_heads * head_dim), ("k", kv), ("v", kv)):
            w[f"{p}.self_attn.{name}_proj.weight"] = rand(rows, c.hidden_size)
            if bias:
                w[f"{p}.self_attn.{name}_proj.bias"] = torch.zeros(rows)
        w[f"{p}.self_attn.o_proj.weight"] = rand(c.hidden_size, c.num_attention_heads * head_dim)
        w[f"{p}.mlp.gate_proj.weight"] = rand(c.intermediate_size, c.hidden_size)
        w[f"{p}.mlp.up_proj.weight"] = rand(c.intermediate_size, c.hidden_size)
        w[f"{p}.mlp.down_proj.weight"] = rand(c.hidden_size, c.intermediate_size)
        w[f"{p}.input_layernorm.weight"] = torch.ones(c.hidden_size)
        w[f"{p}.post_attention_layernorm.weight"] = torch.ones(c.hidden_size)
    return w


def get_model(model_dir: str, hf_config, dtype: str, max_model_len: int,
              load_format: str = "auto", seed: int = 0) -> torch.nn.Module:
    archs = getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"]
    cls = next((_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES), None)
    if cls is None:
        raise ValueError(f"--model: architecture {archs} is not supported; "
                         f"supported: {sorted(_ARCHITECTURES)}")
    if load_format == "dummy":
        weights = dummy_state_dict(hf_config, seed)
    else:
        weights = load_state_dict(model_dir)
        weights = {k.removeprefix("_orig_mod."): v for k, v in weights.items()}
    with torch.no_grad():
        model = cls(hf_config, weights, DTYPES[dtype], max_model_len)
    return model.eval()
