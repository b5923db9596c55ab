"""benchmarks/benchmark_gpu_decode.py (what benchmarks/gpu_check.sh runs on a GPU at the 8B
shape) end to end on CPU with its toy config: every part runs, and its JSON carries the
figures the GPU run reports (decode ratios against transformers, indirection overhead,
capacity frontier, SLA selection)."""
import json
import os
import sys

import pytest

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


def test_a_failed_measurement_costs_only_itself(tmp_path, monkeypatch):
    """One decode measurement raising (as batch 64 once did on the H200) is recorded as its
    error; the other batches, variants and the indirection rounds are still measured, the JSON
    is written, and the run exits non-zero naming it."""
    real = bench.engine_decode

    def flaky(eng, ev, batch, args, tag):
        if tag == "vToken-2":
            raise RuntimeError("injected")
        return real(eng, ev, batch, args, tag)
    monkeypatch.setattr(bench, "engine_decode", flaky)
    monkeypatch.setattr(bench, "FAILED", [])
    out = tmp_path / "gpu_decode.json"
    with pytest.raises(SystemExit, match="failed measurements.*vToken"):
        bench.main(["--device", "cpu", "--quick", "--parts", "decode", "--batches", "1", "2",
                    "--steps", "2", "--rounds", "1", "--no-hf", "--out", str(out)])
    data = json.loads(out.read_text())["decode"]
    assert data["2"]["vToken"] == {"error": "RuntimeError: injected"}
    assert data["2"]["Native"]["tok_s"] > 0 and data["2"]["Naive-Evict"]["tok_s"] > 0
    assert isinstance(data["2"]["indirection_overhead"], float)
    assert data["1"]["vToken"]["tok_s"] > 0
