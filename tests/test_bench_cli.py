"""`vllm bench serve | throughput | latency`: upstream's flags, the arrival process, the metrics,
and real runs on a tiny random model (serve against a server on its own engine)."""
import asyncio
import json
import math
import os
import sys
import time

import httpx
import numpy as np
import pytest

from tests.server_utils import served
from vllm.benchmarks.arrivals import arrival_times, get_request
from vllm.benchmarks.datasets import get_samples
from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput, _chat_text
from vllm.benchmarks.metrics import calculate_metrics, parse_goodput
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.cli import make_parser

# the keys of upstream's `vllm bench serve` result file (without --save-detailed)
UPSTREAM_SERVE_KEYS = {
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
    "request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed",
    "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
    "output_throughput", "total_token_throughput", "latencies", "max_output_tokens_per_s",
    "max_concurrent_requests"}
PERCENTILE_KEYS = {f"{kind}_{m}_ms" for kind in ("mean", "median", "std", "p50", "p90", "p99")
                   for m in ("ttft", "tpot", "itl", "e2el")}


def _parse(*argv: str):
    return make_parser().parse_args(list(argv))


# ---- flags ------------------------------------------------------------------------------------
def test_bench_serve_parses_upstream_flags():
    args = _parse(
        "bench", "serve", "--backend", "openai-chat", "--base-url", "http://h:1",
        "--endpoint", "/v1/chat/completions", "--model", "m", "--dataset-name", "sharegpt",
        "--dataset-path", "x.json", "--num-prompts", "7", "--random-input-len", "5",
        "--random-output-len", "6", "--random-range-ratio", "0.5", "--request-rate", "2.5",
        "--burstiness", "inf", "--max-concurrency", "3", "--ignore-eos", "--seed", "4",
        "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99",
        "--goodput", "ttft:100", "e2el:900", "--save-result", "--result-dir", "d",
        "--result-filename", "f.json", "--metadata", "a=1", "b=2",
        "--extra-body", '{"kv_eviction_policy": "h2o"}', "--temperature", "0")
    assert (args.backend, args.base_url, args.endpoint, args.model) == \
        ("openai-chat", "http://h:1", "/v1/chat/completions", "m")
    assert (args.dataset_name, args.dataset_path, args.num_prompts) == ("sharegpt", "x.json", 7)
    assert (args.random_input_len, args.random_output_len, args.random_range_ratio) == (5, 6, 0.5)
    assert args.request_rate == 2.5 and math.isinf(args.burstiness)
    assert (args.max_concurrency, args.ignore_eos, args.seed) == (3, True, 4)
    assert (args.percentile_metrics, args.metric_percentiles) == ("ttft,e2el", "50,99")
    assert parse_goodput(args.goodput) == {"ttft": 100.0, "e2el": 900.0}
    assert (args.save_result, args.result_dir, args.result_filename) == (True, "d", "f.json")
    assert args.metadata == ["a=1", "b=2"] and args.temperature == 0.0
    assert args.extra_body == {"kv_eviction_policy": "h2o"}
    defaults = _parse("bench", "serve")
    assert (defaults.backend, defaults.host, defaults.port, defaults.dataset_name) == \
        ("openai", "127.0.0.1", 8000, "random")
    assert math.isinf(defaults.request_rate) and defaults.burstiness == 1.0
    assert (defaults.num_prompts, defaults.metric_percentiles) == (1000, "99")
    with pytest.raises(ValueError):
        parse_goodput(["ttfb:10"])


def test_offline_benches_take_every_engine_flag():
    args = _parse("bench", "throughput", "--model", "m", "--input-len", "8", "--output-len",
                  "4", "--num-prompts", "3", "--output-json", "t.json", "--kv-eviction-policy",
                  "h2o", "--kv-eviction-ratio", "0.3", "--kv-reclamation", "none")
    ea = EngineArgs.from_cli_args(args)
    assert (ea.model, ea.kv_eviction_policy, ea.kv_eviction_ratio, ea.kv_reclamation) == \
        ("m", "h2o", 0.3, "none")
    assert (args.input_len, args.output_len, args.num_prompts, args.output_json) == \
        (8, 4, 3, "t.json")
    args = _parse("bench", "latency", "--input-len", "8", "--output-len", "4", "--batch-size",
                  "2", "--num-iters-warmup", "1", "--num-iters", "3", "--kv-budget-tokens", "16")
    assert (args.batch_size, args.num_iters_warmup, args.num_iters) == (2, 1, 3)
    assert EngineArgs.from_cli_args(args).kv_budget_tokens == 16
    with pytest.raises(SystemExit):
        _parse("bench")


