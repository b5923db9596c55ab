"""Benchmark offline throughput: `vllm bench throughput`, one engine on a batch of requests.

    vllm bench throughput --model MODEL --input-len 256 --output-len 128 --num-prompts 64 \\
        --kv-eviction-policy h2o --kv-eviction-ratio 0.5 --output-json throughput.json

Every engine flag applies (the --kv-* eviction flags included). Requests are sampled
(temperature 1) and ignore EOS, so each generates its expected output length.
"""
import argparse
import dataclasses
import json
import time
from typing import Any, Dict, List

from vllm.benchmarks.datasets import (SampleRequest, sample_longbench, sample_random,
                                      sample_sharegpt)
from vllm.engine.arg_utils import EngineArgs


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--backend", type=str, default="vllm", choices=["vllm"])
    add("--dataset-name", type=str, default=None, choices=["sharegpt", "random", "longbench"],
        help="Default: sharegpt with --dataset-path, else random.")
    add("--dataset-path", type=str, default=None,
        help="ShareGPT JSON or LongBench JSONL (default: the packaged ones)")
    add("--input-len", type=int, default=None,
        help="Input tokens per request (random: required; longbench: document tokens, "
             "default 2048)")
    add("--output-len", type=int, default=None,
        help="Output tokens per request; overrides the dataset's (longbench default 64)")
    add("--n", type=int, default=1, help="Number of generated sequences per prompt.")
    add("--num-prompts", type=int, default=1000, help="Number of prompts to process.")
    add("--output-json", type=str, default=None,
        help="Path to save the throughput results in JSON format.")
    add("--prefix-len", type=int, default=0,
        help="random: number of fixed prefix tokens before the random context.")
    add("--random-range-ratio", type=float, default=0.0,
        help="random: lengths drawn uniformly from [length * (1 - r), length * (1 + r)].")
    EngineArgs.add_cli_args(parser)


def get_requests(args: argparse.Namespace, tokenizer) -> List[SampleRequest]:
    name = args.dataset_name or ("sharegpt" if args.dataset_path else "random")
    if name == "random":
        if args.input_len is None or args.output_len is None:
            raise ValueError("the random dataset needs --input-len and --output-len")
        return sample_random(tokenizer, args.num_prompts, args.input_len, args.output_len,
                             args.random_range_ratio, args.prefix_len, args.seed)
    if name == "sharegpt":
        return sample_sharegpt(tokenizer, args.num_prompts, args.dataset_path, args.output_len,
                               args.seed)
    return sample_longbench(tokenizer, args.num_prompts, args.input_len or 2048,
                            args.output_len or 64, args.dataset_path, args.seed)


def main(args: argparse.Namespace) -> Dict[str, Any]:
    from vllm import LLM, SamplingParams
    llm = LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args)))
    requests = get_requests(args, llm.get_tokenizer())
    longest = max(r.prompt_len + r.expected_output_len for r in requests)
    if longest > llm.llm_engine.max_model_len:
        raise ValueError(f"a request needs {longest} tokens, more than max_model_len "
                         f"{llm.llm_engine.max_model_len}")
    params = [SamplingParams(n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True,
                             max_tokens=r.expected_output_len) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate([r.prompt for r in requests], params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    total = prompt_tokens + output_tokens
    print(f"Throughput: {len(requests) / elapsed:.2f} requests/s, {total / elapsed:.2f} total "
          f"tokens/s, {output_tokens / elapsed:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    results = {"elapsed_time": elapsed, "num_requests": len(requests),
               "total_num_tokens": total, "requests_per_second": len(requests) / elapsed,
               "tokens_per_second": total / elapsed,
               # ours, beside upstream's keys
               "total_output_tokens": output_tokens,
               "output_tokens_per_second": output_tokens / elapsed,
               "kv_stats": llm.get_kv_stats()}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=4, default=float)
    return results
