"""benchmark_throughput.py with llama.cpp: the engine and llama-batched-bench take turns in
ABBA order, and vs_llamacpp is the median of the per-round ratios, so a host whose bandwidth
drifts between rounds moves both sides of each ratio alike."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import benchmark_throughput as bench  # noqa: E402
import common  # noqa: E402


def test_abba_order_runs_each_side_once_per_pair():
    assert common.abba_order(3, "engine", "llamacpp") == [
        "engine", "llamacpp", "llamacpp", "engine", "engine", "llamacpp"]
    assert common.abba_order(0, "a", "b") == []


def test_peer_summary_pairs_rounds_under_a_drifting_host():
    # batch 4, 128 new tokens; the host loses 10% per turn; at equal speed the engine makes
    # 120 tok/s and llama.cpp 100 (incl. prefill: T = 4 * 128 / tok_s)
    order = common.abba_order(3, "engine", "llamacpp")
    speed = {i: 0.9 ** i for i in range(len(order))}
    engine = [120.0 * speed[i] for i, who in enumerate(order) if who == "engine"]
    peer_rows = [{"tg": 128, "t_s": 4 * 128 / (100.0 * speed[i]), "s_tg": 110.0 * speed[i]}
                 for i, who in enumerate(order) if who == "llamacpp"]
    row = bench.peer_summary(peer_rows, engine, 4)
    assert row["llamacpp_rounds_tok_s"] == pytest.approx([100.0 * speed[i] for i in (1, 2, 5)])
    # each pair is one turn apart: off by at most one turn's drift, either way
    assert all(1.2 * 0.9 - 1e-9 <= r <= 1.2 / 0.9 + 1e-9 for r in row["vs_llamacpp_rounds"])
    assert row["vs_llamacpp"] == pytest.approx(1.2 / 0.9)       # the ratios: 1.08, 1.33, 1.33
    assert row["vs_llamacpp_min"] == pytest.approx(1.2 * 0.9)
    assert row["llamacpp_tok_s"] == pytest.approx(100.0 * 0.9 ** 2)
    assert row["llamacpp_decode_tok_s"] == pytest.approx(110.0 * 0.9 ** 2)


def test_parse_batched_bench_reads_the_table_and_settings():
    text = """main: n_kv_max = 12032, n_batch = 2048, n_ubatch = 512, n_threads = 2
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |    128 |    1 |    256 |    0.325 |   393.44 |    2.762 |    46.35 |    3.087 |    82.93 |
"""
    rows, settings = bench.parse_batched_bench(text)
    assert settings["n_threads"] == "2"
    assert rows == [{"pp": 128, "tg": 128, "b": 1, "n_kv": 256, "t_pp_s": 0.325, "s_pp": 393.44,
                     "t_tg_s": 2.762, "s_tg": 46.35, "t_s": 3.087, "s": 82.93}]