# ---- arrivals ---------------------------------------------------------------------------------
def test_poisson_arrivals_have_exponential_gaps_of_the_rate():
    times = arrival_times(20001, 8.0, 1.0, np.random.default_rng(0))
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)       # exponential: CV 1
    bursty = np.diff(arrival_times(20001, 8.0, 0.25, np.random.default_rng(0)))
    even = np.diff(arrival_times(20001, 8.0, 4.0, np.random.default_rng(0)))
    assert bursty.mean() == pytest.approx(0.125, rel=0.05) and even.mean() == \
        pytest.approx(0.125, rel=0.03)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.05)   # 1 / sqrt(shape)
    assert even.std() / even.mean() == pytest.approx(0.5, rel=0.05)
    again = arrival_times(50, 8.0, 1.0, np.random.default_rng(0))
    assert np.array_equal(again, arrival_times(50, 8.0, 1.0, np.random.default_rng(0)))
    assert not np.array_equal(again, arrival_times(50, 8.0, 1.0, np.random.default_rng(1)))


def test_constant_rate_arrivals_are_evenly_spaced():
    times = arrival_times(9, 4.0, math.inf)
    assert times.tolist() == [i / 4.0 for i in range(9)]
    assert arrival_times(5, math.inf).tolist() == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_times(5, 1.0, 0.0)


def test_requests_are_not_sent_before_their_arrival_time():
    async def collect():
        got = []
        t0 = time.perf_counter()
        async for item in get_request(["a", "b", "c"], [0.0, 0.05, 0.1]):
            got.append((item, time.perf_counter() - t0))
        return got
    got = asyncio.run(collect())
    assert [g[0] for g in got] == ["a", "b", "c"]
    assert got[1][1] >= 0.05 and got[2][1] >= 0.1


# ---- metrics ----------------------------------------------------------------------------------
def _out(ttft, latency, tokens, itl, start=0.0):
    return RequestFuncOutput(success=True, ttft=ttft, latency=latency, output_tokens=tokens,
                             itl=itl, prompt_len=10, start_time=start)


def test_metrics_tpot_goodput_and_percentiles():
    outs = [_out(0.1, 0.5, 5, [0.1] * 4), _out(0.3, 1.5, 7, [0.2] * 6, start=0.2),
            _out(0.2, 0.2, 1, [], start=0.4), RequestFuncOutput(error="x")]
    m, lens = calculate_metrics(outs, 2.0, [50, 99], {"ttft": 250, "tpot": 150})
    assert lens == [5, 7, 1, 0] and (m.completed, m.failed) == (3, 1)
    assert (m.total_input, m.total_output) == (30, 13)
    assert m.mean_tpot_ms == pytest.approx(1000 * (0.4 / 4 + 1.2 / 6) / 2)   # two-token+ only
    # request 0 (ttft 100, tpot 100) and request 2 (ttft 200, one token: tpot 0) meet both SLOs
    assert m.request_goodput == pytest.approx(2 / 2.0)
    assert m.request_throughput == pytest.approx(3 / 2.0)
    assert m.output_throughput == pytest.approx(13 / 2.0)
    assert m.percentile_ms("e2el", 50) == pytest.approx(500.0)
    assert m.percentile_ms("itl", 50) <= m.percentile_ms("itl", 99) == pytest.approx(200.0)
    assert m.max_concurrent_requests == 3          # 0-0.5, 0.2-1.7 and 0.4-0.6 overlap
    assert _chat_text({"delta": {"role": "assistant", "content": ""}}) is None
    assert _chat_text({"delta": {"content": "w5"}}) == "w5"


