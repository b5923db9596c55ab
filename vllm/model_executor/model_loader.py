"""Build a model from a local HF directory (safetensors or .bin weights), or with random weights
from its config alone (--load-format dummy), on the engine's device: weights are read (or drawn)
straight onto it, never staged whole in host memory."""
import glob
import os
from typing import Dict, Optional

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


def load_state_dict(model_dir: str, device: torch.device = torch.device("cpu"),
                    dtype: Optional[torch.dtype] = None) -> Dict[str, torch.Tensor]:
    """Every tensor is read onto `device` (and cast to `dtype`) one at a time."""
    cast = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))   # noqa: E731
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    weights: Dict[str, torch.Tensor] = {}
    if files:
        from safetensors import safe_open
        for f in files:
            with safe_open(f, framework="pt", device=str(device)) as fh:
                weights.update((k, cast(fh.get_tensor(k))) for k in fh.keys())
        return weights
    files = sorted(glob.glob(os.path.join(model_dir, "*.bin")))
    if not files:
        raise ValueError(f"--model: no *.safetensors or *.bin weights in {model_dir}")
    for f in files:
        part = torch.load(f, map_location=device, weights_only=True)
        weights.update((k, cast(v)) for k, v in part.items())
    return weights


def dummy_state_dict(hf_config, seed: int = 0, device: torch.device = torch.device("cpu"),
                     dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
    """Seeded random weights with the checkpoint's names and shapes (N(0, initializer_range),
    norms 1, biases 0): paper-scale shapes run from a config.json alone. Drawn on `device` by a
    generator there (so a CUDA model differs from a CPU one with the same seed), in float32,
    then cast."""
    c = hf_config
    gen = torch.Generator(device).manual_seed(seed)
    std = getattr(c, "initializer_range", 0.02)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = c.num_key_value_heads * head_dim

    def rand(*shape):
        return (torch.randn(*shape, generator=gen, device=device) * std).to(dtype)

    def ones(n):
        return torch.ones(n, device=device, dtype=dtype)

    w = {"model.embed_tokens.weight": rand(c.vocab_size, c.hidden_size),
         "model.norm.weight": ones(c.hidden_size)}
    if not getattr(c, "tie_word_embeddings", False):
        w["lm_head.weight"] = rand(c.vocab_size, c.hidden_size)
    bias = getattr(c, "attention_bias", False) or "Qwen2" in str(getattr(c, "architectures", ""))
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        for name, rows in (("q", c.num_attention_heads * head_dim), ("k", kv), ("v", kv)):
            w[f"{p}.self_attn.{name}_proj.weight"] = rand(rows, c.hidden_size)
            if bias:
                w[f"{p}.self_attn.{name}_proj.bias"] = torch.zeros(rows, device=device,
                                                                   dtype=dtype)
        w[f"{p}.self_attn.o_proj.weight"] = rand(c.hidden_size, c.num_attention_heads * head_dim)
        w[f"{p}.mlp.gate_proj.weight"] = rand(c.intermediate_size, c.hidden_size)
        w[f"{p}.mlp.up_proj.weight"] = rand(c.intermediate_size, c.hidden_size)
        w[f"{p}.mlp.down_proj.weight"] = rand(c.hidden_size, c.intermediate_size)
        w[f"{p}.input_layernorm.weight"] = ones(c.hidden_size)
        w[f"{p}.post_attention_layernorm.weight"] = ones(c.hidden_size)
    return w


def get_model(model_dir: str, hf_config, dtype: str, max_model_len: int,
              load_format: str = "auto", seed: int = 0,
              device: torch.device = torch.device("cpu")) -> torch.nn.Module:
    archs = getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"]
    cls = next((_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES), None)
    if cls is None:
        raise ValueError(f"--model: architecture {archs} is not supported; "
                         f"supported: {sorted(_ARCHITECTURES)}")
    device = torch.device(device)
    if load_format == "dummy":
        weights = dummy_state_dict(hf_config, seed, device, DTYPES[dtype])
    else:
        weights = load_state_dict(model_dir, device, DTYPES[dtype])
        weights = {k.removeprefix("_orig_mod."): v for k, v in weights.items()}
    with torch.no_grad():
        model = cls(hf_config, weights, DTYPES[dtype], max_model_len, device)
    return model.eval()
