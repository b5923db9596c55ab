"""StepOutput: what a worker hands back for one StepInput, as plain values.

    logits            [S, vocab] float32 of StepInput.sample_indices (rank 0; None: no rows)
    prompt_logits     [sum of counts, vocab] of StepInput.prompt_logit_spans, spans in turn
    rows              per row: its attention statistics by view position (numpy; None where
                      not collected). With tensor parallelism these are partial per rank (its
                      heads) and get summed across ranks before the engine sees them.
    completed_copies  ids of relocation batches completed since the previous step
"""
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np
import torch


@dataclass
class RowStats:
    scores: Optional[np.ndarray] = None          # float32 attention mass per view entry, summed
                                                 # over layers and heads (decode mass or the
                                                 # prompt chunk's column sums)
    key_statistic: Optional[np.ndarray] = None   # per view entry (StepInput.key_statistic)


@dataclass
class StepOutput:
    logits: Optional[torch.Tensor] = None
    prompt_logits: Optional[torch.Tensor] = None
    rows: List[RowStats] = field(default_factory=list)
    completed_copies: List[int] = field(default_factory=list)