# ---- datasets ---------------------------------------------------------------------------------
def test_sharegpt_and_longbench_files_sample_by_the_flags(tiny_llama, tmp_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    words = lambda n, k=3: " ".join(f"w{k + i}" for i in range(n))     # noqa: E731
    def conv(first, n):
        return {"conversations": [{"from": first, "value": words(n)},
                                  {"from": "human" if first == "gpt" else "gpt",
                                   "value": words(2 * n)}]}
    convs = [conv("human", 6), conv("gpt", 8), conv("human", 2), conv("human", 9),
             conv("human", 12), conv("human", 7)]
    (tmp_path / "sharegpt.json").write_text(json.dumps(convs)[:-40])   # cut inside the last
    args = _parse("bench", "serve", "--dataset-name", "sharegpt", "--dataset-path",
                  str(tmp_path / "sharegpt.json"), "--num-prompts", "4", "--seed", "1")
    got = get_samples(args, tok)
    # skipped: a conversation the model opens, a 2-token prompt, the cut-off record; the three
    # left are topped up to 4 by a repeat (upstream's oversampling)
    assert len(got) == 4
    assert {(r.prompt_len, r.expected_output_len) for r in got} == {(6, 12), (9, 18), (12, 24)}
    args.sharegpt_output_len = 5
    assert {r.expected_output_len for r in get_samples(args, tok)} == {5}
    with open(tmp_path / "longbench.jsonl", "w") as f:
        for i in range(3):
            f.write(json.dumps({"context": words(50, 10 + i), "input": words(4)}) + "\n")
    args = _parse("bench", "serve", "--dataset-name", "longbench", "--dataset-path",
                  str(tmp_path / "longbench.jsonl"), "--num-prompts", "2",
                  "--longbench-context-len", "20", "--longbench-output-len", "7")
    got = get_samples(args, tok)
    assert len(got) == 2 and {r.expected_output_len for r in got} == {7}
    assert got[1].prompt.startswith(words(20, 11)) and got[0].prompt_len > 20


# ---- real runs --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_llama):
    yield from served(tiny_llama)


def _server_tokens(url: str):
    """(prompt, generation) tokens the server has counted so far (its Prometheus counters)."""
    text = httpx.get(url + "/metrics").text

    def total(name):
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name))
    return total("vllm:prompt_tokens_total"), total("vllm:generation_tokens_total")


def _bench_serve(server, tiny_llama, *flags):
    args = _parse("bench", "serve", "--base-url", server.url, "--model", tiny_llama,
                  "--served-model-name", "tiny", "--dataset-name", "random",
                  "--random-input-len", "12", "--random-output-len", "6", "--num-prompts", "6",
                  "--disable-tqdm", *flags)
    return args.func(args)


def test_bench_serve_counts_what_the_server_generated(server, tiny_llama, tmp_path):
    before = _server_tokens(server.url)
    result = _bench_serve(server, tiny_llama, "--max-concurrency", "3", "--ignore-eos",
                          "--percentile-metrics", "ttft,tpot,itl,e2el",
                          "--metric-percentiles", "50,90,99", "--goodput", "ttft:0",
                          "--save-result", "--save-detailed", "--result-dir", str(tmp_path),
                          "--result-filename", "run.json", "--metadata", "policy=none",
                          "--extra-body", '{"kv_eviction_policy": "none"}')
    after = _server_tokens(server.url)
    assert (result["completed"], result["failed"]) == (6, 0)
    assert result["total_output_tokens"] == 36 == after[1] - before[1]
    assert result["total_input_tokens"] == after[0] - before[0] == sum(result["input_lens"])
    assert result["output_lens"] == [6] * 6 and result["max_concurrent_requests"] <= 3
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < result[f"p50_{m}_ms"] <= result[f"p90_{m}_ms"] <= result[f"p99_{m}_ms"]
        assert result[f"median_{m}_ms"] == result[f"p50_{m}_ms"]
    assert result["p99_ttft_ms"] <= result["p99_e2el_ms"]
    assert all(len(itl) <= 5 for itl in result["itls"])
    assert result["request_goodput"] == 0.0                   # no request has a TTFT of 0 ms
    saved = json.loads((tmp_path / "run.json").read_text())
    assert UPSTREAM_SERVE_KEYS | PERCENTILE_KEYS <= set(saved)
    assert saved["policy"] == "none" and saved["request_rate"] == "inf"
    assert saved["total_output_tokens"] == 36 and saved["max_concurrency"] == 3


