"""The fp8 part of benchmarks/benchmark_gpu_decode.py (what gpu_check.sh runs after the SLA scan
on a GPU) on CPU with its toy config: both engines decode at every batch, and the JSON carries
the fp8 / auto ratios and the KV bytes per token (fp32 -> fp8 on CPU: a quarter)."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import benchmark_gpu_decode as bench  # noqa: E402


def test_fp8_part_runs_on_cpu(tmp_path):
    out = tmp_path / "fp8.json"
    bench.main(["--device", "cpu", "--quick", "--parts", "fp8", "--fp8-batches", "2", "3",
                "--steps", "2", "--out", str(out)])
    data = json.loads(out.read_text())
    fp8 = data["fp8"]
    assert fp8["kv_cache_dtype"] == "fp8_e4m3" and fp8["context"] == 32
    assert fp8["kv_bytes_per_token"]["auto"] == 4 * fp8["kv_bytes_per_token"]["fp8_e4m3"]
    assert list(fp8["batches"]) == ["2", "3"]
    for r in fp8["batches"].values():
        for kv in ("auto", "fp8_e4m3"):
            assert all(r[kv][n]["tok_s"] > 0 for n in ("Native", "vToken"))
        assert set(r["ratios"]) == {"Native fp8 / auto", "vToken fp8 / auto"}
    assert set(data["seconds"]) == {"fp8"}
    assert "fp8" not in bench.parse([])[0].parts          # not a default part
