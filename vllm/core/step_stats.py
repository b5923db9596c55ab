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
    key_norms: bool = False               # ||k|| of every token written this step
    # seq_id -> index (within the step's chunk) of the first prompt query whose attention counts
    # towards the column sums; sequences not listed need none this step.
    prefill_from: Dict[str, int] = field(default_factory=dict)

    @property
    def any(self) -> bool:
        return self.decode or bool(self.prefill_from) or self.key_norms


@dataclass
class SeqStepStats:
    seq: Sequence
    num_new: int                         # tokens computed this step (num_computed_tokens includes them)
    is_decode: bool
    view_ids: np.ndarray                 # logical ids of the attention view, aligned with scores
    scores: Optional[np.ndarray] = None  # float32 attention mass per view id, summed over layers
                                         # and heads (and the chunk's scoring queries); None: not collected
    key_norms: Optional[np.ndarray] = None  # ||k|| of the num_new tokens written this step


@dataclass
class StepStats:
    rows: List[SeqStepStats] = field(default_factory=list)