def test_bench_serve_goodput_rate_and_extra_body(server, tiny_llama, tmp_path):
    result = _bench_serve(server, tiny_llama, "--request-rate", "20", "--burstiness", "inf",
                          "--goodput", "ttft:1e9", "tpot:1e9", "e2el:1e9", "--save-result",
                          "--result-dir", str(tmp_path))
    assert result["completed"] == 6 and result["total_output_tokens"] == 36
    assert result["request_goodput"] == result["request_throughput"] > 0
    assert result["duration"] >= 5 / 20                       # the last one is sent at 0.25 s
    assert "ttfts" not in result                              # per request: --save-detailed
    assert not any("e2el" in key for key in result)           # default: ttft,tpot,itl
    [path] = tmp_path.iterdir()
    assert path.name.startswith("openai-20.0qps-") and path.name.endswith(".json")
    # --extra-body reaches the server: an eviction policy it does not know fails every request
    bad = _bench_serve(server, tiny_llama, "--extra-body", '{"kv_eviction_policy": "bogus"}')
    assert (bad["completed"], bad["failed"], bad["total_output_tokens"]) == (0, 6, 0)


def test_bench_throughput_and_latency_write_their_json(tiny_llama, tmp_path):
    out = tmp_path / "throughput.json"
    args = _parse("bench", "throughput", "--model", tiny_llama, "--input-len", "16",
                  "--output-len", "8", "--num-prompts", "5", "--output-json", str(out),
                  "--num-gpu-blocks-override", "64", "--kv-eviction-policy", "h2o",
                  "--kv-budget-tokens", "12", "--kv-min-tokens", "0")
    result = args.func(args)
    saved = json.loads(out.read_text())
    assert {"elapsed_time", "num_requests", "total_num_tokens", "requests_per_second",
            "tokens_per_second"} <= set(saved)
    assert saved["num_requests"] == 5 and saved["total_output_tokens"] == 40
    assert saved["total_num_tokens"] == 40 + 5 * 16
    assert saved["tokens_per_second"] == pytest.approx(saved["total_num_tokens"]
                                                       / saved["elapsed_time"])
    assert result["kv_stats"]["evicted_tokens"] > 0            # the eviction flags took effect
    out = tmp_path / "latency.json"
    args = _parse("bench", "latency", "--model", tiny_llama, "--input-len", "8", "--output-len",
                  "4", "--batch-size", "2", "--num-iters-warmup", "1", "--num-iters", "3",
                  "--output-json", str(out), "--num-gpu-blocks-override", "64")
    args.func(args)
    saved = json.loads(out.read_text())
    assert len(saved["latencies"]) == 3 and saved["avg_latency"] == \
        pytest.approx(np.mean(saved["latencies"]))
    p = saved["percentiles"]
    assert list(p) == ["10", "25", "50", "75", "90", "99"]
    assert min(saved["latencies"]) <= p["10"] <= p["50"] <= p["99"] <= max(saved["latencies"])


def _benchmark_serving():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import benchmark_serving
    return benchmark_serving


def test_benchmark_serving_scans_through_bench_serve(server):
    """benchmarks/benchmark_serving.py's closed-loop and Poisson points run on `vllm bench
    serve`'s client and metrics; the SLA point is chosen from them."""
    bench = _benchmark_serving()
    work = [(list(range(5, 5 + n)), 4) for n in (8, 12, 16)]
    args = type("Args", (), {"per_client": 2, "num_prompts": 5, "seed": 0})
    rows = bench.scan(server.url, "tiny", work, [{"C": 1}, {"C": 3}, {"rate": 50.0}], args,
                      lambda _: None)
    assert [r["requests"] for r in rows] == [4, 6, 5]
    assert [next(iter(r)) for r in rows] == ["C", "C", "rate"]
    for r in rows:
        assert r["tok_s"] > 0 and 0 < r["p50_s"] <= r["p95_s"] and r["ttft_p95_s"] <= r["p95_s"]
    scans = {"Naive-Evict": [{"C": 1, "tok_s": 10.0, "p95_s": 1.0},
                             {"C": 2, "tok_s": 15.0, "p95_s": 2.0}],
             "vToken": [{"C": 1, "tok_s": 11.0, "p95_s": 0.9},
                        {"C": 2, "tok_s": 30.0, "p95_s": 2.05},
                        {"C": 4, "tok_s": 40.0, "p95_s": 2.2}]}
    sla, _, summary = bench.select(scans, "C", 2)
    assert sla == pytest.approx(2.1)
    assert [(s["C_sel"], s["vs_naive"]) for s in summary] == [(2, 1.0), (2, 2.0)]


