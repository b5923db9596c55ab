"""SequenceGrammar: one sequence's position in its grammar."""


class SequenceGrammar:
    """An xgrammar matcher fed the sequence's OUTPUT tokens, never its KV: preemption by
    recompute, KV eviction and relocation leave it valid as it is. One per sample (n > 1)."""

    def __init__(self, compiled_grammar):
        import xgrammar as xgr
        self.matcher = xgr.GrammarMatcher(compiled_grammar)

    def fill_bitmask(self, bitmask, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] (a CPU tensor)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False when the grammar does not allow it."""
        return self.matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token (EOS) was accepted."""
        return self.matcher.is_terminated()
