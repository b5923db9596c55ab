"""benchmark_hybrid_capacity.py: the layout each variant pays per token and per request, and a
small simulated run at the Gemma-3-27B shape end to end (the hybrid groups hold more requests
than one full-size group in the same memory, and vToken more than Native with groups)."""
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import benchmark_hybrid_capacity as hyb  # noqa: E402


def test_gemma3_27b_layout_pays_its_full_layers_per_token():
    model = hyb.shape_dir("gemma3-27b", 1.0)
    one, groups = hyb.layout(model, True, 13296), hyb.layout(model, False, 13296)
    page = 2 * 16 * 128 * 2                             # K + V, 16 KV heads x 128, bf16
    assert one["token_bytes"] == 62 * page and one["sliding_blocks"] == 0
    assert groups["token_bytes"] == 10 * page           # 10 full layers of 62
    assert groups["sliding_blocks"] == 6 * (1024 // 16 + 1)     # ceil(52 / 10) subgroups
    short = hyb.layout(model, False, 100)               # shorter than the window
    assert short["sliding_blocks"] == 6 * 7


def test_small_simulated_run_orders_the_variants():
    args = SimpleNamespace(scale=0.03, quick=False, memory_gib=40.0, max_c=64, seed=0)
    row = hyb.run_shape("gemma3-27b", args, lambda m: None)
    assert row["Native, one group"] < row["Native, groups"] < row["vToken, groups"]
    assert row["vToken, groups"] <= row["ideal (groups)"]
