"""EvictionPolicy: the interface every token-level eviction policy implements, plus the budget.

One instance per request. State lives in numpy arrays indexed by logical token id, grown on demand.
The engine calls `on_prefill` once at the end of the prompt (chunked prefill included; a re-prefill
after preemption gets a fresh instance) and `on_decode` once per generated token, then passes the
returned ids to `token_table.evict_tokens` and never shows them to the policy again.

Every policy protects the sinks (ids < `sinks`) and the newest live token, so the budget never drops
below `minimum = sinks + recent_minimum` (see `token_budget`).

Scope (--kv-evict-scope): under "all" every token counts and may go. Under "generated" the prompt
(ids < prompt length) is never evicted and counts for nothing: budgets and ratios are over the
generated tokens, so a request holds its prompt plus at most the budget of generated tokens. The
prompt holds the sinks (ids < sinks lie in it), so no generated token is a sink.
Interval (--kv-evict-interval N): a policy evicts only once its counted live tokens reach
budget + N, and then back down to the budget (`excess`); N = 1 evicts whenever it is over.
"""
import math
from typing import Optional

import numpy as np

from vllm.config import KVEvictionConfig


def token_budget(config: KVEvictionConfig, seq_len: int, minimum: int) -> int:
    """Tokens a request of counted length `seq_len` may keep: the fixed --kv-budget-tokens if
    given, else floor((1 - r) * n) for --kv-eviction-ratio r (r = 0: n, nothing evicted); never
    below the floor (`config.floor`: short contexts are left alone) nor `minimum`, since sinks and
    the policy's recent tokens cannot be evicted."""
    if config.budget_tokens is not None:
        target = config.budget_tokens
    else:
        # The epsilon absorbs binary rounding: (1 - 0.9) * 10 = 0.9999999999999998 -> 1, not 0.
        target = math.floor((1.0 - config.eviction_ratio) * seq_len + 1e-6)
    return max(minimum, config.floor, target)


def grown(array: np.ndarray, size: int) -> np.ndarray:
    """`array` zero-extended along axis -1 to at least `size` (capacity doubles)."""
    if array.shape[-1] >= size:
        return array
    out = np.zeros(array.shape[:-1] + (max(size, 2 * array.shape[-1]),), array.dtype)
    out[..., :array.shape[-1]] = array
    return out


def no_eviction() -> np.ndarray:
    return np.empty(0, np.int64)


class EvictionPolicy:
    needs_attention_stats: bool = True   # False: the engine passes None and computes nothing
    # Finer, optional hints for the engine (an engine may ignore them and always pass both):
    needs_prefill_stats: bool = True     # on_prefill reads colsum
    needs_decode_stats: bool = True      # on_decode reads attn_mass
    # one of worker/step_input.KEY_STATISTICS ("norm", "similarity": of the key; "value_norm": of
    # the value): observe_key_statistic gets it for every view token (mean over layers and KV
    # heads) on steps where the request is over budget
    key_statistic: Optional[str] = None

    def __init__(self, config: KVEvictionConfig, request_id: str, num_layer_heads: int,
                 prompt_len: int = 0):
        assert num_layer_heads >= 1, num_layer_heads
        self.config = config
        self.request_id = request_id
        self.num_layer_heads = num_layer_heads
        # the first counted id: the prompt's end under scope generated, else 0
        self.scope_start = prompt_len if config.scope == "generated" else 0
        self.first_evictable = max(config.sinks, self.scope_start)   # ids below never go
        self.sinks = max(config.sinks - self.scope_start, 0)          # sinks that are counted
        # Optional hint: colsum needs only the last q prompt queries (None: every prompt query).
        self.prefill_query_window: Optional[int] = None

    def observe_key_statistic(self, ids: np.ndarray, values: np.ndarray) -> None:
        """`key_statistic` of the view tokens `ids`, just before on_prefill / on_decode runs."""

    @property
    def recent_minimum(self) -> int:
        """Newest tokens this policy always keeps (at least the new token)."""
        return 1

    def budget(self, seq_len: int) -> int:
        """Counted tokens (those from scope_start on) a request of length seq_len may keep."""
        return token_budget(self.config, seq_len - self.scope_start,
                            self.sinks + self.recent_minimum)

    def over_budget(self, num_counted: int, seq_len: int) -> int:
        """Tokens to evict now when num_counted counted tokens are live: 0 until they reach
        budget + interval, then all the way down to the budget."""
        # budget 8, interval 4: 9..11 live -> 0; 12 -> 4
        over = num_counted - self.budget(seq_len)
        return over if over >= self.config.interval else 0

    def excess(self, live_ids: np.ndarray, seq_len: int) -> int:
        """over_budget for the live ids (ascending) of a request of length seq_len."""
        counted = len(live_ids) - int(np.searchsorted(live_ids, self.scope_start))
        return self.over_budget(counted, seq_len)

    def recent_window(self, budget: int) -> int:
        """H2O-style split: --kv-recent-fraction of the non-sink budget, at least the new token."""
        room = budget - self.sinks
        return min(room, max(1, int(self.config.recent_fraction * room)))

    def on_prefill(self, live_ids: np.ndarray, colsum: Optional[np.ndarray],
                   seq_len: int) -> np.ndarray:
        """Ids (int64, ascending, subset of live_ids) to evict after the prompt."""
        raise NotImplementedError

    def on_decode(self, live_ids: np.ndarray, attn_mass: Optional[np.ndarray],
                  seq_len: int) -> np.ndarray:
        """Ids to evict after this decode step; live_ids[-1] (the new token) is never among them."""
        raise NotImplementedError

    def evictable(self, live_ids: np.ndarray, recent: int) -> np.ndarray:
        """Mask of live tokens that may go: not a sink nor (scope generated) in the prompt, not
        among the `recent` newest."""
        # sinks=2, recent=2: ids [0, 1, 5, 6, 7, 8] -> [F, F, T, T, F, F]
        ok = live_ids >= self.first_evictable
        ok[max(len(live_ids) - recent, 0):] = False
        return ok

    def pick_lowest(self, live_ids: np.ndarray, count: int, recent: int,
                    *scores: np.ndarray) -> np.ndarray:
        """Up to `count` evictable ids with the lowest scores (aligned with live_ids; the first is
        primary, later ones break ties, then the older token, the smaller id, goes first)."""
        if count <= 0:
            return no_eviction()
        ok = self.evictable(live_ids, recent)
        ids = live_ids[ok].astype(np.int64)
        # np.lexsort sorts by its LAST key first: keys go in reversed, the id (last resort) first.
        # ids [4, 9, 2], score [.3, .1, .1] -> by (score, id): [2, 9, 4] -> count=2 evicts [2, 9]
        order = np.lexsort((ids,) + tuple(s[ok] for s in reversed(scores)))
        return np.sort(ids[order[:count]])
