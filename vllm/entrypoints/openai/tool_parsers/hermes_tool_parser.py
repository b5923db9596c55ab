"""HermesToolParser (`--tool-call-parser hermes`): calls written as Hermes 2 Pro / Qwen 2.5 /
examples/tool_chat_template_hermes.jinja teach them,

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one JSON object per <tool_call> block (the last block may lack its closing tag; a closing tag
inside the object, in an argument string, does not end it). The text
outside the blocks is the message content. With calls, its trailing whitespace is dropped
(while streaming, trailing whitespace waits for more text, which is how the two agree);
without calls the content is the text as written.
"""
from typing import List

from vllm.entrypoints.openai.tool_parsers.partial_json import PartialObject, scan_object
from vllm.entrypoints.openai.tool_parsers.tool_parser import CallSoFar, ParsedText, ToolParser

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedText:
        outside: List[str] = []
        calls: List[CallSoFar] = []
        pos = 0
        while True:
            start = text.find(START, pos)
            if start < 0:
                tail = text[pos:]
                outside.append(tail if final else tail[:len(tail) - _partial_tag(tail)])
                break
            outside.append(text[pos:start])
            obj = scan_object(text, start + len(START))
            calls.append(_call(obj, text))
            # the closing tag counts only after the object: the arguments may contain one
            end = text.find(END, obj.end) if obj.done else -1
            if end < 0:
                break
            pos = end + len(END)
        content = "".join(outside)
        if calls or not final:
            content = content.rstrip()
        return ParsedText(content=content, calls=calls)


def _call(obj: PartialObject, text: str) -> CallSoFar:
    args = obj.text(text, "arguments")
    if args is None:
        args = "{}" if obj.done else ""
    return CallSoFar(name=obj.string(text, "name"), arguments=args, done=obj.done)


def _partial_tag(text: str) -> int:
    """Length of the longest suffix of text that could grow into START."""
    for k in range(min(len(START) - 1, len(text)), 0, -1):
        if text.endswith(START[:k]):
            return k
    return 0
