"""Stage 2, headroom-aware admission: blocks kept free before admitting new KV allocations.

The headroom is charged against the same pool (no extra memory): the scheduler admits a waiting
request only if `reserve()` blocks stay free afterwards, so relocation and running requests'
growth can always proceed under pressure.
"""
from vllm.config import KVEvictionConfig


class HeadroomAdmission:
    def __init__(self, config: KVEvictionConfig):
        self.blocks = config.reclaim_headroom_blocks if config.reclaims else 0

    def reserve(self) -> int:
        return self.blocks
