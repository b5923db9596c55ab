"""ToolParser: finds the tool calls in a model's output text, whole or while it streams.

A parser is one function, parse(text, final) -> ParsedText, called on the whole text so far;
extract() and ToolCallStream both use it, so a streamed choice reassembles to exactly what the
same text gives whole. Contract of parse, for text that only grows:
  - content never shrinks: each result's content starts with the previous one's;
  - a call's name appears only once complete; its arguments are the raw JSON text so far,
    each result's a continuation of the previous one's;
  - malformed text raises ValueError.
"""
import json
from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class CallSoFar:
    name: Optional[str]      # None until the whole name has been written
    arguments: str           # the arguments' JSON text so far ("{}" for a call without any)
    done: bool = False


@dataclass
class ParsedText:
    content: str                                # for message.content
    calls: List[CallSoFar] = field(default_factory=list)
    complete: bool = True                       # the container of the calls is closed


@dataclass
class ExtractedToolCalls:
    content: Optional[str]
    calls: List[CallSoFar]                      # complete and valid, in order


class ToolParser:
    """Base of the auto tool-choice parsers (registered by name, see __init__) and of the
    parsers for forced calls (named tool_choice and "required")."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    def parse(self, text: str, final: bool) -> ParsedText:
        raise NotImplementedError

    def valid(self, parsed: ParsedText) -> bool:
        """Whether a final parse is a well-formed set of calls (else: no calls, text is content)."""
        return parsed.complete and all(c.done and c.name and _is_json(c.arguments)
                                       for c in parsed.calls)

    def extract(self, text: str) -> ExtractedToolCalls:
        try:
            parsed = self.parse(text, final=True)
        except ValueError:
            parsed = None
        if parsed is None or not parsed.calls or not self.valid(parsed):
            return ExtractedToolCalls(content=text, calls=[])
        return ExtractedToolCalls(content=parsed.content or None, calls=parsed.calls)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
