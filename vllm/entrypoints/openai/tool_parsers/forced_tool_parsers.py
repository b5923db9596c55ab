"""Parsers for calls the request forces, whose output a JSON schema constrains (tool_use.py):

  NamedToolParser     tool_choice {"type": "function", "function": {"name": N}}: the whole
                      output is N's arguments.
  RequiredToolParser  tool_choice "required": the output is a JSON array of
                      {"name": ..., "parameters": {...}}, at least one.
"""
from vllm.entrypoints.openai.tool_parsers.partial_json import scan_object_array
from vllm.entrypoints.openai.tool_parsers.tool_parser import CallSoFar, ParsedText, ToolParser


class NamedToolParser(ToolParser):
    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def parse(self, text: str, final: bool) -> ParsedText:
        return ParsedText(content="", calls=[CallSoFar(self.name, text, done=final)])

    def valid(self, parsed: ParsedText) -> bool:
        return True     # as upstream: the call stands even when max_tokens cut its arguments


class RequiredToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedText:
        items, closed = scan_object_array(text)
        calls = []
        for obj in items:
            args = obj.text(text, "parameters")
            if args is None:
                args = "{}" if obj.done else ""
            calls.append(CallSoFar(obj.string(text, "name"), args, obj.done))
        return ParsedText(content="", calls=calls, complete=closed)
