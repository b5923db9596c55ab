"""StreamingLLMPolicy: attention sinks plus a recent window (sliding window: 0 sinks)."""
from typing import Optional

import numpy as np

from vllm.core.eviction.base import EvictionPolicy, no_eviction


class StreamingLLMPolicy(EvictionPolicy):
    """Keep ids [0, sinks) and the newest `budget - sinks`; evict the oldest non-sink.

    Positions stay the original RoPE positions (keys are cached after RoPE); the reference
    re-rotates by cache index instead. Sliding window = this class with sinks = 0, which is what
    `config.sinks` gives for "sliding-window" unless --kv-sink-tokens says otherwise."""
    needs_attention_stats = False
    needs_prefill_stats = False
    needs_decode_stats = False

    def on_prefill(self, live_ids: np.ndarray, colsum: Optional[np.ndarray],
                   seq_len: int) -> np.ndarray:
        return self._evict_oldest(live_ids, seq_len)

    def on_decode(self, live_ids: np.ndarray, attn_mass: Optional[np.ndarray],
                  seq_len: int) -> np.ndarray:
        return self._evict_oldest(live_ids, seq_len)

    def _evict_oldest(self, live_ids: np.ndarray, seq_len: int) -> np.ndarray:
        over = self.excess(live_ids, seq_len)
        if over <= 0:
            return no_eviction()
        # budget >= sinks + 1 keeps the newest token: sinks=4, budget=8, live [0..9]
        # -> non-sinks [4..9] -> evict the first 2: [4, 5]
        return live_ids[live_ids >= self.first_evictable][:over].astype(np.int64)
