"""Benchmark online serving: `vllm bench serve` against a running OpenAI-compatible server.

    vllm serve MODEL --kv-eviction-policy h2o --kv-eviction-ratio 0.5
    vllm bench serve --model MODEL --dataset-name random --random-input-len 512 \\
        --random-output-len 128 --num-prompts 200 --request-rate 4 --max-concurrency 16 \\
        --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \\
        --goodput ttft:500 tpot:50 --save-result --extra-body '{"kv_eviction_ratio": 0.3}'

Requests stream; each is sent at its arrival time (--request-rate, --burstiness: see
vllm/benchmarks/arrivals.py) and --max-concurrency caps how many are in flight (a closed loop
when the rate is inf).
"""
import argparse
import asyncio
import contextlib
import json
import math
import os
import time
import uuid
from datetime import datetime
from typing import Any, Dict, List, Optional, Sequence, Tuple

import httpx
import numpy as np

from vllm.benchmarks.arrivals import arrival_times, get_request
from vllm.benchmarks.datasets import SampleRequest, add_dataset_parser, get_samples
from vllm.benchmarks.lib.endpoint_request_func import (ASYNC_REQUEST_FUNCS, RequestFunc,
                                                        RequestFuncInput, RequestFuncOutput)
from vllm.benchmarks.metrics import (PERCENTILE_METRICS, BenchmarkMetrics, calculate_metrics,
                                     parse_goodput, percentile_results, percentile_word)

DEFAULT_ENDPOINTS = {"openai": "/v1/completions", "vllm": "/v1/completions",
                     "openai-chat": "/v1/chat/completions"}
SAMPLING_FLAGS = ("top_p", "top_k", "min_p", "temperature", "frequency_penalty",
                  "presence_penalty", "repetition_penalty")
# per-request lists upstream keeps out of the result file unless --save-detailed
DETAILED_FIELDS = ("input_lens", "output_lens", "start_times", "ttfts", "itls",
                   "generated_texts", "errors")


