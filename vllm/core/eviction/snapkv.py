"""SnapKVPolicy: prompt-only selection by the votes of the last prompt queries, max-pooled."""
from typing import Optional

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from vllm.config import KVEvictionConfig
from vllm.core.eviction.base import EvictionPolicy, no_eviction


def max_pool(x: np.ndarray, kernel: int) -> np.ndarray:
    """1-D max pooling, stride 1, padding kernel // 2 (padded cells never win)."""
    pad = kernel // 2
    # kernel 3: [1, 5, 2, 0] -> [-inf, 1, 5, 2, 0, -inf] -> windows of 3 -> [5, 5, 5, 2]
    padded = np.pad(x.astype(np.float32), pad, constant_values=-np.inf)
    return sliding_window_view(padded, kernel).max(axis=1)


class SnapKVPolicy(EvictionPolicy):
    """votes(j) = attention of the last w prompt queries on j (colsum; `prefill_query_window = w`
    asks the engine to sum only those queries). Keep the sinks, the w newest tokens (the window)
    and the top `budget - w` earlier tokens by max-pooled votes; pooled ties fall to the unpooled
    vote, then to age. Nothing is evicted during single-token decode, so |K| grows by one per
    generated token; a prompt that streams in (--kv-prefill-chunk, re-prefill) is compressed after
    every chunk by the votes of that chunk's last w queries."""
    needs_decode_stats = False

    def __init__(self, config: KVEvictionConfig, request_id: str, num_layer_heads: int,
                 prompt_len: int = 0):
        super().__init__(config, request_id, num_layer_heads, prompt_len)
        self.window = config.snapkv_window
        self.prefill_query_window = self.window

    @property
    def recent_minimum(self) -> int:
        return self.window

    def on_prefill(self, live_ids: np.ndarray, colsum: Optional[np.ndarray],
                   seq_len: int) -> np.ndarray:
        over = self.excess(live_ids, seq_len)
        if over <= 0:
            return no_eviction()
        assert colsum is not None and len(colsum) == len(live_ids), "SnapKV needs prefill colsum"
        votes = np.asarray(colsum, np.float32)
        prefix = len(live_ids) - self.window   # > 0: budget >= sinks + w and over > 0
        pooled = votes.copy()
        pooled[:prefix] = max_pool(votes[:prefix], self.config.snapkv_kernel)
        return self.pick_lowest(live_ids, over, self.window, pooled, votes)

    def on_decode(self, live_ids: np.ndarray, attn_mass: Optional[np.ndarray],
                  seq_len: int) -> np.ndarray:
        if attn_mass is None:        # a single-token decode step: no votes asked for
            return no_eviction()
        return self.on_prefill(live_ids, attn_mass, seq_len)
