"""KeyScorePolicy: evict the live tokens with the largest per-key score read from the cache; its
base KeyStatisticPolicy holds such a statistic for any policy that reads one."""
from typing import Optional

import numpy as np

from vllm.core.eviction.base import EvictionPolicy, no_eviction


class KeyStatisticPolicy(EvictionPolicy):
    """A policy that reads a statistic of the cached keys or values (`key_statistic`). The runner
    computes it over the step's view only on steps where the request will be over budget; this
    keeps the one last observed and hands it back aligned with the live ids (`observed`)."""

    def __init__(self, config, request_id: str, num_layer_heads: int, prompt_len: int = 0):
        super().__init__(config, request_id, num_layer_heads, prompt_len)
        self.score_ids = np.empty(0, np.int64)
        self.score = np.empty(0, np.float32)

    def observe_key_statistic(self, ids: np.ndarray, values: np.ndarray) -> None:
        self.score_ids, self.score = ids, values

    def observed(self, live_ids: np.ndarray) -> np.ndarray:
        """This step's statistic by live token (a stale one, of another view, fails)."""
        assert np.array_equal(self.score_ids, live_ids), "needs this step's key statistic"
        return self.score


class KeyScorePolicy(KeyStatisticPolicy):
    """Score-free eviction by a statistic of the cached keys (`key_statistic`, computed by the
    runner over the step's view, only on steps where the request is over budget, so prefix-cache
    hits and re-prefills need nothing special). Over budget the largest scores go (sinks and the
    new token protected; ties: the older token first). No attention statistics: any attention
    kernel works, CUDA graphs too, and the decode kernels skip the mass output."""
    needs_attention_stats = False
    needs_prefill_stats = False
    needs_decode_stats = False

    def on_prefill(self, live_ids: np.ndarray, colsum: Optional[np.ndarray],
                   seq_len: int) -> np.ndarray:
        return self._evict_largest(live_ids, seq_len)

    def on_decode(self, live_ids: np.ndarray, attn_mass: Optional[np.ndarray],
                  seq_len: int) -> np.ndarray:
        return self._evict_largest(live_ids, seq_len)

    def _evict_largest(self, live_ids: np.ndarray, seq_len: int) -> np.ndarray:
        over = self.excess(live_ids, seq_len)
        if over <= 0:
            return no_eviction()
        # score [.2, .9, .1, .8, .5], newest protected, over 2 -> evict the .9 and the .8: ids [1, 3]
        return self.pick_lowest(live_ids, over, 1, -self.observed(live_ids))
