"""Tool-call parsers for tool_choice "auto", by the name `--tool-call-parser` takes."""
from typing import Callable, Dict, List, Type

from vllm.entrypoints.openai.tool_parsers.hermes_tool_parser import HermesToolParser
from vllm.entrypoints.openai.tool_parsers.tool_call_stream import ToolCallStream
from vllm.entrypoints.openai.tool_parsers.tool_parser import (CallSoFar, ExtractedToolCalls,
                                                              ParsedText, ToolParser)

_PARSERS: Dict[str, Type[ToolParser]] = {"hermes": HermesToolParser}


def register_tool_parser(name: str) -> Callable[[Type[ToolParser]], Type[ToolParser]]:
    def register(cls: Type[ToolParser]) -> Type[ToolParser]:
        _PARSERS[name] = cls
        return cls
    return register


def tool_parser_names() -> List[str]:
    return sorted(_PARSERS)


def get_tool_parser(name: str) -> Type[ToolParser]:
    if name not in _PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not a registered tool parser "
                         f"(registered: {', '.join(tool_parser_names())})")
    return _PARSERS[name]


__all__ = ["CallSoFar", "ExtractedToolCalls", "HermesToolParser", "ParsedText", "ToolCallStream",
           "ToolParser", "get_tool_parser", "register_tool_parser", "tool_parser_names"]
