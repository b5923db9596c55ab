"""What the KV manager asks of a model step, and what the step reports back: plain arrays.

    ScoreRequest  (KV manager -> runner)  which attention statistics to collect this step
    StepStats     (runner -> KV manager)  per sequence: its attention view and the scores
"""
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

from vllm.sequence import Sequence


@dataclass
class ScoreRequest:
    decode: bool = False                  # attention mass of each decode query over its view
    # seq_id -> key statistic (one of step_input.KEY_STATISTICS) over its view after the step
    key_statistic: Dict[str, str] = field(default_factory=dict)
    # seq_id -> index (within the step's chunk) of the first prompt query whose attention counts
    # towards the column sums; sequences not listed need none this step.
    prefill_from: Dict[str, int] = field(default_factory=dict)

    @property
    def any(self) -> bool:
        return self.decode or bool(self.prefill_from) or bool(self.key_statistic)


@dataclass
class SeqStepStats:
    seq: Sequence
    num_new: int                         # tokens computed this step (num_computed_tokens includes them)
    is_decode: bool
    view_ids: np.ndarray                 # logical ids of the attention view, aligned with scores
    scores: Optional[np.ndarray] = None  # float32 attention mass per view id, summed over layers
                                         # and heads (and the chunk's scoring queries); None: not collected
    key_statistic: Optional[np.ndarray] = None  # per view id, when asked (ScoreRequest)


@dataclass
class StepStats:
    rows: List[SeqStepStats] = field(default_factory=list)
