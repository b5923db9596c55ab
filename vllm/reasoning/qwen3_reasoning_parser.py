"""Qwen3ReasoningParser (`--reasoning-parser qwen3`): the Qwen3 series."""
from vllm.reasoning.think_reasoning_parser import ThinkReasoningParser


class Qwen3ReasoningParser(ThinkReasoningParser):
    """Qwen3 writes both tags itself when it thinks:

        <think>Let me think.</think>\\n\\nThe answer is 4.  -> reasoning "Let me think.",
                                                              content "The answer is 4."

    An output that does not begin with <think> is all content (Qwen3 with thinking disabled).
    One that begins with <think> but has no </think> (cut by max_tokens) is all reasoning: the
    same whole as streamed (upstream's whole-output path returns such an output as content
    while its stream sends it as reasoning)."""
    implicit_start = False
