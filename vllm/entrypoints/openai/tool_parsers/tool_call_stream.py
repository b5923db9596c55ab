"""ToolCallStream: one streamed choice's text -> OpenAI content and tool_calls deltas.

The first delta of a call carries index, id, type and function.name (with the arguments
written so far); later ones carry function.arguments fragments only:
    {"index": 0, "id": "chatcmpl-tool-..", "type": "function",
     "function": {"name": "get_weather", "arguments": "{\"ci"}}
    {"index": 0, "function": {"arguments": "ty\": \"Paris\"}"}}
"""
from typing import Dict, List, Tuple

from vllm.entrypoints.openai.protocol import random_id
from vllm.entrypoints.openai.tool_parsers.tool_parser import ParsedText, ToolParser


def tool_call_id() -> str:
    return random_id("chatcmpl-tool")     # upstream's form


class ToolCallStream:
    def __init__(self, parser: ToolParser, first_call_only: bool = False):
        self.parser = parser
        self.first_call_only = first_call_only     # parallel_tool_calls=false
        self.text = ""
        self.content_sent = 0
        self.args_sent: List[int] = []             # per call whose header went out
        self.plain = False     # the text is not tool calls after all: the rest streams as content
        self.broken = False    # malformed after calls went out: nothing more can be sent

    @property
    def called(self) -> bool:
        return bool(self.args_sent)

    def feed(self, delta: str, final: bool = False) -> Tuple[str, List[Dict]]:
        """New text of the choice (final: its last) -> (content delta, tool_calls deltas)."""
        self.text += delta
        if self.plain or self.broken:
            return self._plain_rest(), []
        try:
            parsed = self.parser.parse(self.text, final)
        except ValueError:
            parsed = None
        if parsed is None or (final and not self.parser.valid(parsed)):
            if not self.called:      # as extract() does: no calls, the whole text is content
                self.plain = True
                return self._plain_rest(), []
            self.broken = True       # calls went out: the truncated last one still streams
            return self._diff(parsed) if parsed is not None else ("", [])
        return self._diff(parsed)

    def _plain_rest(self) -> str:
        """Before any call went out, the content sent so far is a prefix of the text."""
        if self.broken:
            return ""
        rest = self.text[self.content_sent:]
        self.content_sent = len(self.text)
        return rest

    def _diff(self, parsed: ParsedText) -> Tuple[str, List[Dict]]:
        content = parsed.content[self.content_sent:]
        self.content_sent = max(self.content_sent, len(parsed.content))
        deltas = []
        for k, call in enumerate(parsed.calls):
            if call.name is None or (self.first_call_only and k > 0):
                break
            if k == len(self.args_sent):
                self.args_sent.append(len(call.arguments))
                deltas.append({"index": k, "id": tool_call_id(), "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
            elif len(call.arguments) > self.args_sent[k]:
                deltas.append({"index": k,
                               "function": {"arguments": call.arguments[self.args_sent[k]:]}})
                self.args_sent[k] = len(call.arguments)
        return content, deltas
