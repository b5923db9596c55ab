"""RequestOutput / CompletionOutput with upstream vLLM's field names."""
import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union


class RequestOutputKind(enum.IntEnum):
    """What AsyncLLMEngine.generate() yields (SamplingParams.output_kind), as upstream."""
    CUMULATIVE = 0     # after every step: everything generated so far
    DELTA = 1          # after every step: only what is new since the previous output
    FINAL_ONLY = 2     # the finished output alone


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: List[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[List[Dict]]
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    prompt_logprobs: Optional[List[Optional[Dict]]]
    outputs: List[CompletionOutput]
    finished: bool
    kv_stats: Dict[str, float] = field(default_factory=dict)
    metrics: Dict[str, float] = field(default_factory=dict)


def delta_output(out: RequestOutput, sent: Dict[int, Tuple[int, int]]) -> RequestOutput:
    """`out` (cumulative) cut to what is new since the outputs already handed out, whose
    (token count, text length) per completion index `sent` holds; updates `sent`. Prompt
    logprobs go with the first delta only."""
    first = not sent
    completions = []
    for c in out.outputs:
        n_tokens, n_chars = sent.get(c.index, (0, 0))
        completions.append(dataclasses.replace(
            c, text=c.text[n_chars:], token_ids=c.token_ids[n_tokens:],
            logprobs=None if c.logprobs is None else c.logprobs[n_tokens:]))
        sent[c.index] = (len(c.token_ids), len(c.text))
    return dataclasses.replace(out, outputs=completions,
                               prompt_logprobs=out.prompt_logprobs if first else None)
