"""guidellm (PyPI guidellm==0.8.1, a dev dependency) drives this engine in-process through its
`vllm_python` backend, exactly as it drives upstream vLLM: in a worker process it spawns, it
builds `vllm.AsyncLLMEngine.from_engine_args(vllm.AsyncEngineArgs(model=..., **vllm_config))`,
checks `engine.check_health()`, and streams `engine.generate(prompt, SamplingParams(max_tokens=N,
ignore_eos=True), request_id)` for every request; `engine.shutdown()` at the end.

Load: guidellm's synthetic_text prompts of --prompt-tokens tokens (counted with the model's own
tokenizer), --output-tokens new tokens each, first at concurrency 1 (guidellm's synchronous
profile: one request at a time), then at each --concurrency level (its concurrent profile: N
streams of back-to-back requests). Every level stops after --max-requests requests (the first
--warmup of them, and those that overlap them, are left out of the figures) and starts a fresh
engine (guidellm restarts its worker per level). Nothing is downloaded (HF_HUB_OFFLINE=1).
Prints a table and writes results/guidellm.json, plus guidellm's own reports
(results/guidellm_report_<profile>.json).

    python benchmarks/benchmark_guidellm.py --quick      # default model, 2-5 min on 2 cores
    python benchmarks/benchmark_guidellm.py --concurrency 4 16 --max-requests 64
    python benchmarks/benchmark_guidellm.py --vllm-config '{"kv_eviction_policy": "h2o"}'
"""
import argparse
import asyncio
import json
import logging
import os
from typing import Dict, List, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")        # guidellm and its worker processes
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import common  # noqa: E402

COLS = ["profile", "concurrency", "requests", "errored", "measured", "req_s", "out_tok_s",
        "ttft_ms_p50", "ttft_ms_p95", "itl_ms_p50", "latency_s_p50", "latency_s_p95"]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer, shorter requests (2-5 min)")
    p.add_argument("--model", default=None,
                   help="model dir/.gguf (default: SmolLM2-135M); 'tiny': a tiny random Llama")
    p.add_argument("--concurrency", type=int, nargs="*", default=None,
                   help="concurrent-profile levels after the synchronous one (default 4 16; "
                        "--quick 4)")
    p.add_argument("--max-requests", type=int, default=None,
                   help="requests per level (default 32; --quick 8)")
    p.add_argument("--warmup", type=int, default=1,
                   help="warm-up requests per level, left out of the figures (guidellm also "
                        "drops the requests that overlap them)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="default 256; --quick 64")
    p.add_argument("--output-tokens", type=int, default=None, help="default 128; --quick 32")
    p.add_argument("--request-format", default="plain",
                   help="guidellm's: plain (the prompt as is, exact token counts), "
                        "default-template (the tokenizer's chat template), or a template")
    p.add_argument("--vllm-config", type=json.loads, default={},
                   help="JSON object of further AsyncEngineArgs fields")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="threads of the engine in guidellm's worker (OMP_NUM_THREADS; default: "
                        "all cores, or 1 when other work loads the host)")
    p.add_argument("--out", default="guidellm", help="results/<out>.json")
    args = p.parse_args(argv)
    quick = args.quick
    args.concurrency = args.concurrency if args.concurrency is not None else \
        ([4] if quick else [4, 16])
    args.max_requests = args.max_requests or (8 if quick else 32)
    args.prompt_tokens = args.prompt_tokens or (64 if quick else 256)
    args.output_tokens = args.output_tokens or (32 if quick else 128)
    return args


def scenario(args, model_dir: str, profile: Dict, levels: List[Dict], report_path: str):
    """guidellm's benchmark configuration: one sub-benchmark per entry of `levels`."""
    from guidellm.schemas.benchmark import BenchmarkScenario
    spec = dict(
        backend={"kind": "vllm_python", "model": model_dir,
                 "vllm_config": dict(args.vllm_config),     # guidellm adds "model" to it
                 "request_format": args.request_format},
        profile={**profile, "warmup": {"value": args.warmup, "mode": "requests"}},
        constraints=[{"kind": "max_requests", "count": args.max_requests}],
        data=[{"kind": "synthetic_text", "prompt_tokens": args.prompt_tokens,
               "output_tokens": args.output_tokens}],
        seed={"kind": "static", "value": args.seed},
        outputs=[{"kind": "json", "path": report_path}])
    return BenchmarkScenario(spec=spec, benchmarks=levels or [None])


def summarize(benchmark) -> Dict:
    """One table row from a guidellm GenerativeBenchmark: requests made and failed, then figures
    over the successful requests guidellm measured (warm-up and the edges of its measurement
    window left out)."""
    m, made = benchmark.metrics, benchmark.scheduler_metrics.requests_made
    strategy = benchmark.config.strategy

    def ok(name):
        return getattr(m, name).successful

    return {"profile": strategy.type_,
            "concurrency": getattr(strategy, "streams", 1),
            "requests": made.total, "errored": made.errored,
            "measured": m.request_totals.successful,
            "req_s": ok("requests_per_second").mean,
            "out_tok_s": ok("output_tokens_per_second").mean,
            "ttft_ms_p50": ok("time_to_first_token_ms").median,
            "ttft_ms_p95": ok("time_to_first_token_ms").percentiles.p95,
            "itl_ms_p50": ok("inter_token_latency_ms").median,
            "latency_s_p50": ok("request_latency").median,
            "latency_s_p95": ok("request_latency").percentiles.p95}


def run_profile(args, model_dir: str, profile: Dict, levels: List[Dict]) -> List[Dict]:
    from guidellm.benchmark import benchmark_generative_text
    # guidellm validates its backend config once per sub-benchmark and then warns that it finds
    # the "model" it has itself put into vllm_config the first time
    logging.getLogger("guidellm.schemas.backends.vllm_python").setLevel(logging.ERROR)
    os.makedirs(common.RESULTS, exist_ok=True)
    path = os.path.join(common.RESULTS, f"{args.out}_report_{profile['kind']}.json")
    report, _ = asyncio.run(benchmark_generative_text(
        scenario(args, model_dir, profile, levels, path), progress=False, console=None))
    return [summarize(b) for b in report.benchmarks]


def main(argv: Optional[List[str]] = None) -> List[Dict]:
    args = parse_args(argv)
    common.setup(args)                                     # picks args.threads
    os.environ["OMP_NUM_THREADS"] = str(args.threads)     # guidellm spawns the engine's process
    from vllm.model_executor.gguf_loader import resolve_model
    model, label = common.model_for(args)
    model_dir = resolve_model(model)       # guidellm needs a path: its tokenizer and ours
    print(f"guidellm vllm_python backend -> vllm.AsyncLLMEngine on {label}; "
          f"{args.prompt_tokens} + {args.output_tokens} tokens, {args.max_requests} requests "
          f"per level, {args.threads} engine threads\n{common.machine()}", flush=True)
    rows = run_profile(args, model_dir, {"kind": "synchronous"}, [])
    if args.concurrency:
        rows += run_profile(args, model_dir, {"kind": "concurrent", "streams": 1},
                            [{"profile.streams": c} for c in args.concurrency])
    common.table(rows, COLS, f"guidellm (vllm_python backend) on {label}")
    common.save(args.out, {"model": label, "prompt_tokens": args.prompt_tokens,
                           "output_tokens": args.output_tokens,
                           "max_requests": args.max_requests,
                           "request_format": args.request_format, "threads": args.threads,
                           "vllm_config": args.vllm_config, "rows": rows})
    return rows


if __name__ == "__main__":       # guidellm's workers are spawned: they re-import this file
    main()
