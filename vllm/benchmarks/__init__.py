"""`vllm bench serve | throughput | latency`: upstream's benchmark commands and flags.

datasets     the workloads (random, ShareGPT, LongBench-style) as SampleRequests, and the token-id
             workloads the scripts under benchmarks/ use
arrivals     when each request of an open-loop run is sent (Poisson, gamma, constant rate)
lib/endpoint_request_func   one streaming request to an OpenAI-compatible server, timed
metrics      TTFT / TPOT / ITL / E2EL statistics, throughput and goodput of a run
serve        the online benchmark against a running server
throughput   the offline engine on a batch of requests
latency      the offline engine on one batch, repeated
"""
