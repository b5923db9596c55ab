"""ReasoningParser: splits a reasoning model's output into its reasoning and its content, whole or
while it streams (`--reasoning-parser`, upstream vLLM's names).

A parser is one function, split(text, final) -> (reasoning, content), called on the whole text
so far; both extract methods use it, so a streamed choice reassembles to exactly what the same
text gives whole. Contract of split, for text that only grows:
  - not final: each result's reasoning and content start with the previous one's (text that
    could still turn into a tag, e.g. a trailing "</thi", is held back);
  - final: the text is complete, nothing is held back.
"""
from typing import Optional, Tuple

from vllm.entrypoints.openai.protocol import ChatCompletionRequest, DeltaMessage
from vllm.sampling_params import StructuredOutputsParams


class ReasoningParser:
    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    def split(self, text: str, final: bool) -> Tuple[str, str]:
        raise NotImplementedError

    def content_constraint(self, params: StructuredOutputsParams) -> StructuredOutputsParams:
        """A constraint on the whole output under which the reasoning is free text and `params`
        holds for the content, from the end of the reasoning on."""
        raise NotImplementedError

    def extract_reasoning_content(self, model_output: str,
                                  request: Optional[ChatCompletionRequest] = None
                                  ) -> Tuple[Optional[str], Optional[str]]:
        """A whole output -> (reasoning or None, content or None); empty parts are None."""
        reasoning, content = self.split(model_output, final=True)
        return reasoning or None, content or None

    def extract_reasoning_content_streaming(self, previous_text: str, current_text: str,
                                            delta_text: str, *, final: bool = False
                                            ) -> Optional[DeltaMessage]:
        """The delta that current_text (= previous_text + delta_text) adds: its new reasoning
        and content, or None when it has nothing to send yet. final: current_text is the
        whole output (what was held back goes out)."""
        old_reasoning, old_content = self.split(previous_text, final=False)
        reasoning, content = self.split(current_text, final)
        reasoning, content = reasoning[len(old_reasoning):], content[len(old_content):]
        if not reasoning and not content:
            return None
        return DeltaMessage(reasoning_content=reasoning or None, content=content or None)
