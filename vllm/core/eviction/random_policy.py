"""RandomPolicy: uniform eviction among eligible tokens, reproducible per (seed, request, step)."""
import zlib
from typing import Optional

import numpy as np

from vllm.core.eviction.base import EvictionPolicy, no_eviction


class RandomPolicy(EvictionPolicy):
    """Over budget, evict uniformly among tokens that are neither sinks nor in the recent window
    (the H2O split, --kv-recent-fraction). The generator is seeded from (--seed, crc32(request id),
    seq_len): seq_len identifies the step, so the draw does not depend on batch composition, on
    other requests, or on how many calls this instance has seen (a re-prefill gets a new one)."""
    needs_attention_stats = False
    needs_prefill_stats = False
    needs_decode_stats = False

    def on_prefill(self, live_ids: np.ndarray, colsum: Optional[np.ndarray],
                   seq_len: int) -> np.ndarray:
        return self._evict_random(live_ids, seq_len)

    def on_decode(self, live_ids: np.ndarray, attn_mass: Optional[np.ndarray],
                  seq_len: int) -> np.ndarray:
        return self._evict_random(live_ids, seq_len)

    def rng(self, step: int) -> np.random.Generator:
        key = [self.config.seed & (2**64 - 1), zlib.crc32(self.request_id.encode()), step]
        return np.random.default_rng(key)

    def eligible(self, live_ids: np.ndarray, budget: int, over: int) -> np.ndarray:
        """Ids (ascending) the draw takes `over` of: neither sinks nor in the recent window."""
        return live_ids[self.evictable(live_ids, self.recent_window(budget))]

    def _evict_random(self, live_ids: np.ndarray, seq_len: int) -> np.ndarray:
        over = self.excess(live_ids, seq_len)
        if over <= 0:
            return no_eviction()
        eligible = self.eligible(live_ids, self.budget(seq_len), over)
        victims = self.rng(seq_len).choice(eligible, size=over, replace=False)
        return np.sort(victims).astype(np.int64)
