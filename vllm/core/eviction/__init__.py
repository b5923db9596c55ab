"""Token-level KV eviction policies (spec: shared/design/eviction-policies.md)."""
from typing import Optional, Tuple

from vllm.config import KVEvictionConfig
from vllm.core.eviction.base import EvictionPolicy, token_budget
from vllm.core.eviction.h2o import H2OPolicy
from vllm.core.eviction.keydiff import KeyDiffPolicy
from vllm.core.eviction.knorm import KNormPolicy
from vllm.core.eviction.random_policy import RandomPolicy
from vllm.core.eviction.rkv import RKVPolicy
from vllm.core.eviction.scissorhands import ScissorhandsPolicy
from vllm.core.eviction.snapkv import SnapKVPolicy
from vllm.core.eviction.streaming_llm import StreamingLLMPolicy
from vllm.core.eviction.tova import TOVAPolicy
from vllm.core.eviction.value_random import ValueRandomPolicy

POLICY_CLASSES = {
    "h2o": H2OPolicy,
    "scissorhands": ScissorhandsPolicy,
    "streamingllm": StreamingLLMPolicy,
    "sliding-window": StreamingLLMPolicy,   # config.sinks is 0 for it by default
    "random": RandomPolicy,
    "tova": TOVAPolicy,
    "snapkv": SnapKVPolicy,
    "knorm": KNormPolicy,
    "keydiff": KeyDiffPolicy,
    "rkv": RKVPolicy,
    "value-random": ValueRandomPolicy,
}


def policy_names() -> Tuple[str, ...]:
    """--kv-eviction-policy's values: "none" and the registry's names."""
    return ("none", *POLICY_CLASSES)


def check_policy_name(name: str, field: str = "--kv-eviction-policy") -> None:
    if name not in policy_names():
        raise ValueError(f"{field}: must be one of {policy_names()}, got {name!r}")


def make_policy(config: KVEvictionConfig, request_id: str, num_layer_heads: int,
                prompt_len: int = 0) -> Optional[EvictionPolicy]:
    """A fresh policy for one request (None for --kv-eviction-policy none); prompt_len: where
    scope generated starts counting."""
    if not config.enabled:
        return None
    check_policy_name(config.policy)
    return POLICY_CLASSES[config.policy](config, request_id, num_layer_heads, prompt_len)


__all__ = ["EvictionPolicy", "H2OPolicy", "KeyDiffPolicy", "KNormPolicy", "RandomPolicy",
           "RKVPolicy", "ScissorhandsPolicy", "SnapKVPolicy", "StreamingLLMPolicy", "TOVAPolicy",
           "ValueRandomPolicy", "POLICY_CLASSES", "check_policy_name", "make_policy",
           "policy_names", "token_budget"]
