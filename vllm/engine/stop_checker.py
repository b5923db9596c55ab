"""StopChecker: decides after each sampled token whether a sequence is done, and detokenizes."""
from typing import Optional

from vllm.sequence import Sequence, SequenceStatus


class StopChecker:
    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def detokenize(self, seq: Sequence) -> None:
        if seq.stop_reason is not None and isinstance(seq.stop_reason, str):
            return   # already truncated at the stop string
        if self.tokenizer is None:
            return
        ids = seq.output_token_ids
        if isinstance(seq.stop_reason, int) and not seq.params.include_stop_str_in_output:
            ids = ids[:-1]   # as upstream: a stop token id ends the text without its own text
        seq.output_text = self.tokenizer.decode(
            ids, skip_special_tokens=seq.params.skip_special_tokens)

    def check(self, seq: Sequence, stream: bool = False) -> Optional[SequenceStatus]:
        p = seq.params
        token = seq.token_ids[-1]
        n_out = seq.num_output_tokens
        if n_out >= p.min_tokens:
            if token in seq.eos_token_ids and not p.ignore_eos:
                # as upstream: the tokenizer's EOS leaves no stop_reason; the model's other EOS
                # ids (generation_config.json) act as stop token ids, the id the stop_reason
                return self._stop(seq, None if token == seq.eos_token_id else token)
            if token in p.stop_token_ids:
                return self._stop(seq, token)
            if p.stop:
                self.detokenize(seq)
                status = self._check_stop_strings(seq)
                if status is not None:
                    return status
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return self._finish_length(seq)
        if seq.num_tokens >= self.max_model_len:
            return self._finish_length(seq)
        return None

    def _check_stop_strings(self, seq: Sequence) -> Optional[SequenceStatus]:
        text = seq.output_text
        hits = [(text.find(s), s) for s in seq.params.stop if s in text]
        if not hits:
            return None
        pos, stop = min(hits)
        keep = pos + len(stop) if seq.params.include_stop_str_in_output else pos
        seq.output_text = text[:keep]
        return self._stop(seq, stop)

    @staticmethod
    def _stop(seq: Sequence, reason) -> SequenceStatus:
        seq.stop_reason = reason
        return SequenceStatus.FINISHED_STOPPED

    @staticmethod
    def _finish_length(seq: Sequence) -> SequenceStatus:
        return SequenceStatus.FINISHED_LENGTH
