"""H2OPolicy: heavy-hitter oracle (cumulative attention received, plus a recent window)."""
from typing import Optional

import numpy as np

from vllm.config import KVEvictionConfig
from vllm.core.eviction.base import EvictionPolicy, grown


class H2OPolicy(EvictionPolicy):
    """Keep sinks, the `recent_window(budget)` newest tokens and the highest-scoring others, where
    S(j) = prefill column sum + every decode step's a(j). Bulk eviction after the prompt, then
    evict until |K| <= budget after every decode step (one-in-one-out under a fixed budget)."""

    def __init__(self, config: KVEvictionConfig, request_id: str, num_layer_heads: int,
                 prompt_len: int = 0):
        super().__init__(config, request_id, num_layer_heads, prompt_len)
        self.scores = np.zeros(0, np.float32)     # S(j) by logical id; 0 once evicted

    def on_prefill(self, live_ids: np.ndarray, colsum: Optional[np.ndarray],
                   seq_len: int) -> np.ndarray:
        return self._accumulate_and_evict(live_ids, colsum, seq_len)

    def on_decode(self, live_ids: np.ndarray, attn_mass: Optional[np.ndarray],
                  seq_len: int) -> np.ndarray:
        return self._accumulate_and_evict(live_ids, attn_mass, seq_len)

    def _accumulate_and_evict(self, live_ids, mass, seq_len) -> np.ndarray:
        assert mass is not None and len(mass) == len(live_ids), "H2O needs attention statistics"
        self.scores = grown(self.scores, int(live_ids[-1]) + 1)
        self.scores[live_ids] += mass
        budget = self.budget(seq_len)
        victims = self.pick_lowest(live_ids, self.excess(live_ids, seq_len),
                                   self.recent_window(budget),
                                   self.scores[live_ids])
        self.scores[victims] = 0.0
        return victims
