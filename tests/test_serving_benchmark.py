"""benchmark_serving.py's peer mode: the two servers take turns wave by wave, so a host that
slows down during a level slows both alike and the paired ratio stays the servers' ratio."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import benchmark_serving as bench  # noqa: E402


def test_wave_order_is_abba_with_each_server_once_per_pair():
    assert bench.wave_order(3) == ["ours", "llamacpp", "llamacpp", "ours", "ours", "llamacpp"]
    order = bench.wave_order(4)
    assert order.count("ours") == order.count("llamacpp") == 4


def test_measure_level_pairs_waves_under_a_drifting_host(monkeypatch):
    # the host loses 5% per wave; at equal speed ours makes 110 tok/s and llama-server 100
    calls = []

    def fake_load_waves(kind, port, conc, waves, prompts_file, new, peer_scripts):
        assert waves == 1 and conc == 8 and new == 128
        speed = 0.95 ** len(calls)
        calls.append(kind)
        tok_s = (110.0 if kind == "oai" else 100.0) * speed
        return {"waves": [{"agg_tok_s": tok_s, "lat_median_s": conc * 128 / tok_s}]}

    monkeypatch.setattr(bench, "load_waves", fake_load_waves)
    servers = {"ours": ("oai", type("S", (), {"port": 1})),
               "llamacpp": ("llamacpp", type("S", (), {"port": 2}))}
    row = bench.measure_level(servers, 8, 3, "prompts.json", 128, "peer")
    assert calls == ["oai", "llamacpp", "llamacpp", "oai", "oai", "llamacpp"]
    assert len(row["ours_waves"]) == len(row["llamacpp_waves"]) == 3
    # each pair's ratio is off by at most one wave's drift (all of ours first, then all of
    # llama-server's, would read 1.28)
    assert 1.1 * 0.95 - 1e-9 <= row["paired_ratio"] <= 1.1 / 0.95 + 1e-9
    assert 1.1 * 0.95 - 1e-9 <= row["ratio"] <= 1.1 / 0.95 + 1e-9
    assert row["ours_tok_s"] == sorted(w["agg_tok_s"] for w in row["ours_waves"])[1]
