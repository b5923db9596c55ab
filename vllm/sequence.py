"""A sequence: one sample of one request, the unit the scheduler and block manager see.

It holds request and sampling state only; its KV state (blocks, prefix hashes, eviction policy,
per-request KV figures) is a RequestKV (vllm/core/request_kv.py) that the KVManager owns."""
import enum
import time
from typing import Any, Collection, Dict, List, Optional

import torch

from vllm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # Its live KV no longer fits the pool even with every other request preempted (possible
    # under eviction, where a request can outgrow the pool); the server answers it as an error.
    FINISHED_KV_EXHAUSTED = "kv_cache_exhausted"

    @property
    def finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)


class Sequence:
    def __init__(self, seq_id: str, request_id: str, index: int, prompt: Optional[str],
                 prompt_token_ids: List[int], params: SamplingParams,
                 eos_token_id: Optional[int], arrival_time: Optional[float] = None,
                 eos_token_ids: Collection[int] = ()):
        """eos_token_id: the tokenizer's EOS; eos_token_ids: the model's other EOS ids
        (generation_config.json's). Any of them ends the sequence unless ignore_eos."""
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index                      # sample index within the request (n > 1)
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + output
        self.params = params
        self.eos_token_id = eos_token_id
        # every EOS id, the tokenizer's included
        self.eos_token_ids = frozenset(eos_token_ids) | (
            {eos_token_id} if eos_token_id is not None else frozenset())
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.finish_reason: Optional[str] = None
        self.stop_reason: Any = None
        self.output_text = ""
        self.output_logprobs: List[Dict] = []
        self.prompt_logprobs: Optional[List[Optional[Dict]]] = None
        self.num_preemptions = 0
        self.first_token_time: Optional[float] = None
        self.first_scheduled_time: Optional[float] = None   # first admission (queue time ends)
        self.generator: Optional[torch.Generator] = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed + index)
        self.grammar = None                     # structured outputs: a SequenceGrammar that
                                                # follows the output tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> List[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: prompt + generated tokens are prefilled again (the KV
        manager resets the sequence's RequestKV: KVManager.preempt)."""
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions += 1
