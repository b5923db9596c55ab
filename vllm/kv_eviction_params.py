"""KVEvictionParams: one request's eviction settings, over the engine's defaults.

    LLM(...).generate(prompts, params, kv_eviction=KVEvictionParams(policy="h2o", budget_tokens=512))
    POST /v1/completions {"prompt": ..., "kv_eviction_policy": "h2o", "kv_budget_tokens": 512}

Fields left None take the engine's value (its --kv-* flags); a request body names each field
`body_field(name)`. The reclamation mode stays engine-wide: it decides where bytes live, not what
a request computes. A budget named here is not raised by the engine's default floor; a floor the
operator named (--kv-min-tokens) still applies (KVEvictionConfig.floor).
"""
import dataclasses
from dataclasses import dataclass
from typing import Optional

from vllm.config import EVICTION_POLICIES, EVICTION_SCOPES, KVEvictionConfig

# body field of each KVEvictionParams field whose name is not kv_<field>
_BODY_FIELDS = {"policy": "kv_eviction_policy", "scope": "kv_evict_scope",
                "interval": "kv_evict_interval"}


@dataclass(frozen=True)
class KVEvictionParams:
    policy: Optional[str] = None             # one of EVICTION_POLICIES ("none": no eviction)
    eviction_ratio: Optional[float] = None   # in [0, 1): budget = floor((1 - r) * length)
    budget_tokens: Optional[int] = None      # >= 1: a fixed budget instead of the ratio
    min_tokens: Optional[int] = None         # >= 0: never fewer live tokens than this
    prefill_chunk: Optional[int] = None      # >= 1: evict after every N prompt tokens
    scope: Optional[str] = None              # all | generated (the prompt is never evicted)
    interval: Optional[int] = None           # >= 1: evict at budget + N, back to the budget

    @staticmethod
    def body_field(name: str) -> str:
        """The OpenAI request body's name for field `name` (kv_<name> unless listed)."""
        return _BODY_FIELDS.get(name, f"kv_{name}")

    def __post_init__(self):
        # names as the OpenAI request bodies spell them
        if self.policy is not None and self.policy not in EVICTION_POLICIES:
            raise ValueError(f"kv_eviction_policy: must be one of {EVICTION_POLICIES}, "
                             f"got {self.policy!r}")
        if self.eviction_ratio is not None and not 0.0 <= self.eviction_ratio < 1.0:
            raise ValueError(f"kv_eviction_ratio: must be in [0, 1), got {self.eviction_ratio}")
        if self.budget_tokens is not None and self.budget_tokens < 1:
            raise ValueError(f"kv_budget_tokens: must be >= 1, got {self.budget_tokens}")
        if self.min_tokens is not None and self.min_tokens < 0:
            raise ValueError(f"kv_min_tokens: must be >= 0, got {self.min_tokens}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"kv_prefill_chunk: must be >= 1, got {self.prefill_chunk}")
        if self.scope is not None and self.scope not in EVICTION_SCOPES:
            raise ValueError(f"kv_evict_scope: must be one of {EVICTION_SCOPES}, got {self.scope!r}")
        if self.interval is not None and self.interval < 1:
            raise ValueError(f"kv_evict_interval: must be >= 1, got {self.interval}")

    def apply(self, config: KVEvictionConfig) -> KVEvictionConfig:
        """The engine's config with this request's settings; a ratio given without a budget
        replaces the engine's fixed budget."""
        # every field here is the KVEvictionConfig field of the same name
        changes = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        if self.eviction_ratio is not None and self.budget_tokens is None:
            changes["budget_tokens"] = None
        if self.policy is not None and self.policy != config.policy:
            changes.setdefault("sink_tokens", None)       # the new policy's own default
        try:
            return dataclasses.replace(config, **changes)
        except ValueError as e:   # fields are checked alone above; what is left is a pair
            # (snapkv under scope generated), named by the scope field
            raise ValueError(f"kv_evict_scope: {str(e).split(': ', 1)[1]}") from None
