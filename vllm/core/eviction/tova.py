"""TOVAPolicy: token omission via attention; the current query's attention alone decides."""
from typing import Optional

import numpy as np

from vllm.config import KVEvictionConfig
from vllm.core.eviction.base import EvictionPolicy


class TOVAPolicy(EvictionPolicy):
    """Keep the top `budget` tokens by this step's a(j) (no accumulation), sinks and the new token
    protected. At prefill the score is colsum; the reference scores with the last prompt query
    only, so `prefill_query_window = 1` asks the engine for exactly that (all queries otherwise)."""

    def __init__(self, config: KVEvictionConfig, request_id: str, num_layer_heads: int,
                 prompt_len: int = 0):
        super().__init__(config, request_id, num_layer_heads, prompt_len)
        self.prefill_query_window = 1

    def on_prefill(self, live_ids: np.ndarray, colsum: Optional[np.ndarray],
                   seq_len: int) -> np.ndarray:
        return self._keep_top(live_ids, colsum, seq_len)

    def on_decode(self, live_ids: np.ndarray, attn_mass: Optional[np.ndarray],
                  seq_len: int) -> np.ndarray:
        return self._keep_top(live_ids, attn_mass, seq_len)

    def _keep_top(self, live_ids, score, seq_len) -> np.ndarray:
        assert score is not None and len(score) == len(live_ids), "TOVA needs attention statistics"
        over = self.excess(live_ids, seq_len)
        return self.pick_lowest(live_ids, over, 1, np.asarray(score, np.float32))
