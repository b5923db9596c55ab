"""Benchmark the latency of one batch: `vllm bench latency`.

    vllm bench latency --model MODEL --input-len 32 --output-len 128 --batch-size 8 \\
        --num-iters-warmup 2 --num-iters 10 --output-json latency.json

One batch of --batch-size random prompts is generated to completion (sampled, EOS ignored)
--num-iters-warmup times untimed, then --num-iters times timed. Every engine flag applies.
"""
import argparse
import dataclasses
import json
import time
from typing import Any, Dict

import numpy as np

from vllm.engine.arg_utils import EngineArgs

PERCENTAGES = (10, 25, 50, 75, 90, 99)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--input-len", type=int, default=32)
    add("--output-len", type=int, default=128)
    add("--batch-size", type=int, default=8)
    add("--n", type=int, default=1, help="Number of generated sequences per prompt.")
    add("--num-iters-warmup", type=int, default=10, help="Number of iterations to run for warmup.")
    add("--num-iters", type=int, default=30, help="Number of iterations to run.")
    add("--output-json", type=str, default=None,
        help="Path to save the latency results in JSON format.")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(enable_prefix_caching=False)   # a repeated batch would hit the cache


def main(args: argparse.Namespace) -> Dict[str, Any]:
    from vllm import LLM, SamplingParams
    llm = LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args)))
    if llm.llm_engine.max_model_len < args.input_len + args.output_len:
        raise ValueError("max_model_len must be at least --input-len + --output-len")
    params = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True,
                            max_tokens=args.output_len)
    vocab = llm.get_tokenizer().vocab_size
    ids = np.random.default_rng(args.seed).integers(0, min(10000, vocab),
                                                    (args.batch_size, args.input_len))
    prompts = [{"prompt_token_ids": row} for row in ids.tolist()]

    def run_to_completion() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    print("Warming up...")
    for _ in range(args.num_iters_warmup):
        run_to_completion()
    latencies = np.array([run_to_completion() for _ in range(args.num_iters)])
    percentiles = np.percentile(latencies, PERCENTAGES)
    print(f"Avg latency: {latencies.mean()} seconds")
    print(f"Std latency: {latencies.std()} seconds")
    for percentage, value in zip(PERCENTAGES, percentiles):
        print(f"{percentage}% percentile latency: {value} seconds")
    results = {"avg_latency": float(latencies.mean()), "std_latency": float(latencies.std()),
               "latencies": latencies.tolist(),
               "percentiles": dict(zip(PERCENTAGES, percentiles.tolist()))}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=4)
    return results
