"""ScissorhandsPolicy: persistence of importance (count of below-uniform steps in a window)."""
from typing import Optional

import numpy as np

from vllm.config import KVEvictionConfig
from vllm.core.eviction.base import EvictionPolicy, grown, no_eviction


class ScissorhandsPolicy(EvictionPolicy):
    """count(j) = decode steps among the last w in which a(j) / (L*H) < 1/n_t (high = unimportant).
    The r newest tokens and the sinks are always kept. When |K| exceeds the budget during decode,
    the m highest-count tokens go at once (m = config.scissorhands_drop, default budget // 2), so
    the next drop comes m tokens later. After the prompt there is no history yet (all counts 0):
    it evicts only down to the budget, oldest unprotected first by the tie rule, ignoring colsum."""
    needs_prefill_stats = False

    def __init__(self, config: KVEvictionConfig, request_id: str, num_layer_heads: int,
                 prompt_len: int = 0):
        super().__init__(config, request_id, num_layer_heads, prompt_len)
        self.window = config.scissorhands_window
        self.counts = np.zeros(0, np.int32)                # by logical id; 0 once evicted
        self.low = np.zeros((self.window, 0), np.bool_)    # ring: low[step % w, id]
        self.step = 0

    @property
    def recent_minimum(self) -> int:
        return max(1, self.config.scissorhands_recent)

    def on_prefill(self, live_ids: np.ndarray, colsum: Optional[np.ndarray],
                   seq_len: int) -> np.ndarray:
        self._reserve(int(live_ids[-1]) + 1)
        return self._drop(live_ids, self.excess(live_ids, seq_len))

    def on_decode(self, live_ids: np.ndarray, attn_mass: Optional[np.ndarray],
                  seq_len: int) -> np.ndarray:
        assert attn_mass is not None and len(attn_mass) == len(live_ids), \
            "Scissorhands needs decode attention statistics"
        self._reserve(int(live_ids[-1]) + 1)
        self._record_low(live_ids, attn_mass)
        over = self.excess(live_ids, seq_len)
        if over <= 0:
            return no_eviction()
        drop = self.config.scissorhands_drop
        return self._drop(live_ids, max(over, self.budget(seq_len) // 2 if drop is None else drop))

    def _reserve(self, size: int) -> None:
        self.counts = grown(self.counts, size)
        self.low = grown(self.low, size)

    def _record_low(self, live_ids: np.ndarray, attn_mass: np.ndarray) -> None:
        row = self.step % self.window
        self.step += 1
        self.counts -= self.low[row]           # the step w steps ago leaves the window
        self.low[row] = False
        # a(j)/(L*H) < 1/n_t  <=>  a(j) * n_t < L*H
        # L*H=2, n_t=4: a [1.5, .3, .2, 0] -> a*4 [6, 1.2, .8, 0] < 2 -> [F, T, T, T]
        low_ids = live_ids[attn_mass.astype(np.float64) * len(live_ids) < self.num_layer_heads]
        self.low[row, low_ids] = True
        self.counts[low_ids] += 1

    def _drop(self, live_ids: np.ndarray, count: int) -> np.ndarray:
        # highest count first == lowest -count; equal counts -> the older token
        victims = self.pick_lowest(live_ids, count, self.recent_minimum, -self.counts[live_ids])
        self.counts[victims] = 0
        self.low[:, victims] = False
        return victims
