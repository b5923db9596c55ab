"""Decode throughput of the default model (SmolLM2-135M-Instruct, a Q4_1 GGUF): --quantization
none (dequantized float32 GEMMs) vs gguf (the GGUF's Q4_1 / Q8_0 blocks multiplied natively,
csrc/cpu/quant_kernels.c), at batch 1 / 16 / 32 on this CPU.

Decode tok/s = batch * (L - 1) / (t(L) - t(1)): a greedy batch generating L tokens minus the same
batch generating one (its prefill), best of --repeats. Prints a table; writes JSON to
benchmarks/results/benchmark_quant.json.

    python benchmarks/benchmark_quant.py [--threads 2] [--batches 1 16 32] [--tokens 48]
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from common import RESULTS, cpu_info  # noqa: E402


def decode_tok_s(llm, batch: int, tokens: int, repeats: int) -> float:
    from vllm import SamplingParams
    prompts = [f"Tell me a story about the number {i}." for i in range(batch)]

    def run(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0
    run(2)                                              # warm-up
    best = min(run(tokens) - run(1) for _ in range(repeats))
    return batch * (tokens - 1) / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(RESULTS, "benchmark_quant.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from vllm import LLM, quant_kernels
    results = {}
    for quant in ("none", "gguf"):
        llm = LLM(quantization=quant, max_num_seqs=max(args.batches),
                  num_gpu_blocks_override=1024)
        results[quant] = {b: decode_tok_s(llm, b, args.tokens, args.repeats)
                          for b in args.batches}
        del llm
    info = cpu_info()
    print(f"{info['cpu']}, ISA {info['isa']} (quant kernels {quant_kernels.active_isa()}, vnni "
          f"{bool(quant_kernels.library(quant_kernels.active_isa()).vq_uses_vnni())}), "
          f"{args.threads} threads")
    print(f"{'batch':>5} {'fp32 tok/s':>11} {'Q4_1 tok/s':>11} {'ratio':>6}")
    rows = []
    for b in args.batches:
        f, q = results["none"][b], results["gguf"][b]
        rows.append({"batch": b, "fp32_tok_s": f, "gguf_tok_s": q, "ratio": q / f})
        print(f"{b:>5} {f:>11.1f} {q:>11.1f} {q / f:>6.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"machine": info, "threads": args.threads, "tokens": args.tokens,
                   "rows": rows}, fh, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
