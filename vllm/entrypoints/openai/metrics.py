"""ServerMetrics: Prometheus metrics with upstream vLLM's names, plus vToken's KV statistics.

Latency histograms and token counters are fed once per engine step (AsyncLLMEngine's
StepStats); gauges and engine counters are read from the engine's last snapshot at scrape time.
Each app owns its registry, so several servers can live in one process (tests).
"""
from typing import Dict

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from vllm.engine.async_llm_engine import AsyncLLMEngine, StepStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0)

# snapshot key -> (metric name, help); gauges, then monotonically growing counters
_GAUGES = {
    "num_requests_running": ("vllm:num_requests_running", "Requests in the running batch."),
    "num_requests_waiting": ("vllm:num_requests_waiting", "Requests waiting to be scheduled."),
    "kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)."),
    "live_tokens": ("vllm:kv_live_tokens", "Live (not evicted) KV tokens of running requests."),
    "memory_utilization": ("vllm:kv_memory_utilization",
                           "Live KV tokens / slots of the blocks in use (0-1)."),
    "mean_memory_utilization": ("vllm:kv_mean_memory_utilization",
                                "Mean of kv_memory_utilization over engine steps."),
    "blocks_used": ("vllm:kv_blocks_used", "KV blocks in use."),
    "blocks_total": ("vllm:kv_blocks_total", "KV blocks in the pool."),
    "blocks_peak": ("vllm:kv_blocks_peak", "Peak KV blocks in use."),
}
_COUNTERS = {
    "num_preemptions": ("vllm:num_preemptions", "Preemptions by recompute."),
    "relocation_events": ("vllm:kv_relocation_events", "vToken relocation plans applied."),
    "relocated_tokens": ("vllm:kv_relocated_tokens", "KV tokens moved by vToken relocation."),
    "bytes_moved": ("vllm:kv_relocation_bytes", "KV bytes moved by vToken relocation."),
    "blocks_reclaimed": ("vllm:kv_blocks_reclaimed", "KV blocks freed by vToken relocation."),
    "evicted_tokens": ("vllm:kv_evicted_tokens", "KV tokens evicted by the eviction policy."),
    "translation_rebuilds": ("vllm:kv_translation_rebuilds",
                             "Rebuilds of the token-table translation cache."),
    "step_errors": ("vllm:engine_step_errors", "Engine steps that raised (requests aborted)."),
}


class _EngineCollector:
    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        snap: Dict[str, float] = dict(self.engine.snapshot)
        total = snap.get("num_blocks") or 1
        snap["kv_cache_usage_perc"] = 1.0 - snap.get("num_free_blocks", total) / total
        snap["step_errors"] = self.engine.num_step_errors
        for key, (name, doc) in _GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model_name], float(snap.get(key, 0)))
            yield g
        for key, (name, doc) in _COUNTERS.items():
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model_name], float(snap.get(key, 0)))
            yield c


class ServerMetrics:
    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.registry = CollectorRegistry()
        reg, label = self.registry, [model_name]

        def hist(name, doc, buckets):
            return Histogram(name, doc, ["model_name"], buckets=buckets,
                             registry=reg).labels(*label)

        def counter(name, doc):
            return Counter(name, doc, ["model_name"], registry=reg).labels(*label)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.",
                         _LATENCY_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between output tokens.",
                        _LATENCY_BUCKETS)
        self.tpot = hist("vllm:time_per_output_token_seconds",
                         "Time per output token (same samples as inter_token_latency).",
                         _LATENCY_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                        _E2E_BUCKETS)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=reg)
        self.model_name = model_name
        self.registry.register(_EngineCollector(engine, model_name))
        engine.add_stat_listener(self.on_step)

    def on_step(self, stats: StepStats) -> None:
        for x in stats.ttft:
            self.ttft.observe(x)
        for x in stats.itl:
            self.itl.observe(x)
            self.tpot.observe(x)
        for latency, reason in stats.finished:
            self.e2e.observe(latency)
            self.success.labels(self.model_name, reason).inc()
        if stats.prompt_tokens:
            self.prompt_tokens.inc(stats.prompt_tokens)
        if stats.generation_tokens:
            self.generation_tokens.inc(stats.generation_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
