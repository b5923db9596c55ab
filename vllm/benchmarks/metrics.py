"""What a serving run measured: upstream's BenchmarkMetrics and its result keys.

Per successful request: TTFT, ITL (every gap between token chunks), E2EL and
TPOT = (E2EL - TTFT) / (output tokens - 1) (requests of one token have no TPOT). Output tokens
are the server's usage count. Goodput = requests/s that meet every SLO given (--goodput
ttft:MS tpot:MS e2el:MS; a one-token request's TPOT counts as 0 there).
"""
import argparse
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput

MS_PER_S = 1000.0
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    mean_ttft_ms: float
    median_ttft_ms: float
    std_ttft_ms: float
    percentiles_ttft_ms: List[Tuple[float, float]]
    mean_tpot_ms: float
    median_tpot_ms: float
    std_tpot_ms: float
    percentiles_tpot_ms: List[Tuple[float, float]]
    mean_itl_ms: float
    median_itl_ms: float
    std_itl_ms: float
    percentiles_itl_ms: List[Tuple[float, float]]
    mean_e2el_ms: float
    median_e2el_ms: float
    std_e2el_ms: float
    percentiles_e2el_ms: List[Tuple[float, float]]
    max_output_tokens_per_s: float      # the busiest one-second bucket of token chunks
    max_concurrent_requests: int        # the most requests in flight at once

    def percentile_ms(self, metric: str, p: float) -> float:
        return dict(getattr(self, f"percentiles_{metric}_ms"))[p]


def percentile_word(p: float) -> str:
    """99 -> "99", 99.9 -> "99.9" (the pNN_ of the result keys)."""
    return str(int(p)) if int(p) == p else str(p)


def _stats(name: str, seconds: Sequence[float], percentiles: Sequence[float]) -> Dict:
    ms = np.asarray(seconds if len(seconds) else [0.0], dtype=float) * MS_PER_S
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"std_{name}_ms": float(ms.std()),
            f"percentiles_{name}_ms": [(p, float(np.percentile(ms, p))) for p in percentiles]}


def _peaks(outputs: Sequence[RequestFuncOutput]) -> Tuple[float, int]:
    """(most token chunks in a one-second bucket from the first send, most requests in flight)."""
    if not outputs:
        return 0.0, 0
    t0 = min(o.start_time for o in outputs)
    buckets: Dict[int, int] = {}
    events = []
    for o in outputs:
        token_times = o.start_time + o.ttft + np.concatenate([[0.0], np.cumsum(o.itl)])
        for b in ((token_times - t0).astype(int)).tolist():
            buckets[b] = buckets.get(b, 0) + 1
        events += [(o.start_time, 1), (o.start_time + o.latency, -1)]
    in_flight = peak = 0
    for _, step in sorted(events):          # at a tie an end (-1) comes before a start
        in_flight += step
        peak = max(peak, in_flight)
    return float(max(buckets.values())), peak


def _meets_slos(goodput: Dict[str, float], ttft: float, tpot: float, e2el: float) -> bool:
    got = {"ttft": ttft, "tpot": tpot, "e2el": e2el}
    return all(got[name] <= slo_ms / MS_PER_S for name, slo_ms in goodput.items())


def calculate_metrics(outputs: Sequence[RequestFuncOutput], dur_s: float,
                      selected_percentiles: Sequence[float],
                      goodput_config: Optional[Dict[str, float]] = None,
                      tokenizer=None) -> Tuple[BenchmarkMetrics, List[int]]:
    """-> (metrics, each request's output tokens, 0 for a failed one). Without a usage count
    from the server, output tokens are the tokenizer's count of the text (or chunks)."""
    lens, ttfts, tpots, itls, e2els, good = [], [], [], [], [], 0
    total_input = 0
    ok = [o for o in outputs if o.success]
    for o in outputs:
        if not o.success:
            lens.append(0)
            continue
        n = o.output_tokens or (len(tokenizer(o.generated_text, add_special_tokens=False)
                                    .input_ids) if tokenizer is not None else len(o.itl) + 1)
        lens.append(n)
        total_input += o.prompt_len
        tpot = (o.latency - o.ttft) / (n - 1) if n > 1 else 0.0
        if n > 1:
            tpots.append(tpot)
        ttfts.append(o.ttft)
        e2els.append(o.latency)
        itls += o.itl
        if goodput_config and _meets_slos(goodput_config, o.ttft, tpot, o.latency):
            good += 1
    total_output = sum(lens)
    peak_tokens, peak_requests = _peaks(ok)
    stats = {}
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        stats.update(_stats(name, values, selected_percentiles))
    return BenchmarkMetrics(
        completed=len(ok), failed=len(outputs) - len(ok), total_input=total_input,
        total_output=total_output, request_throughput=len(ok) / dur_s,
        request_goodput=good / dur_s, output_throughput=total_output / dur_s,
        total_token_throughput=(total_input + total_output) / dur_s,
        max_output_tokens_per_s=peak_tokens, max_concurrent_requests=peak_requests,
        **stats), lens


def percentile_results(metrics: BenchmarkMetrics, selected_metrics: Sequence[str]) -> Dict:
    """Upstream's result keys of the selected metrics: mean_ttft_ms, median_, std_, p99_ ..."""
    out = {}
    for name in selected_metrics:
        for kind in ("mean", "median", "std"):
            out[f"{kind}_{name}_ms"] = getattr(metrics, f"{kind}_{name}_ms")
        for p, value in getattr(metrics, f"percentiles_{name}_ms"):
            out[f"p{percentile_word(p)}_{name}_ms"] = value
    return out


def parse_goodput(pairs: Optional[Sequence[str]]) -> Dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for pair in pairs or []:
        try:
            name, value = pair.split(":")
            slos[name] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--goodput {pair!r}: give service level objectives as KEY:VALUE pairs, the "
                "key a metric name and the value in milliseconds") from None
        if name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput {pair!r}: the metric must be one of "
                             f"{list(GOODPUT_METRICS)}")
        if slos[name] < 0:
            raise ValueError(f"--goodput {pair!r}: the objective must be non-negative")
    return slos
