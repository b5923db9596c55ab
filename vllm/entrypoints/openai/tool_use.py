"""ToolUse: how one chat request uses its tools, with upstream vLLM's rules.

  tool_choice     output                                    finish_reason with calls
  "none"          plain text (the tools still reach the template)        -
  "auto"          parsed by --tool-call-parser (needs --enable-auto-tool-choice)  "tool_calls"
  "required"      JSON array [{"name", "parameters"}], min 1, by schema  "tool_calls"
  named           the function's arguments, by its parameters schema     "stop" (as OpenAI)

A forced call's message (named or "required") has content "", not null, as upstream's.
tool_choice defaults to "auto" when tools are given, else "none". A "length" cut stays
"length", so a client can tell a truncated call from a complete one.
"""
from typing import Any, Dict, List, Optional, Tuple, Type

from vllm.entrypoints.openai.errors import OpenAIError
from vllm.entrypoints.openai.output_constraint import OutputConstraint
from vllm.entrypoints.openai.protocol import (AssistantMessage, ChatCompletionRequest,
                                              FunctionCall, NamedToolChoice, ToolCall)
from vllm.entrypoints.openai.tool_parsers import ToolCallStream, ToolParser
from vllm.entrypoints.openai.tool_parsers.forced_tool_parsers import (NamedToolParser,
                                                                      RequiredToolParser)
from vllm.entrypoints.openai.tool_parsers.tool_call_stream import tool_call_id

_NO_PARAMETERS = {"type": "object", "properties": {}}
AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and '
                    '--tool-call-parser to be set')


class ToolUse:
    def __init__(self, req: ChatCompletionRequest, auto_parser: Optional[Type[ToolParser]],
                 tokenizer=None):
        self.tools = req.tools or []
        self.choice = req.tool_choice or ("auto" if req.tools else "none")
        self.first_call_only = req.parallel_tool_calls is False
        self.auto_parser = auto_parser
        self.tokenizer = tokenizer
        self._check(req)

    def _check(self, req: ChatCompletionRequest) -> None:
        if req.tools is not None and not req.tools:
            raise OpenAIError("`tools` must not be an empty array; give at least one tool or "
                              "omit the field", param="tools")
        if self.choice == "none":
            return
        if not self.tools:
            raise OpenAIError("When using `tool_choice`, `tools` must be set.",
                              param="tool_choice")
        if self.named is not None and self._index(self.named) is None:
            raise OpenAIError("The tool specified in `tool_choice` does not match any of the "
                              "specified `tools`", param="tool_choice")
        if self.choice == "auto" and self.auto_parser is None:
            raise OpenAIError(AUTO_NEEDS_FLAGS, param="tool_choice")

    @property
    def forced(self) -> bool:
        """The output is the call itself (named or "required")."""
        return self.named is not None or self.choice == "required"

    @property
    def named(self) -> Optional[str]:
        return self.choice.function.name if isinstance(self.choice, NamedToolChoice) else None

    def _index(self, name: str) -> Optional[int]:
        return next((i for i, t in enumerate(self.tools) if t.function.name == name), None)

    def template_tools(self) -> Optional[List[Dict]]:
        """The tools as apply_chat_template(tools=...) takes them (also for "none", as
        upstream renders them by default)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] or None

    # ---- output ----------------------------------------------------------------------------
    def constraint(self) -> Optional[OutputConstraint]:
        if self.named is not None:
            i = self._index(self.named)
            return OutputConstraint.build(f"tools.{i}.function.parameters",
                                          json=self.tools[i].function.parameters
                                          or _NO_PARAMETERS)
        if self.choice == "required":
            return OutputConstraint.build("tools", json=self._required_schema())
        return None

    def _required_schema(self) -> Dict[str, Any]:
        """[{"name": <one tool's name>, "parameters": <its schema>}, ...]: name first, so that
        a streamed call can be announced before its arguments are written."""
        defs: Dict[str, Any] = {}
        variants = []
        for t in self.tools:
            params = dict(t.function.parameters or _NO_PARAMETERS)
            for name, schema in params.pop("$defs", {}).items():   # refs resolve at the root
                if defs.setdefault(name, schema) != schema:
                    raise OpenAIError(f"tools define $defs.{name} differently; tool_choice "
                                      f"'required' needs them to agree", param="tools")
            variants.append({"properties": {"name": {"type": "string",
                                                      "enum": [t.function.name]},
                                             "parameters": params},
                             "required": ["name", "parameters"]})
        schema = {"type": "array", "minItems": 1,
                  "items": {"type": "object", "anyOf": variants}}
        if self.first_call_only:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return schema

    def parser(self) -> Optional[ToolParser]:
        if self.named is not None:
            return NamedToolParser(self.named)
        if self.choice == "required":
            return RequiredToolParser()
        if self.choice == "auto":
            return self.auto_parser(self.tokenizer)
        return None

    def message(self, text: str, engine_reason: Optional[str]
                ) -> Tuple[AssistantMessage, Optional[str]]:
        """A whole choice: (message, finish_reason)."""
        parser = self.parser()
        if parser is None:
            return AssistantMessage(content=text), engine_reason
        found = parser.extract(text)
        calls = found.calls[:1] if self.first_call_only else found.calls
        tool_calls = [ToolCall(id=tool_call_id(),
                               function=FunctionCall(name=c.name, arguments=c.arguments))
                      for c in calls]
        content = found.content
        if tool_calls and self.forced:
            content = content or ""
        return (AssistantMessage(content=content, tool_calls=tool_calls or None),
                self.finish_reason(engine_reason, bool(tool_calls)))

    def stream(self) -> Optional[ToolCallStream]:
        parser = self.parser()
        return ToolCallStream(parser, self.first_call_only) if parser is not None else None

    @staticmethod
    def delta(stream: ToolCallStream, text: str, final: bool) -> Dict:
        """A streamed choice's next delta ({} when there is nothing to send yet)."""
        content, calls = stream.feed(text, final)
        delta: Dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta

    def finish_reason(self, engine_reason: Optional[str], called: bool) -> Optional[str]:
        if called and engine_reason == "stop" and self.named is None:
            return "tool_calls"
        return engine_reason
