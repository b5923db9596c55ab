"""DeepSeekR1ReasoningParser (`--reasoning-parser deepseek_r1`): DeepSeek R1 and QwQ."""
from vllm.reasoning.think_reasoning_parser import ThinkReasoningParser


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """R1's chat templates end the prompt with <think>, so the model may write only the end:

        Let me think.</think>\\n\\nThe answer is 4.   -> reasoning "Let me think.",
                                                       content "The answer is 4."

    Everything up to the first </think> is reasoning (a <think> the model writes itself at the
    start is dropped). As upstream, an output without </think> (e.g. cut by max_tokens) is all
    reasoning and its content is None."""
    implicit_start = True