def test_benchmark_serving_starts_each_server_once_and_rotates_the_scans(monkeypatch):
    """--repeats N: every variant's server starts once and serves one warm-up round per policy
    (Native one), then each scan runs every variant's point before the next point, the
    variants' order rotated per point and per repeat (each variant first once in three);
    --policy A B: A's scans, then B's on the same servers, each request naming its policy
    (Native's none); the servers stop after the last scan; --variants picks the servers."""
    bench = _benchmark_serving()
    events, names = [], {}

    class FakeServer:
        def __init__(self, flags, threads):
            kind = flags[flags.index("--kv-reclamation") + 1] if "--kv-reclamation" in flags \
                else "native"
            self.name = {"none": "Naive-Evict", "vtoken": "vToken", "native": "Native"}[kind]
            self.url, self.model = f"http://{self.name}", "m"
            names[self.url] = self.name

        def __enter__(self):
            events.append(("start", self.name))
            return self

        def __exit__(self, *exc):
            events.append(("stop", self.name))

    def policy(body):
        return body.get("kv_eviction_policy", "none")

    monkeypatch.setattr(bench, "Server", FakeServer)
    monkeypatch.setattr(bench, "run_point", lambda url, model, work, n, concurrency=None,
                        body=None, **kw: events.append(
                            ("warm", names[url], n, concurrency, policy(body))))
    monkeypatch.setattr(bench, "scan", lambda url, model, work, points, args, log, body:
                        events.append(("scan", names[url], points[0]["C"], policy(body)))
                        or [dict(points[0])])
    args = type("Args", (), {"policy": ["h2o", "random"], "ratio": 0.5, "threads": 1,
                             "repeats": 3, "seed": 0, "variants": list(bench.VARIANTS)})
    out = bench.variant_scans(args, None, [], [{"C": 2}, {"C": 4}], 22, 4)
    n, v, native = "Naive-Evict", "vToken", "Native"
    assert events[:3] == [("start", n), ("start", v), ("start", native)]
    assert events[3:8] == [("warm", x, 4, 4, p) for x, ps in
                           ((n, ("h2o", "random")), (v, ("h2o", "random")),
                            (native, ("none",))) for p in ps]
    rotation = [(n, 2), (v, 2), (native, 2), (v, 4), (native, 4), (n, 4),           # repeat 1
                (v, 2), (native, 2), (n, 2), (native, 4), (n, 4), (v, 4),           # repeat 2
                (native, 2), (n, 2), (v, 2), (n, 4), (v, 4), (native, 4)]           # repeat 3
    for k, p in enumerate(("h2o", "random")):
        assert [e[1:] for e in events[8 + 18 * k:26 + 18 * k]] == [
            (x, c, "none" if x == native else p) for x, c in rotation]
    assert sorted(events[44:]) == sorted(("stop", x) for x in (n, v, native))
    assert list(out) == ["h2o", "random"]
    for runs in out.values():
        assert len(runs) == 3 and all(list(r) == [n, v, native] for r in runs)
        assert all(r[x] == [{"C": 2}, {"C": 4}] for r in runs for x in r)  # rows in point order
    args.variants, args.repeats, args.policy, events[:] = [v, n], 1, ["h2o"], []
    runs = bench.variant_scans(args, None, [], [{"C": 2}], 22, 2)["h2o"]
    assert [e for e in events if e[0] == "start"] == [("start", n), ("start", v)]
    assert list(runs[0]) == [n, v]
