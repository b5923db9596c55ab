"""GrammarBitmask: the one token bitmask that every grammar row of a step shares."""
from typing import List, Sequence

import torch

from vllm.structured_output.grammar import SequenceGrammar


class GrammarBitmask:
    """xgrammar's packed layout (int32 words, bit t of a row = token t allowed), one row per
    logits row, allocated once and grown only when a larger batch arrives. Each grammar row's
    matcher fills its row on the CPU; one batched call masks those logits rows to -inf on the
    logits' device."""

    def __init__(self):
        self.host: torch.Tensor = torch.empty(0, 0, dtype=torch.int32)
        self.device_copy: torch.Tensor = self.host

    def apply(self, logits: torch.Tensor, rows: List[int],
              grammars: Sequence[SequenceGrammar]) -> None:
        """In place: logits[rows[j]] keeps only the tokens grammars[j] allows next."""
        import xgrammar as xgr
        batch, vocab = logits.shape
        self._reserve(batch, vocab, logits.device)
        for row, grammar in zip(rows, grammars):   # one call per row; xgrammar fills the words
            grammar.fill_bitmask(self.host, row)
        mask = self.host
        if logits.device.type != "cpu":
            # Pinned source, non-blocking: the step's token read (a host sync) follows, so the
            # copy has completed before the next step writes the host rows again.
            self.device_copy[:batch].copy_(self.host[:batch], non_blocking=True)
            mask = self.device_copy
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=vocab, indices=rows)

    def _reserve(self, batch: int, vocab: int, device: torch.device) -> None:
        import xgrammar as xgr
        rows, words = xgr.get_bitmask_shape(batch, vocab)
        if self.host.shape[0] >= rows and self.host.shape[1] == words and \
                self.device_copy.device == device:
            return
        rows = max(rows, 2 * self.host.shape[0] if self.host.shape[1] == words else 0, 8)
        pinned = device.type == "cuda"
        self.host = torch.full((rows, words), -1, dtype=xgr.bitmask_dtype, pin_memory=pinned)
        self.device_copy = self.host if device.type == "cpu" else \
            torch.empty_like(self.host, device=device)
