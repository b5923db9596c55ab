"""OutputConstraint: the structured-output spec of a request and the body field it came from.

Sources, at most one per request (else 400): OpenAI's response_format ("json_object",
"json_schema"; "text" is none), upstream's structured_outputs {json|regex|choice|grammar|
json_object} and its older guided_json / guided_regex / guided_choice / guided_grammar, and,
for chat, a named or "required" tool_choice (tool_use.py). The field is kept so that a spec
xgrammar rejects is a 400 whose `param` names what the client sent.
"""
import re
from dataclasses import dataclass
from typing import List, Optional, Tuple

from vllm.entrypoints.openai.errors import OpenAIError
from vllm.entrypoints.openai.protocol import SamplingRequest
from vllm.sampling_params import StructuredOutputsParams

_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))


@dataclass
class OutputConstraint:
    params: StructuredOutputsParams
    field: str            # body field, e.g. "response_format", "guided_regex", "tools"

    @classmethod
    def build(cls, field: str, **spec) -> "OutputConstraint":
        try:
            return cls(StructuredOutputsParams(**spec), field)
        except ValueError as e:
            raise OpenAIError(f"{field}: {e}", param=field) from None

    @classmethod
    def from_request(cls, req: SamplingRequest) -> Optional["OutputConstraint"]:
        found = cls.sources(req)
        if len(found) > 1:
            raise OpenAIError(f"only one kind of structured output per request; got "
                              f"{' and '.join(f for f, _ in found)}", param=found[1][0])
        if not found:
            return None
        field, spec = found[0]
        spec["disable_any_whitespace"] = (spec.get("disable_any_whitespace", False)
                                          or _no_whitespace(req.guided_whitespace_pattern))
        return cls.build(field, **spec)

    @staticmethod
    def sources(req: SamplingRequest) -> List[Tuple[str, dict]]:
        """(body field, StructuredOutputsParams keywords) for every constraint the request sets."""
        found = []
        fmt = req.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise OpenAIError("response_format type 'json_schema' needs "
                                  "json_schema.schema", param="response_format")
            found.append(("response_format", {"json": fmt.json_schema.json_schema}))
        so = req.structured_outputs
        if so is not None:
            kinds = {"json": so.json_, "regex": so.regex, "choice": so.choice,
                     "grammar": so.grammar, "json_object": so.json_object or None}
            spec = {k: v for k, v in kinds.items() if v is not None}
            if len(spec) != 1:
                raise OpenAIError(f"structured_outputs takes one of json, regex, choice, "
                                  f"grammar or json_object; got {', '.join(spec) or 'none'}",
                                  param="structured_outputs")
            kind = next(iter(spec))
            spec["disable_any_whitespace"] = so.disable_any_whitespace
            found.append((f"structured_outputs.{kind}", spec))
        for name, kind in _GUIDED:
            value = getattr(req, name)
            if value is not None:
                found.append((name, {kind: value}))
        return found


def _no_whitespace(pattern: Optional[str]) -> bool:
    """guided_whitespace_pattern: xgrammar allows any whitespace or none, so a pattern that
    rejects a blank (e.g. "") means none; anything else keeps the default."""
    if pattern is None:
        return False
    try:
        return re.fullmatch(pattern, " ") is None
    except re.error as e:
        raise OpenAIError(f"guided_whitespace_pattern is not a valid regex: {e}",
                          param="guided_whitespace_pattern") from None