async def _wait_ready(request_func: RequestFunc, test: RequestFuncInput,
                      client: httpx.AsyncClient, timeout_s: float) -> None:
    """Send `test` until it succeeds (the server may still be loading)."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = await request_func(test, client)
        if out.success:
            return
        if time.monotonic() > deadline:
            raise ValueError(f"Initial test run failed: {out.error}")
        await asyncio.sleep(1)


async def benchmark(request_func: RequestFunc, api_url: str, model_id: str,
                    model_name: Optional[str], input_requests: Sequence[SampleRequest], *,
                    request_rate: float = math.inf, burstiness: float = 1.0,
                    max_concurrency: Optional[int] = None, ignore_eos: bool = False,
                    extra_body: Optional[Dict] = None, extra_headers: Optional[Dict] = None,
                    logprobs: Optional[int] = None, seed: int = 0, request_id_prefix: str = "",
                    num_warmups: int = 0, ready_check_timeout_sec: float = 0,
                    disable_tqdm: bool = True,
                    verify: bool = True) -> Tuple[List[RequestFuncOutput], float]:
    """Send every request at its arrival time, at most max_concurrency in flight.
    -> (one output per request, in order; seconds from the first send to the last answer)."""
    def request_input(req: SampleRequest, request_id: Optional[str] = None) -> RequestFuncInput:
        return RequestFuncInput(prompt=req.prompt, api_url=api_url, prompt_len=req.prompt_len,
                                output_len=req.expected_output_len, model=model_id,
                                model_name=model_name, logprobs=logprobs,
                                extra_headers=extra_headers, extra_body=extra_body,
                                ignore_eos=ignore_eos, request_id=request_id)

    times = arrival_times(len(input_requests), request_rate, burstiness,
                          np.random.default_rng(seed))
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    bar = None
    if not disable_tqdm:
        from tqdm import tqdm
        bar = tqdm(total=len(input_requests))

    async def limited(client: httpx.AsyncClient, inp: RequestFuncInput) -> RequestFuncOutput:
        async with limit:
            out = await request_func(inp, client)
        if bar is not None:
            bar.update(1)
        return out

    pool = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(6 * 3600.0), limits=pool,
                                 verify=verify) as client:
        test = request_input(input_requests[0])
        if ready_check_timeout_sec > 0:
            await _wait_ready(request_func, test, client, ready_check_timeout_sec)
        if num_warmups > 0:
            async def warmup() -> RequestFuncOutput:
                async with limit:
                    return await request_func(test, client)
            await asyncio.gather(*(warmup() for _ in range(num_warmups)))
        start = time.perf_counter()
        tasks = []
        async for i, req in get_request(list(enumerate(input_requests)), times):
            inp = request_input(req, f"{request_id_prefix}{i}")
            tasks.append(asyncio.create_task(limited(client, inp)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return list(outputs), duration


def result_dict(metrics: BenchmarkMetrics, output_lens: List[int],
                outputs: Sequence[RequestFuncOutput], duration: float, goodput: Dict,
                selected_metrics: Sequence[str]) -> Dict[str, Any]:
    """A run's results under upstream's keys."""
    return {
        "duration": duration, "completed": metrics.completed, "failed": metrics.failed,
        "total_input_tokens": metrics.total_input, "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput if goodput else None,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "input_lens": [o.prompt_len for o in outputs], "output_lens": output_lens,
        "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "start_times": [o.start_time for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
        **percentile_results(metrics, selected_metrics)}


HEADERS = {"ttft": ("TTFT", "Time to First Token"),
           "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
           "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}


def print_result(result: Dict[str, Any], selected_metrics: Sequence[str],
                 percentiles: Sequence[float], max_concurrency: Optional[int],
                 request_rate: float) -> None:
    line = "{:<40} {:<10}".format
    num = "{:<40} {:<10.2f}".format
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    print(line("Successful requests:", result["completed"]))
    print(line("Failed requests:", result["failed"]))
    if max_concurrency is not None:
        print(line("Maximum request concurrency:", max_concurrency))
    if not math.isinf(request_rate):
        print(num("Request rate configured (RPS):", request_rate))
    print(num("Benchmark duration (s):", result["duration"]))
    print(line("Total input tokens:", result["total_input_tokens"]))
    print(line("Total generated tokens:", result["total_output_tokens"]))
    print(num("Request throughput (req/s):", result["request_throughput"]))
    if result["request_goodput"] is not None:
        print(num("Request goodput (req/s):", result["request_goodput"]))
    print(num("Output token throughput (tok/s):", result["output_throughput"]))
    print(num("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"]))
    print(num("Peak concurrent requests:", result["max_concurrent_requests"]))
    print(num("Total token throughput (tok/s):", result["total_token_throughput"]))
    for name in selected_metrics:
        short, header = HEADERS[name]
        print("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        print(num(f"Mean {short} (ms):", result[f"mean_{name}_ms"]))
        print(num(f"Median {short} (ms):", result[f"median_{name}_ms"]))
        for p in percentiles:
            word = percentile_word(p)
            print(num(f"P{word} {short} (ms):", result[f"p{word}_{name}_ms"]))
    print("=" * 50)


# ---- the command ------------------------------------------------------------------------------
def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_dataset_parser(parser)
    add = parser.add_argument
    add("--label", type=str, default=None,
        help="Prefix of the result file name (default: the backend).")
    add("--backend", type=str, default="openai", choices=list(ASYNC_REQUEST_FUNCS),
        help="openai / vllm: the completions API; openai-chat: the chat completions API.")
    add("--base-url", type=str, default=None,
        help="Server or API base URL, instead of --host and --port.")
    add("--host", type=str, default="127.0.0.1")
    add("--port", type=int, default=8000)
    add("--endpoint", type=str, default=None,
        help="API endpoint (default: /v1/completions, or /v1/chat/completions for openai-chat).")
    add("--header", metavar="KEY=VALUE", nargs="*",
        help="Headers sent with every request, e.g. --header x-additional-info=0.3.3.")
    add("--max-concurrency", type=int, default=None,
        help="At most this many requests in flight; a request that arrives while the cap is "
             "reached waits for one to finish (a closed loop when --request-rate is inf).")
    add("--model", type=str, default=None,
        help="Model (local path or name; its tokenizer counts prompt tokens). Default: the "
             "first model the server's /v1/models lists.")
    add("--served-model-name", type=str, default=None,
        help="The model name used in the API (default: --model).")
    add("--tokenizer", type=str, default=None,
        help="Tokenizer (local model directory or .gguf), if not the model's.")
    add("--input-len", type=int, default=None,
        help="General input length: sets --random-input-len.")
    add("--output-len", type=int, default=None,
        help="General output length: sets --random-output-len, --sharegpt-output-len and "
             "--longbench-output-len.")
    add("--logprobs", type=int, default=None, help="Logprobs per token to request.")
    add("--request-rate", type=float, default=math.inf,
        help="Requests per second. inf (the default) sends every request at time 0; otherwise "
             "inter-arrival gaps follow --burstiness (a Poisson process by default).")
    add("--burstiness", type=float, default=1.0,
        help="Shape of the gamma-distributed inter-arrival gaps (mean 1 / --request-rate): 1 is "
             "a Poisson process, below 1 burstier, above 1 more uniform, inf constant-rate "
             "arrivals (exactly 1 / --request-rate apart). Only with a finite --request-rate.")
    add("--disable-tqdm", action="store_true", help="No progress bar.")
    add("--num-warmups", type=int, default=0, help="Warm-up requests before the run.")
    add("--ready-check-timeout-sec", type=int, default=0,
        help="Retry a test request until the server answers, up to this many seconds "
             "(0: no check).")
    add("--save-result", action="store_true", help="Save the results to a JSON file.")
    add("--save-detailed", action="store_true",
        help="Also save per-request data (lengths, TTFTs, ITLs, texts, errors).")
    add("--append-result", action="store_true",
        help="Append the results, as one more JSON line, to the result file.")
    add("--metadata", metavar="KEY=VALUE", nargs="*",
        help="Key-value pairs saved with the results (e.g. --metadata version=0.3.3 tp=1).")
    add("--result-dir", type=str, default=None,
        help="Directory of the result file (default: the current one).")
    add("--result-filename", type=str, default=None,
        help="Result file name (default: {label}-{request_rate}qps[-concurrency{N}]-"
             "{model}-{date}.json).")
    add("--ignore-eos", action="store_true",
        help="Generate until max tokens (always on for the random dataset).")
    add("--percentile-metrics", type=str, default=None,
        help=f"Comma-separated metrics to report statistics of, from {list(PERCENTILE_METRICS)} "
             "(default: ttft,tpot,itl).")
    add("--metric-percentiles", type=str, default="99",
        help="Comma-separated percentiles of those metrics, e.g. 50,90,99 (default: 99).")
    add("--goodput", nargs="+", default=None,
        help="Service level objectives as KEY:VALUE pairs in milliseconds, KEY one of ttft, "
             "tpot, e2el; goodput is the rate of requests that meet all of them.")
    add("--request-id-prefix", type=str, default=f"bench-{uuid.uuid4().hex[:8]}-",
        help="Prefix of the x-request-id of each request.")
    sampling = parser.add_argument_group("sampling parameters")
    for flag in SAMPLING_FLAGS:
        sampling.add_argument("--" + flag.replace("_", "-"), type=int if flag == "top_k" else float,
                              default=None, help="Sent with every request (default: the "
                                                 "server's).")
    add("--extra-body", type=json.loads, default=None,
        help="JSON object merged into every request body, e.g. '{\"kv_eviction_policy\": "
             "\"h2o\", \"kv_eviction_ratio\": 0.5}'.")
    add("--insecure", action="store_true", help="Do not verify TLS certificates.")


def _key_values(items: Optional[Sequence[str]], flag: str) -> Dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{flag} {item!r}: use KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


async def _first_model(base_url: str, headers: Dict[str, str], verify: bool) -> Tuple[str, str]:
    """(id, root) of the first model the server lists."""
    async with httpx.AsyncClient(verify=verify, timeout=60) as client:
        r = await client.get(f"{base_url}/v1/models", headers=headers)
        r.raise_for_status()
        data = r.json().get("data") or []
    if not data:
        raise ValueError(f"No models found on the server at {base_url}.")
    return data[0]["id"], data[0].get("root") or data[0]["id"]


def load_tokenizer(name: Optional[str]):
    """A local model directory's or .gguf file's tokenizer (None: the default model's)."""
    from transformers import AutoTokenizer

    from vllm.model_executor.gguf_loader import resolve_model
    try:
        path = resolve_model(name)
    except ValueError as e:
        raise ValueError(f"no tokenizer at {name!r}: give --tokenizer (or --model) as a local "
                         f"model directory or .gguf file ({e})") from None
    return AutoTokenizer.from_pretrained(path)


def result_filename(args: argparse.Namespace, model_id: str, label: str,
                    date: str) -> Optional[str]:
    if not (args.save_result or args.append_result):
        return None
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    model = model_id.rstrip("/").split("/")[-1]
    name = args.result_filename or \
        f"{label}-{args.request_rate}qps{concurrency}-{model}-{date}.json"
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name


def _apply_general_lengths(args: argparse.Namespace) -> None:
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.sharegpt_output_len = args.output_len
        args.longbench_output_len = args.output_len
    if args.dataset_name == "random":        # upstream: random prompts run to their length
        args.ignore_eos = True


def main(args: argparse.Namespace) -> Dict[str, Any]:
    return asyncio.run(main_async(args))


async def main_async(args: argparse.Namespace) -> Dict[str, Any]:
    if args.max_concurrency is not None and args.max_concurrency <= 0:
        raise ValueError("--max-concurrency must be greater than 0")
    selected = (args.percentile_metrics or "ttft,tpot,itl").split(",")
    if set(selected) - set(PERCENTILE_METRICS):
        raise ValueError(f"--percentile-metrics: each one of {list(PERCENTILE_METRICS)}")
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    goodput = parse_goodput(args.goodput)
    metadata = _key_values(args.metadata, "--metadata")
    headers = _key_values(args.header, "--header")
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    api_url = base_url + (args.endpoint or DEFAULT_ENDPOINTS[args.backend])
    verify = not args.insecure
    if args.model is None:
        model_name, model_id = await _first_model(base_url, headers, verify)
        print(f"First model name: {model_name}, first model id: {model_id}")
    else:
        model_name, model_id = args.served_model_name, args.model
    tokenizer_id = args.tokenizer or model_id
    tokenizer = load_tokenizer(tokenizer_id)
    _apply_general_lengths(args)
    input_requests = get_samples(args, tokenizer)
    extra_body = {**{k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k) is not None},
                  **(args.extra_body or {})}
    print(f"Traffic request rate: {args.request_rate}\nBurstiness factor: {args.burstiness}"
          f"\nMaximum request concurrency: {args.max_concurrency}")
    outputs, duration = await benchmark(
        ASYNC_REQUEST_FUNCS[args.backend], api_url, model_id, model_name, input_requests,
        request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos,
        extra_body=extra_body or None, extra_headers=headers or None, logprobs=args.logprobs,
        seed=args.seed, request_id_prefix=args.request_id_prefix, num_warmups=args.num_warmups,
        ready_check_timeout_sec=args.ready_check_timeout_sec, disable_tqdm=args.disable_tqdm,
        verify=verify)
    for o in [o for o in outputs if not o.success][:10]:
        print(f"Failed request: {o.error}")
    metrics, output_lens = calculate_metrics(outputs, duration, percentiles, goodput, tokenizer)
    run = result_dict(metrics, output_lens, outputs, duration, goodput, selected)
    print_result(run, selected, percentiles, args.max_concurrency, args.request_rate)
    return save_result(args, run, model_id, tokenizer_id, metadata)


def save_result(args: argparse.Namespace, run: Dict[str, Any], model_id: str,
                tokenizer_id: str, metadata: Dict[str, str]) -> Dict[str, Any]:
    """The run's settings and results, written with --save-result / --append-result."""
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    label = args.label or args.backend
    result = {"date": date, "endpoint_type": args.backend, "backend": args.backend,
              "label": label, "model_id": model_id, "tokenizer_id": tokenizer_id,
              "num_prompts": args.num_prompts, **metadata,
              "request_rate": args.request_rate if not math.isinf(args.request_rate) else "inf",
              "burstiness": args.burstiness if not math.isinf(args.burstiness) else "inf",
              "max_concurrency": args.max_concurrency, **run}
    if not args.save_detailed:
        for name in DETAILED_FIELDS:
            result.pop(name, None)
    path = result_filename(args, model_id, label, date)
    if path:
        with open(path, "a" if args.append_result else "w", encoding="utf-8") as f:
            if args.append_result and f.tell() != 0:
                f.write("\n")
            json.dump(result, f)
        print(f"Saved the results to {path}")
    return result
