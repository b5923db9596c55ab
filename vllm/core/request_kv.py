"""RequestKV: one sequence's KV state; the KVManager (kv_manager.py) owns one per sequence.

A Sequence (vllm/sequence.py) is what the request says and samples (tokens, status, outputs);
its RequestKV is where that sequence's KV lives and what its eviction policy knows. Lifetime:

    engine add_request    KVManager.add_request(seq_id, config)   created, holds no block
    admission             allocate(): blocks, token table, policy state for this admission
    preemption            free(), then reset_for_recompute(): back to "holds no block"
    finish / abort        free(): blocks go back; kv_stats stays for the RequestOutput
    output delivered      KVManager.drop_request(seq_id)            gone (or at abort)

kv_config and block_hashes (a function of token_ids) outlive preemption; eviction_log keeps
its on/off state across it.
"""
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional, Set

import numpy as np

from vllm.config import KVEvictionConfig

if TYPE_CHECKING:
    from vllm.core.eviction import EvictionPolicy


@dataclass(eq=False)
class RequestKV:
    seq_id: str
    kv_config: KVEvictionConfig     # this request's settings (the engine's unless it brought
                                    # its own KVEvictionParams)
    block_ids: List[int] = field(default_factory=list)
    num_cached_blocks: int = 0      # leading blocks registered in the prefix cache
    shared_blocks: Set[int] = field(default_factory=set)   # blocks taken from prefix-cache hits
    block_hashes: List[int] = field(default_factory=list)  # prefix hash of each full block of
                                                           # token_ids
    clean_tokens: Optional[int] = None       # tokens computed before the first eviction
    policy: Optional["EvictionPolicy"] = None  # per-request eviction policy state
    prefill_end: int = 0                     # tokens prefilled since the last admission
    policy_ran: bool = False                 # the policy has seen this admission's prompt
    prefill_colsum: Optional[np.ndarray] = None   # prompt attention column sums, by logical id
    eviction_log: Optional[List[np.ndarray]] = None   # evicted id arrays, in order (opt-in)
    kv_stats: Dict[str, float] = field(default_factory=dict)

    def reset_for_recompute(self) -> None:
        """Preemption by recompute (after KVManager.free): all KV dropped, the re-prefill
        restarts the policy; prefill_end and policy_ran are set again at the next admission."""
        self.block_ids = []
        self.num_cached_blocks = 0
        self.shared_blocks = set()
        self.clean_tokens = None
        self.policy = None                      # the re-prefill restarts the policy
        self.prefill_colsum = None
        self.kv_stats = {}                      # this admission's figures only
        if self.eviction_log is not None:
            self.eviction_log = []
