"""Prompt shapes, as upstream: a str, a TextPrompt or a TokensPrompt (plain dicts)."""
from typing import List, TypedDict, Union


class TextPrompt(TypedDict):
    prompt: str


class _TokensPromptBase(TypedDict):
    prompt_token_ids: List[int]


class TokensPrompt(_TokensPromptBase, total=False):
    prompt: str          # optional text of the same tokens, echoed back in RequestOutput.prompt


PromptType = Union[str, TextPrompt, TokensPrompt]
