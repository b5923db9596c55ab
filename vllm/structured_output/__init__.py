"""Structured outputs (JSON schema, regex, choice, EBNF grammar, any JSON object) through
xgrammar, as upstream. xgrammar is imported on first use (about 0.5 s), not with the engine."""
from vllm.structured_output.bitmask import GrammarBitmask
from vllm.structured_output.error import StructuredOutputError
from vllm.structured_output.grammar import SequenceGrammar
from vllm.structured_output.manager import StructuredOutputManager

__all__ = ["GrammarBitmask", "SequenceGrammar", "StructuredOutputError",
           "StructuredOutputManager"]
