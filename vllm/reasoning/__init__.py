"""Reasoning parsers by the name `--reasoning-parser` takes: they split a reasoning model's output
into `reasoning_content` and `content` (serving_chat.py)."""
from typing import Dict, List, Type

from vllm.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser
from vllm.reasoning.qwen3_reasoning_parser import Qwen3ReasoningParser
from vllm.reasoning.reasoning_parser import ReasoningParser

REASONING_PARSERS: Dict[str, Type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def reasoning_parser_names() -> List[str]:
    return sorted(REASONING_PARSERS)


def get_reasoning_parser(name: str) -> Type[ReasoningParser]:
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not a registered reasoning parser "
                         f"(registered: {', '.join(reasoning_parser_names())})")
    return REASONING_PARSERS[name]


__all__ = ["DeepSeekR1ReasoningParser", "Qwen3ReasoningParser", "REASONING_PARSERS",
           "ReasoningParser", "get_reasoning_parser", "reasoning_parser_names"]
