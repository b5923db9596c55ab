"""Architecture name (config.json's `architectures`) -> the module and class that run it,
imported on first use. Adding a family: one file under models/ and one line here (a
mixture-of-experts family extends qwen3_moe.py's MoEForCausalLM)."""
import importlib
from typing import Dict, List, Optional, Tuple

# architecture -> (module under vllm.model_executor.models, class)
_MODELS: Dict[str, Tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
}


# multimodal checkpoints whose text model the engine runs: architecture -> the text one
_TEXT_MODELS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
# set on a text config taken out of such a checkpoint's config: its weights carry a prefix
TEXT_OF_MULTIMODAL_ATTR = "vllm_text_of_multimodal"


def supported_architectures() -> List[str]:
    return sorted(set(_MODELS) | set(_TEXT_MODELS))


def text_config(hf_config):
    """The config the engine runs: a multimodal checkpoint's text config (marked, named by its
    text architecture), else hf_config itself."""
    arch = next((a for a in getattr(hf_config, "architectures", None) or []
                 if a in _TEXT_MODELS), None)
    if arch is None:
        return hf_config
    text = hf_config.get_text_config()
    text.architectures = [_TEXT_MODELS[arch]]
    setattr(text, TEXT_OF_MULTIMODAL_ATTR, True)
    return text


def text_weight_name(name: str) -> Optional[str]:
    """A multimodal checkpoint's tensor name as its text model's (None: not the text model's:
    the vision tower, the projector). Hub files name them language_model.model.*, transformers
    5 in memory model.language_model.*."""
    for prefix in ("language_model.model.", "model.language_model."):
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    if name in ("language_model.lm_head.weight", "lm_head.weight"):
        return "lm_head.weight"
    return None


def resolve(archs: List[str]) -> type:
    """The class of the first architecture listed that the engine runs; ValueError otherwise."""
    for arch in archs:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), name)
    raise ValueError(f"--model: architecture {archs} is not supported; "
                     f"supported: {supported_architectures()}")
