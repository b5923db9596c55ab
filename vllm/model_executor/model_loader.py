"""Build a model from a local HF directory (safetensors or .bin weights)."""
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


def get_model(model_dir: str, hf_config, dtype: str, max_model_len: int) -> torch.nn.Module:
    archs = getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"]
    cls = next((_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES), None)
    if cls is None:
        raise ValueError(f"--model: architecture {archs} is not supported; "
                         f"supported: {sorted(_ARCHITECTURES)}")
    weights = load_state_dict(model_dir)
    weights = {k.removeprefix("_orig_mod."): v for k, v in weights.items()}
    with torch.no_grad():
        model = cls(hf_config, weights, DTYPES[dtype], max_model_len)
    return model.eval()
