"""KVMonitor: per-request and engine-wide KV footprint statistics."""
from typing import Callable, Dict, Iterable

from vllm.core.block_manager import BlockManager
from vllm.core.request_kv import RequestKV
from vllm.core.step_stats import SeqStepStats


class KVMonitor:
    def __init__(self, block_manager: BlockManager, sliding_blocks: Callable[[], int] = int):
        """sliding_blocks: the pool blocks a hybrid model's sliding windows hold now (they are
        in use, but hold no token of the token tables: utilization leaves them out)."""
        self.bm = block_manager
        self.sliding_blocks = sliding_blocks
        self.steps = 0
        self.util_sum = 0.0
        self.live_tokens = 0

    def before_policies(self, r: SeqStepStats, req: RequestKV) -> None:
        """Blocks a request held while its step ran (before this step's evictions)."""
        st = req.kv_stats
        blocks = len(req.block_ids)
        st["peak_blocks"] = max(st.get("peak_blocks", 0), blocks)
        st["block_tokens"] = st.get("block_tokens", 0) + blocks * r.num_new
        st["computed_tokens"] = st.get("computed_tokens", 0) + r.num_new
        if r.is_decode and r.seq.num_computed_tokens > req.prefill_end:
            st["decode_block_steps"] = st.get("decode_block_steps", 0) + blocks
            st["decode_steps"] = st.get("decode_steps", 0) + 1

    def after_step(self, seq_ids: Iterable[str]) -> None:
        """seq_ids: the sequences holding KV."""
        tt = self.bm.token_table
        self.live_tokens = sum(tt.num_live(s) for s in seq_ids)
        used = self.bm.pool.num_used - self.sliding_blocks()
        if used:
            self.steps += 1
            self.util_sum += self.live_tokens / (used * self.bm.block_size)

    def on_finish(self, req: RequestKV) -> None:
        """Final per-request figures, taken while the request still holds its KV."""
        st = req.kv_stats
        st["blocks_at_finish"] = len(req.block_ids)
        st["live_tokens"] = self.bm.token_table.num_live(req.seq_id)
        st.setdefault("peak_blocks", st["blocks_at_finish"])
        st.setdefault("evicted_tokens", 0)
        st.setdefault("relocated_tokens", 0)
        steps = st.get("decode_steps", 0)
        st["mean_blocks"] = st.get("decode_block_steps", 0) / steps if steps else float(
            st["blocks_at_finish"])
        # blocks held per computed token (prompt chunks weighted by their tokens): the footprint
        # of a request over its whole life, streamed prompts included
        done = st.get("computed_tokens", 0)
        st["mean_blocks_per_token"] = st.get("block_tokens", 0) / done if done else 0.0

    def stats(self) -> Dict[str, float]:
        used, table_blocks = self.bm.pool.num_used, self.bm.pool.num_used - self.sliding_blocks()
        return {"blocks_total": self.bm.num_blocks, "blocks_used": used,
                "blocks_peak": self.bm.peak_used, "live_tokens": self.live_tokens,
                "sliding_window_blocks": used - table_blocks,
                "memory_utilization": self.live_tokens / (table_blocks * self.bm.block_size)
                if table_blocks else 0.0,
                "mean_memory_utilization": self.util_sum / self.steps if self.steps else 0.0}
