"""Architecture name (config.json's `architectures`) -> the module and class that run it,
imported on first use. Adding a dense family: one file under models/ and one line here."""
import importlib
from typing import Dict, List, Tuple

# architecture -> (module under vllm.model_executor.models, class)
_MODELS: Dict[str, Tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
}


def supported_architectures() -> List[str]:
    return sorted(_MODELS)


def resolve(archs: List[str]) -> type:
    """The class of the first architecture listed that the engine runs; ValueError otherwise."""
    for arch in archs:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), name)
    raise ValueError(f"--model: architecture {archs} is not supported; "
                     f"supported: {supported_architectures()}")
