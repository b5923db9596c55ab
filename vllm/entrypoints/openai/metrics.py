"""ServerMetrics: Prometheus metrics with upstream vLLM's names, types and labels
(`model_name`, `engine`), plus vToken's KV statistics.

Latency histograms and token counters are fed once per engine step (AsyncLLMEngine's
StepStats); gauges and engine counters are read from the engine's last snapshot at scrape time.
Each app owns its registry, so several servers can live in one process (tests).
"""
from typing import Dict, List

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from vllm.engine.async_llm_engine import AsyncLLMEngine, StepStats

ENGINE = "0"          # one engine per server; upstream labels each metric with its index
LABELS = ["model_name", "engine"]

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)
_FINISH_REASONS = ("stop", "length", "abort")   # upstream's, always exported (from 0)

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
    "blocks_used": ("vllm:kv_blocks_used", "KV blocks in use (both groups of a hybrid model)."),
    "sliding_window_blocks": ("vllm:kv_sliding_window_blocks",
                              "KV blocks held by sliding-window layers (hybrid models)."),
    "blocks_total": ("vllm:kv_blocks_total", "KV blocks in the pool."),
    "blocks_peak": ("vllm:kv_blocks_peak", "Peak KV blocks in use."),
}
_COUNTERS = {
    "num_preemptions": ("vllm:num_preemptions", "Preemptions by recompute."),
    "prefix_cache_queries": ("vllm:prefix_cache_queries",
                             "Prefix cache queries, in queried tokens."),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "Prefix cache hits, in cached tokens."),
    "relocation_events": ("vllm:kv_relocation_events", "vToken relocation plans applied."),
    "relocated_tokens": ("vllm:kv_relocated_tokens", "KV tokens moved by vToken relocation."),
    "bytes_moved": ("vllm:kv_relocation_bytes", "KV bytes moved by vToken relocation."),
    "blocks_reclaimed": ("vllm:kv_blocks_reclaimed", "KV blocks freed by vToken relocation."),
    "evicted_tokens": ("vllm:kv_evicted_tokens", "KV tokens evicted by the eviction policy."),
    "translation_rebuilds": ("vllm:kv_translation_rebuilds",
                             "Rebuilds of the token-table translation cache."),
    "step_errors": ("vllm:engine_step_errors", "Engine steps that raised (requests aborted)."),
}


def buckets_1_2_5(max_value: int) -> List[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (upstream's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class _EngineCollector:
    """Scrape-time metrics: gauges and counters from the engine's last snapshot, and
    vllm:cache_config_info (a gauge fixed at 1 whose labels are the cache config)."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.engine = engine
        self.labels = [model_name, ENGINE]
        cc = engine.engine.cache_config
        self.cache_info = {"block_size": cc.block_size,
                           "num_gpu_blocks": engine.engine.kv.num_blocks,
                           "num_gpu_blocks_override": cc.num_gpu_blocks_override,
                           "kv_cache_memory": cc.kv_cache_memory,
                           "enable_prefix_caching": cc.enable_prefix_caching,
                           "gpu_memory_utilization": cc.gpu_memory_utilization,
                           "engine": ENGINE}

    def collect(self):
        snap: Dict[str, float] = dict(self.engine.snapshot)
        total = snap.get("num_blocks") or 1
        snap["kv_cache_usage_perc"] = 1.0 - snap.get("num_free_blocks", total) / total
        snap["step_errors"] = self.engine.num_step_errors
        for key, (name, doc) in _GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(self.labels, float(snap.get(key, 0)))
            yield g
        for key, (name, doc) in _COUNTERS.items():
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(self.labels, float(snap.get(key, 0)))
            yield c
        info = GaugeMetricFamily("vllm:cache_config_info",
                                 "Information of the LLMEngine CacheConfig",
                                 labels=list(self.cache_info))
        info.add_metric([str(v) for v in self.cache_info.values()], 1.0)
        yield info


class ServerMetrics:
    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.registry = CollectorRegistry()
        reg, label = self.registry, [model_name, ENGINE]
        token_buckets = buckets_1_2_5(engine.max_model_len)

        def hist(name, doc, buckets):
            return Histogram(name, doc, LABELS, buckets=buckets, registry=reg).labels(*label)

        def counter(name, doc):
            return Counter(name, doc, LABELS, registry=reg).labels(*label)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.",
                         _TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between output tokens.",
                        _ITL_BUCKETS)
        self.tpot = hist("vllm:time_per_output_token_seconds",
                         "Time per output token (same samples as inter_token_latency).",
                         _ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                        _REQUEST_BUCKETS)
        self.queue_time = hist("vllm:request_queue_time_seconds",
                               "Time a request waited before its first admission.",
                               _REQUEST_BUCKETS)
        self.prefill_time = hist("vllm:request_prefill_time_seconds",
                                 "Time from first admission to first token.", _REQUEST_BUCKETS)
        self.decode_time = hist("vllm:request_decode_time_seconds",
                                "Time from first token to the last.", _REQUEST_BUCKETS)
        self.inference_time = hist("vllm:request_inference_time_seconds",
                                   "Time from first admission to the last token.",
                                   _REQUEST_BUCKETS)
        self.request_prompt_tokens = hist("vllm:request_prompt_tokens",
                                          "Prompt tokens of each finished request.",
                                          token_buckets)
        self.request_generation_tokens = hist("vllm:request_generation_tokens",
                                              "Generated tokens of each finished request.",
                                              token_buckets)
        self.params_n = hist("vllm:request_params_n", "The n request parameter.", _N_BUCKETS)
        self.iteration_tokens = hist("vllm:iteration_tokens_total",
                                     "Tokens (prefilled prompts + generated) per engine step.",
                                     _ITERATION_BUCKETS)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               LABELS + ["finished_reason"], registry=reg)
        for reason in _FINISH_REASONS:
            self.success.labels(model_name, ENGINE, reason)
        self.model_name = model_name
        self.registry.register(_EngineCollector(engine, model_name))
        engine.add_stat_listener(self.on_step)

    def on_step(self, stats: StepStats) -> None:
        for x in stats.ttft:
            self.ttft.observe(x)
        for x in stats.itl:
            self.itl.observe(x)
            self.tpot.observe(x)
        for n in stats.n_params:
            self.params_n.observe(n)
        for r in stats.finished_requests:
            self.e2e.observe(r.e2e)
            self.queue_time.observe(r.queued)
            self.prefill_time.observe(r.prefill)
            self.decode_time.observe(r.decode)
            self.inference_time.observe(r.inference)
            self.request_prompt_tokens.observe(r.prompt_tokens)
            self.request_generation_tokens.observe(r.generation_tokens)
            self.success.labels(self.model_name, ENGINE, r.reason).inc()
        if stats.prompt_tokens:
            self.prompt_tokens.inc(stats.prompt_tokens)
        if stats.generation_tokens:
            self.generation_tokens.inc(stats.generation_tokens)
        if stats.prompt_tokens or stats.generation_tokens:
            self.iteration_tokens.observe(stats.prompt_tokens + stats.generation_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
