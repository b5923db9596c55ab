"""RKVPolicy: R-KV (Cai et al., 2025): importance from recent queries minus redundancy of keys."""
from typing import Optional

import numpy as np

from vllm.config import KVEvictionConfig
from vllm.core.eviction.base import grown, no_eviction
from vllm.core.eviction.key_score import KeyStatisticPolicy


class RKVPolicy(KeyStatisticPolicy):
    """score(j) = lambda * I(j) - (1 - lambda) * R(j), lambda = rkv_lambda; over budget the lowest
    scores go (`pick_lowest`: equal scores, the older token first), the sinks, the prompt under
    scope generated and the w = rkv_window newest tokens protected. Both terms are distributions
    over the live tokens the budget counts (every live token under scope all, the generated ones
    under scope generated):

    - importance I(j): a(j), the attention mass of a step summed over layers and heads, summed
      over the last w decode steps (a ring buffer by logical id, like Scissorhands'), divided by
      its sum. After the prompt there is no decode history: a(j) is the prompt's column sums over
      its last w queries (`prefill_query_window = w`, as SnapKV and TOVA ask). A later segment of
      a streamed prompt (--kv-prefill-chunk, a re-prefill) is one ring step with its column sums
      over its last w queries.
    - redundancy R(j): softmax over those tokens of the "similarity" key statistic, cos(k_j, m)
      with m the mean unit key of the view, averaged over layers and KV heads. R-KV uses the mean
      cosine of k_j to all the view's keys, which per head is k_j/|k_j| . m = |m| cos(k_j, m): the
      same up to a positive factor per head (R-KV also leaves out j itself, an affine change).

    Needs attention statistics (prefill and every decode step, for the ring) and the key
    statistic, which the engine computes only on steps where the request is over budget."""
    key_statistic = "similarity"

    def __init__(self, config: KVEvictionConfig, request_id: str, num_layer_heads: int,
                 prompt_len: int = 0):
        super().__init__(config, request_id, num_layer_heads, prompt_len)
        self.window = config.rkv_window
        self.lam = config.rkv_lambda
        self.prefill_query_window = self.window
        self.mass = np.zeros((self.window, 0), np.float32)    # ring: mass[step % w, id]
        self.step = 0

    @property
    def recent_minimum(self) -> int:
        return self.window

    def on_prefill(self, live_ids: np.ndarray, colsum: Optional[np.ndarray],
                   seq_len: int) -> np.ndarray:
        over = self.excess(live_ids, seq_len)
        if over <= 0:
            return no_eviction()
        assert colsum is not None and len(colsum) == len(live_ids), "R-KV needs prefill colsum"
        return self._evict_lowest(live_ids, np.asarray(colsum, np.float64), over)

    def on_decode(self, live_ids: np.ndarray, attn_mass: Optional[np.ndarray],
                  seq_len: int) -> np.ndarray:
        assert attn_mass is not None and len(attn_mass) == len(live_ids), \
            "R-KV needs decode attention statistics"
        self.mass = grown(self.mass, int(live_ids[-1]) + 1)
        row = self.step % self.window          # the step w steps ago leaves the window
        self.step += 1
        self.mass[row] = 0.0
        self.mass[row, live_ids] = attn_mass
        over = self.excess(live_ids, seq_len)
        if over <= 0:
            return no_eviction()
        return self._evict_lowest(live_ids, self.mass[:, live_ids].sum(0, dtype=np.float64), over)

    def _evict_lowest(self, live_ids: np.ndarray, mass: np.ndarray, over: int) -> np.ndarray:
        counted = live_ids >= self.scope_start
        importance = np.where(counted, mass, 0.0)
        total = importance.sum()
        if total > 0:
            importance /= total
        # softmax over the counted tokens: sims [0, ln 2, ln 2] -> [1, 2, 2] / 5 = [.2, .4, .4]
        sims = np.where(counted, self.observed(live_ids).astype(np.float64), -np.inf)
        redundancy = np.exp(sims - sims.max())
        redundancy /= redundancy.sum()
        score = self.lam * importance - (1.0 - self.lam) * redundancy
        return self.pick_lowest(live_ids, over, self.window, score)
