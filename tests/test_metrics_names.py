"""/metrics carries upstream vLLM's current Prometheus metrics (vllm/v1/metrics/loggers.py):
the same names, types and labels (model_name, engine), with values that add up, beside ours."""
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_utils import serve, wait_until_clean

BLOCK = 4
PROMPT = " ".join(f"w{i}" for i in range(10, 22))     # 12 tokens: 2 full blocks can be reused
REQUESTS = [dict(prompt=PROMPT, max_tokens=5, n=1),   # (the same prompt twice: cache hits)
            dict(prompt=PROMPT, max_tokens=3, n=1),
            dict(prompt="w5 w6 w7", max_tokens=4, n=2)]

UPSTREAM = {   # family name -> type (counters drop the _total suffix in the parsed family)
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter", "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter", "vllm:iteration_tokens_total": "histogram",
    "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram", "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram", "vllm:cache_config_info": "gauge",
}
OURS = ("vllm:kv_live_tokens", "vllm:kv_memory_utilization", "vllm:kv_relocation_events",
        "vllm:kv_evicted_tokens")


@pytest.fixture(scope="module")
def scraped(tiny_llama):
    """Metrics after REQUESTS ran one after another on a prefix-caching server."""
    engine, srv = serve(tiny_llama, enable_prefix_caching=True, block_size=BLOCK,
                        num_gpu_blocks_override=128)
    with srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        ids = {r["prompt"]: httpx.post(srv.url + "/tokenize", json={"prompt": r["prompt"]}
                                       ).json()["tokens"] for r in REQUESTS}
        for r in REQUESTS:
            client.completions.create(model="tiny", temperature=0.8,
                                      extra_body={"ignore_eos": True}, **r)
        wait_until_clean(engine)
        text = httpx.get(srv.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in families.values() for s in f.samples}
    return families, samples, ids


def value(samples, name, **labels):
    labels = {"model_name": "tiny", "engine": "0", **labels}
    return samples[(name, tuple(sorted(labels.items())))]


def test_upstream_names_types_and_labels(scraped):
    families, _, _ = scraped
    for name, kind in UPSTREAM.items():
        assert name in families, name
        assert families[name].type == kind, (name, families[name].type)
        for s in families[name].samples:
            want = {"engine"} if name == "vllm:cache_config_info" else {"model_name", "engine"}
            assert want <= set(s.labels), (name, s.labels)
    for name in OURS:                  # ours stay beside them
        assert name in families, name


def test_values_add_up(scraped):
    _, samples, ids = scraped
    prompt_tokens = sum(len(ids[r["prompt"]]) for r in REQUESTS)
    generated = sum(r["max_tokens"] * r["n"] for r in REQUESTS)
    k = len(REQUESTS)
    assert value(samples, "vllm:prompt_tokens_total") == prompt_tokens
    assert value(samples, "vllm:generation_tokens_total") == generated
    assert value(samples, "vllm:request_success_total", finished_reason="length") == k
    assert value(samples, "vllm:request_success_total", finished_reason="stop") == 0
    assert value(samples, "vllm:request_prompt_tokens_sum") == prompt_tokens
    assert value(samples, "vllm:request_generation_tokens_sum") == generated
    assert value(samples, "vllm:request_params_n_count") == k
    assert value(samples, "vllm:request_params_n_sum") == sum(r["n"] for r in REQUESTS)
    # every token was counted in some step
    assert value(samples, "vllm:iteration_tokens_total_sum") == prompt_tokens + generated
    for phase in ("queue", "prefill", "decode", "inference"):
        assert value(samples, f"vllm:request_{phase}_time_seconds_count") == k
    inference = value(samples, "vllm:request_inference_time_seconds_sum")
    split = value(samples, "vllm:request_prefill_time_seconds_sum") + \
        value(samples, "vllm:request_decode_time_seconds_sum")
    assert inference == pytest.approx(split, rel=1e-6, abs=1e-6)
    assert value(samples, "vllm:e2e_request_latency_seconds_sum") >= inference


def test_prefix_cache_counters_in_tokens(scraped):
    _, samples, ids = scraped
    n = len(ids[PROMPT])
    # every admission (each of n samples) queries its prompt; the repeat finds its full
    # blocks except the one holding the last prompt token, which is always computed
    assert value(samples, "vllm:prefix_cache_queries_total") == \
        sum(len(ids[r["prompt"]]) * r["n"] for r in REQUESTS)
    assert value(samples, "vllm:prefix_cache_hits_total") == (n - 1) // BLOCK * BLOCK


def test_cache_config_info(scraped):
    families, _, _ = scraped
    (info,) = families["vllm:cache_config_info"].samples
    assert info.value == 1.0
    assert info.labels["block_size"] == str(BLOCK) and info.labels["engine"] == "0"
    assert info.labels["enable_prefix_caching"] == "True"
    assert info.labels["num_gpu_blocks"] == "128"
