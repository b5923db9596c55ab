"""ValueRandomPolicy: random eviction that spares the tokens with the largest value norms (VaSE)."""
import math

import numpy as np

from vllm.core.eviction.key_score import KeyStatisticPolicy
from vllm.core.eviction.random_policy import RandomPolicy


class ValueRandomPolicy(RandomPolicy, KeyStatisticPolicy):
    """Value-aware random eviction (after VaSE, arXiv 2606.03928: evicting the few tokens with
    large value norms causes repetition loops). Over a budget of B counted tokens, the eligible
    tokens are those of `random`: not sinks, not the prompt under scope generated, not among the
    `recent_window(B)` newest. Of these the ceil(value_protect_fraction * B) with the largest
    ||v|| (mean over layers and KV heads) are spared, fewer where the rest could not hold the
    excess; equal norms spare the newer token (the older is exposed, as the tie rule has it).
    The excess is drawn uniformly from the rest with `random`'s generator (seed, crc32(request
    id), seq_len), so fraction 0 is `random`. No attention statistics: the value norms are read
    from the cache on evicting steps only."""
    key_statistic = "value_norm"

    def eligible(self, live_ids: np.ndarray, budget: int, over: int) -> np.ndarray:
        ok = self.evictable(live_ids, self.recent_window(budget))
        ids = live_ids[ok]
        # the epsilon absorbs binary rounding: 0.07 * 100 = 7.000000000000001 -> 7, not 8
        spared = min(math.ceil(self.config.value_protect_fraction * budget - 1e-9),
                     len(ids) - over)
        if spared <= 0:
            return ids
        # largest norm first, equal norms the newer first: norms [1, 5, 5, 2] ids [3, 4, 6, 7],
        # spare 1 -> order [6, 4, 7, 3] -> the draw takes from [3, 4, 7]
        order = np.lexsort((-ids, -self.observed(live_ids)[ok].astype(np.float64)))
        return np.sort(ids[order[spared:]])
