"""KVEvictionParams: one request's eviction settings, over the engine's defaults.

    LLM(...).generate(prompts, params, kv_eviction=KVEvictionParams(policy="h2o", budget_tokens=512))
    POST /v1/completions {"prompt": ..., "kv_eviction_policy": "h2o", "kv_budget_tokens": 512}

Its fields are the engine flags marked per_request in EngineArgs (vllm/engine/arg_utils.py), each
named as the KVEvictionConfig field it sets; a request body names each by the flag's own name
(`body_field`). Fields left None take the engine's value. The reclamation mode stays engine-wide:
it decides where bytes live, not what a request computes. A budget named here is not raised by
the engine's default floor; a floor the operator named (--kv-min-tokens) still applies
(KVEvictionConfig.floor).
"""
import dataclasses
import re
from typing import Dict, Optional

from vllm.config import KVEvictionConfig
from vllm.core.eviction import check_policy_name
from vllm.engine.arg_utils import flag_type, request_flags

# KVEvictionParams field -> the engine flag (and request-body field) that sets it
_FLAG_OF: Dict[str, str] = {f.metadata["kv"]: f.name for f in request_flags()}


def _body_message(error: ValueError) -> str:
    """KVEvictionConfig's message with each CLI flag named as its request-body field."""
    return re.sub(r"--(kv-[a-z-]+)", lambda m: m.group(1).replace("-", "_"), str(error))


class _KVEvictionParamsBase:
    @staticmethod
    def body_field(name: str) -> str:
        """The OpenAI request body's name for field `name`."""
        return _FLAG_OF[name]

    def __post_init__(self):
        # each field alone, by KVEvictionConfig's own rules; pairs are checked by `apply`
        if self.policy is not None:
            check_policy_name(self.policy, self.body_field("policy"))
        for name, value in self.given().items():
            try:
                KVEvictionConfig(**{name: value})
            except ValueError as e:
                raise ValueError(_body_message(e)) from None

    def given(self) -> Dict[str, object]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def apply(self, config: KVEvictionConfig) -> KVEvictionConfig:
        """The engine's config with this request's settings; a ratio given without a budget
        replaces the engine's fixed budget."""
        changes = self.given()
        if self.eviction_ratio is not None and self.budget_tokens is None:
            changes["budget_tokens"] = None
        if self.policy is not None and self.policy != config.policy:
            changes.setdefault("sink_tokens", None)       # the new policy's own default
        try:
            return dataclasses.replace(config, **changes)
        except ValueError as e:   # fields are checked alone above; what is left is a pair
            # (snapkv under scope generated)
            raise ValueError(_body_message(e)) from None


KVEvictionParams = dataclasses.make_dataclass(
    "KVEvictionParams",
    [(f.metadata["kv"], Optional[flag_type(f)], dataclasses.field(default=None))
     for f in request_flags()],
    bases=(_KVEvictionParamsBase,), frozen=True)
KVEvictionParams.__module__ = __name__
KVEvictionParams.__doc__ = (
    "One request's eviction settings; None takes the engine's flag. Fields (request-body name): "
    + ", ".join(f"{name} ({body})" for name, body in _FLAG_OF.items()) + ".")
