"""benchmarks/benchmark_gpu_decode.py (what benchmarks/gpu_check.sh runs on a GPU at the 8B
shape) end to end on CPU with its toy config: every part runs, and its JSON carries the
figures the GPU run reports (decode ratios against transformers, indirection overhead,
capacity frontier, SLA selection)."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import benchmark_gpu_decode as bench  # noqa: E402


def test_all_parts_run_on_cpu_and_write_one_json(tmp_path):
    out = tmp_path / "gpu_decode.json"
    bench.main(["--device", "cpu", "--quick", "--batches", "1", "2", "--steps", "2",
                "--rounds", "1", "--capacity-scale", str(1 / 128), "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and data["model"] == "toy" and data["graphs"]
    for b in ("1", "2"):
        r = data["decode"][b]
        assert {"Native", "Naive-Evict", "vToken", "transformers"} <= set(r)
        assert r["vToken"]["tok_s"] > 0 and "vToken / transformers" in r["ratios"]
        assert isinstance(r["indirection_overhead"], float)
    cap = data["capacity"]
    assert cap["blocks"] == 42 and cap["Native"] >= 1 and cap["vToken"] >= cap["Native"]
    assert all(w["request_peak_blocks"] > 0 for w in cap["trials"]["vToken"].values()
               if w["feasible"])
    sla = data["sla"]
    assert sla["levels"] and sla["sla_s"] > 0 and set(sla["selected"]) == {
        "Native", "Naive-Evict", "vToken"}
    for name, waves in sla["waves"].items():      # every level measured (or reused) per variant
        assert sorted(int(c) for c in waves) == sla["levels"]
    assert set(data["seconds"]) == {"decode", "capacity", "sla"}
