"""ThinkReasoningParser: reasoning between <think> and </think>, the content after it."""
from typing import Tuple

from vllm.reasoning.grammar_after_reasoning import grammar_after_reasoning
from vllm.reasoning.reasoning_parser import ReasoningParser
from vllm.sampling_params import StructuredOutputsParams


class ThinkReasoningParser(ReasoningParser):
    """The reasoning runs from a leading start tag (dropped) to the first end tag; the content
    is the text after the end tag, as is (newlines too, as upstream). implicit_start: the output
    is reasoning from its first character even without the start tag (the chat template put the
    tag in the prompt), so an output without the end tag is all reasoning. Without it, an
    output that does not begin with the start tag is all content."""
    start_token = "<think>"
    end_token = "</think>"
    implicit_start = False

    def split(self, text: str, final: bool) -> Tuple[str, str]:
        if text.startswith(self.start_token):
            return self._reasoning_then_content(text[len(self.start_token):], final)
        if not final and self.start_token.startswith(text):
            return "", ""                       # may still become the start tag
        if self.implicit_start:
            return self._reasoning_then_content(text, final)
        return "", text

    def _reasoning_then_content(self, text: str, final: bool) -> Tuple[str, str]:
        end = text.find(self.end_token)
        if end < 0:
            keep = len(text) if final else len(text) - _tag_prefix_len(text, self.end_token)
            return text[:keep], ""
        return text[:end], text[end + len(self.end_token):]      # as is, as upstream

    def content_constraint(self, params: StructuredOutputsParams) -> StructuredOutputsParams:
        start = "" if self.implicit_start else _literal(self.start_token)
        return grammar_after_reasoning(params, start=start, end=self.end_token,
                                       content_alone=not self.implicit_start)


def _tag_prefix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of text that could grow into tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _literal(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
