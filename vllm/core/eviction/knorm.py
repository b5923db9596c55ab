"""KNormPolicy: keep the keys with the lowest L2 norm (Devoto et al., 2024); no attention needed."""
from typing import Optional

import numpy as np

from vllm.core.eviction.base import EvictionPolicy, grown, no_eviction


class KNormPolicy(EvictionPolicy):
    """Keys with a small L2 norm draw high attention, so over budget the live tokens with the
    largest key norm go first (sinks and the new token protected; ties: the older token first).
    A token's norm is ||k|| averaged over layers and KV heads, reported by the runner as its K/V
    is written; it never changes, so the policy works with any attention kernel and needs no
    attention statistics (nothing for the decode kernels to emit)."""
    needs_attention_stats = False
    needs_prefill_stats = False
    needs_decode_stats = False
    needs_key_norms = True

    def __init__(self, config, request_id: str, num_layer_heads: int):
        super().__init__(config, request_id, num_layer_heads)
        self.norms = np.zeros(0, np.float32)       # by logical id

    def observe_key_norms(self, ids: np.ndarray, norms: np.ndarray) -> None:
        self.norms = grown(self.norms, int(ids[-1]) + 1)
        self.norms[ids] = norms

    def on_prefill(self, live_ids: np.ndarray, colsum: Optional[np.ndarray],
                   seq_len: int) -> np.ndarray:
        return self._evict_largest(live_ids, seq_len)

    def on_decode(self, live_ids: np.ndarray, attn_mass: Optional[np.ndarray],
                  seq_len: int) -> np.ndarray:
        return self._evict_largest(live_ids, seq_len)

    def _evict_largest(self, live_ids: np.ndarray, seq_len: int) -> np.ndarray:
        over = len(live_ids) - self.budget(seq_len)
        if over <= 0:
            return no_eviction()
        # norms [.5, 3, 1, 2, .7], newest protected, over 2 -> evict the 3 and the 2: ids [1, 3]
        return self.pick_lowest(live_ids, over, 1, -self.norms[live_ids])
