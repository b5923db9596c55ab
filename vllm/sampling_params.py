"""SamplingParams with upstream vLLM's field names and validation."""
import json as _json
from dataclasses import InitVar, dataclass
from typing import Dict, List, Optional, Union

from vllm.outputs import RequestOutputKind   # re-exported here, as upstream

_GREEDY_EPS = 1e-5
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """One constraint on the output, compiled by the engine (vllm/structured_output/): a JSON
    schema (dict or JSON text), a regex, a choice of strings, an EBNF grammar, or any JSON
    object. disable_any_whitespace: JSON output without free whitespace between tokens."""
    json: Optional[Union[str, Dict]] = None
    regex: Optional[str] = None
    choice: Optional[List[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False

    def __post_init__(self):
        kinds = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError("structured outputs take exactly one of json, regex, choice, grammar "
                             f"or json_object; got {', '.join(kinds) or 'none'}")
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        self._verify(kinds[0])

    def _verify(self, kind: str) -> None:
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    _json.loads(value)
                except ValueError as e:
                    raise ValueError(f"json must be a JSON schema; the string is not valid "
                                     f"JSON: {e}") from None
            elif not isinstance(value, dict):
                raise ValueError(f"json must be a JSON schema (dict or JSON string), "
                                 f"got {type(value).__name__}")
        elif kind == "choice":
            if not isinstance(value, list) or not value or \
                    not all(isinstance(c, str) for c in value):
                raise ValueError("choice must be a non-empty list of strings")
        elif kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise ValueError(f"{kind} must be a non-empty string")
        elif kind == "json_object" and value is not True:
            raise ValueError(f"json_object must be true or unset, got {value!r}")

    @property
    def kind(self) -> str:
        """The one constraint set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))


GuidedDecodingParams = StructuredOutputsParams   # upstream's older name


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1          # -1 or 0: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0      # subtracted once from every token already generated
    frequency_penalty: float = 0.0     # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0    # divides positive / multiplies negative logits of every
                                       # token seen in the prompt or the output (HF / CTRL)
    logit_bias: Optional[Dict[int, float]] = None   # added to those tokens' logits
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: Optional[StructuredOutputsParams] = None
    allowed_token_ids: Optional[List[int]] = None   # sample only among these tokens
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE   # AsyncLLMEngine.generate
    guided_decoding: InitVar[Optional[StructuredOutputsParams]] = None   # older name of the above

    def __post_init__(self, guided_decoding: Optional[StructuredOutputsParams] = None):
        if guided_decoding is not None:
            if self.structured_outputs not in (None, guided_decoding):
                raise ValueError("guided_decoding is the older name of structured_outputs; "
                                 "set only one of them")
            self.structured_outputs = guided_decoding
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self._verify()

    def _verify(self) -> None:
        def bad(name, msg):
            raise ValueError(f"{name} {msg}")
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be at least 1, got {self.n}.")
        if self.temperature < 0.0:
            bad("temperature", f"must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            bad("top_k", f"must be -1 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}.")
        if not 0.0 < self.repetition_penalty <= 2.0:
            bad("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}.")
        if any(not isinstance(t, int) or t < 0 for t in (self.logit_bias or {})):
            bad("logit_bias", "keys must be non-negative token ids.")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}.")
        if self.logprobs is not None and self.logprobs < 0:
            bad("logprobs", f"must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad("prompt_logprobs", f"must be non-negative, got {self.prompt_logprobs}.")
        if any(not s for s in self.stop):
            bad("stop", "cannot contain an empty string.")
        if self.structured_outputs is not None and \
                not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "must be a StructuredOutputsParams, got "
                f"{type(self.structured_outputs).__name__}.")
        ids = self.allowed_token_ids
        if ids is not None and not ids:
            bad("allowed_token_ids", "must not be empty (it would allow no token).")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids or ()):
            bad("allowed_token_ids", "must be non-negative token ids.")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or a logit bias: the sampler needs this row's token history."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0)


# Read access under the older name too. Set after the class is built: a property in the class
# body would become the InitVar's default.
SamplingParams.guided_decoding = property(lambda self: self.structured_outputs)
