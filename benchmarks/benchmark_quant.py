"""Decode throughput of the default model (SmolLM2-135M-Instruct) by weight format: the float32
path (--quantization none: the shipped Q4_1 dequantized) against the GGUF's blocks multiplied
natively (--quantization gguf, csrc/cpu/quant_kernels.c) and the default (--quantization auto:
the blocks below the batch size timed at load, float32 from there): the shipped Q4_1 file and, with
--formats, Q4_0 / Q8_0 / BF16 files requantized from it (its GEMM weights dequantized and
quantized again by gguf's own quantizer, the Q8_0 token embedding kept; written once to the
cache; BF16 runs as bf16 panels, model_executor/bf16_linear.py), at batch 1 / 16 / 32 on this
CPU.

Decode tok/s = batch * (L - 1) / (t(L) - t(1)): a greedy batch generating L tokens minus the same
batch generating one (its prefill). Every format's engine is built first; then --rounds rounds,
each timing every batch on every format in turn (the order rotated per round), so a shared
host's drift reaches all of them alike: the table shows each format's median tok/s and the median
of its per-round ratios to float32 (the lowest beside it). Writes benchmark_quant.json / .png.

--gemv instead times one GEMM of each of the default model's shapes per weight type (BF16 panels,
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, and Q4_K / Q6_K where the rows are a multiple of 256 wide: only
ffn_down's 1536; llama.cpp writes 576-wide rows of a Q4_K_M file as Q5_0), and torch's own 4-bit
GEMM (`torch int4`: _weight_int4pack_mm_for_cpu with bf16 activations, onto which Q4_0 and Q4_1
map exactly), against the engine's float32 C GEMM, at --rows activation rows, weights streamed
from memory (the call cycles through copies that together exceed the last-level cache, as a
decode step's 30 layers do). Each type runs in the layout the engine loads it in: repacked
(16 columns interleaved, quant_kernels.repack) where this build repacks the type (x86: Q4_0,
Q4_1, Q8_0; avx2: Q5_0, Q4_K, Q6_K too), else its GGML blocks; --blocks times every type as
blocks (the layout before repacking, for comparison). --head N K adds one more GEMM of that
shape (an LM head: 151936 2048 is benchmark_moe.py's Qwen3-MoE head, Q6_K in its Q4_0 and Q8_0
files) to the per-GEMM table, not to the decode step's sum. Writes benchmark_quant_gemv.json and .png.

    python benchmarks/benchmark_quant.py [--threads 2] [--batches 1 16 32] [--tokens 33]
    python benchmarks/benchmark_quant.py --formats fp32 q4_1 q4_0 q8_0 bf16 --rounds 3
    python benchmarks/benchmark_quant.py --gemv [--rows 1 16 32]
    python benchmarks/benchmark_quant.py --gemv --rows 1 4 16 32 --head 151936 2048 [--blocks]
"""
import argparse
import os
import statistics
import sys
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from common import cpu_info, plt, requantized, save, table  # noqa: E402

# the default model's GEMMs: name -> (N, K) and how many a decode step runs
SHAPES = {"qkv": (960, 576, 30), "o": (576, 576, 30), "gate_up": (3072, 576, 30),
          "down": (576, 1536, 30), "lm_head": (49152, 576, 1)}
GEMV_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K"]
# a Q4_K_M file of this model as llama.cpp writes it, roughly: 576-wide rows fall back to Q5_0,
# ffn_down (1536 wide) is Q4_K, the tied embedding Q8_0
Q4_K_M = {"qkv": "Q5_0", "o": "Q5_0", "gate_up": "Q5_0", "down": "Q4_K", "lm_head": "Q8_0"}
STREAM_BYTES = 96 << 20         # copies of a weight cycled per shape: 3x this CPU's 32 MiB L3


def _random_blocks(qtype: int, n: int, k: int, rng) -> torch.Tensor:
    """Random block bytes with fp16 scales of 2^-10 (valid numbers; speed does not depend on
    them)."""
    from vllm.kernels import quant_kernels as qk
    nblk = k // qk.BLOCK_ELEMS[qtype]
    b = rng.integers(0, 256, (n, nblk, qk.BLOCK_BYTES[qtype]), dtype="uint8")
    scale = torch.tensor([2.0 ** -10], dtype=torch.float16).view(torch.uint8).numpy()
    offsets = {qk.Q6_K: [208], qk.Q4_K: [0, 2], qk.Q4_1: [0, 2], qk.Q5_1: [0, 2]}
    for off in offsets.get(qtype, [0]):
        b[..., off:off + 2] = scale
    return torch.from_numpy(b.reshape(n, -1))


def _torch_int4_seconds(x: torch.Tensor, n: int, k: int) -> float:
    """torch's own 4-bit GEMM (_weight_int4pack_mm_for_cpu: groups of 32, a bf16 scale and zero
    per group, bf16 activations), the layout a Q4_0 / Q4_1 weight maps onto exactly; cycled
    through copies as the blocks are."""
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    nbytes = n * k // 2 + n * (k // 32) * 4
    ws = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
          for _ in range(max(2, STREAM_BYTES // nbytes))]
    sz = (torch.rand(k // 32, n, 2) * 2.0 ** -10).to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    op = torch.ops.aten._weight_int4pack_mm_for_cpu
    return _time_cycled([lambda w=w: op(xb, w, 32, sz) for w in ws])


def _time_cycled(calls, repeats: int = 5) -> float:
    """Best-of-repeats seconds per call over one pass through `calls` (each on its own copy)."""
    for c in calls[:2]:
        c()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for c in calls:
            c()
        best = min(best, (time.perf_counter() - t0) / len(calls))
    return best


def gemv_main(args) -> None:
    import numpy as np

    from vllm.kernels import cpu_kernels, quant_kernels as qk
    rng = np.random.default_rng(0)
    ids = {name: t for t, name in qk.TYPE_NAMES.items()}
    rows, times = [], {}
    shapes = dict(SHAPES)
    if args.head:
        shapes["head"] = (*args.head, 0)
    for shape, (n, k, _) in shapes.items():
        for m in args.rows:
            x = torch.randn(m, k)
            wt = torch.randn(k, n) * 0.05
            copies = max(2, STREAM_BYTES // (n * k * 4))
            packed = [cpu_kernels.pack_weight(wt) for _ in range(copies)]
            t32 = _time_cycled([lambda p=p: cpu_kernels.packed_gemm(x, p, n) for p in packed])
            packed = [cpu_kernels.pack_weight(wt, bf16=True) for _ in range(2 * copies)]
            t16 = _time_cycled([lambda p=p: cpu_kernels.packed_gemm(x, p, n) for p in packed])
            del packed
            times[(shape, "fp32", m)], times[(shape, "BF16", m)] = t32, t16
            row = {"gemm": shape, "N": n, "K": k, "rows": m, "fp32 us": t32 * 1e6,
                   "fp32 GB/s": n * k * 4 / t32 / 1e9, "BF16 us": t16 * 1e6,
                   "BF16 GB/s": n * k * 2 / t16 / 1e9}
            for name in GEMV_TYPES:
                t = ids[name]
                if k % qk.BLOCK_ELEMS[t]:
                    continue
                ws = [_random_blocks(t, n, k, rng) for _ in
                      range(max(2, STREAM_BYTES // (n * qk.row_bytes(t, k))))]
                tf = t
                if qk.packs(t) and not args.blocks:         # as the engine loads it
                    ws, tf = [qk.repack(w, t) for w in ws], t | qk.PACKED
                nbytes = ws[0].numel()
                sec = _time_cycled([lambda w=w, tf=tf: qk.gemm(x, w, tf, n, k) for w in ws])
                del ws
                times[(shape, name, m)] = sec
                row[f"{name} us"] = sec * 1e6
                row[f"{name} GB/s"] = nbytes / sec / 1e9
            times[(shape, "torch int4", m)] = sec = _torch_int4_seconds(x, n, k)
            row["torch int4 us"] = sec * 1e6
            rows.append(row)
    cols = ["gemm", "N", "K", "rows", "fp32 us", "fp32 GB/s", "BF16 us", "BF16 GB/s"] + \
        [f"{t} us" for t in GEMV_TYPES] + ["torch int4 us"]
    info = cpu_info()
    repacked = [] if args.blocks else [t for t in GEMV_TYPES if qk.packs(ids[t])]
    title = (f"{info['cpu']}, quant kernels {qk.active_isa()}, {args.threads} threads: "
             f"one GEMM, weights streamed; repacked: {', '.join(repacked) or 'none'}")
    table(rows, cols, title)
    formats = {"fp32": {s: "fp32" for s in SHAPES}, "BF16": {s: "BF16" for s in SHAPES},
               "Q8_0": {s: "Q8_0" for s in SHAPES},
               "Q4_0": {s: "Q4_0" for s in SHAPES}, "Q4_1": {s: "Q4_1" for s in SHAPES},
               "Q4_K_M": Q4_K_M, "torch int4": {s: "torch int4" for s in SHAPES}}
    step_rows = []
    for m in args.rows:
        step = {f: sum(times[(s, fmt[s], m)] * SHAPES[s][2] for s in SHAPES)
                for f, fmt in formats.items()}
        step_rows.append({"rows": m, **{f"{f} ms": v * 1e3 for f, v in step.items()},
                          **{f"{f} vs fp32": step["fp32"] / v for f, v in step.items()
                             if f != "fp32"}})
    table(step_rows, list(step_rows[0]), "a decode step's GEMMs (30 layers + lm_head), summed")
    fig, ax = plt().subplots(figsize=(7, 3.5))
    for j, (f, _) in enumerate(formats.items()):
        ax.bar([i + j * 0.14 for i in range(len(args.rows))],
               [r[f"{f} ms"] for r in step_rows], 0.14, label=f)
    ax.set_xticks([i + 0.35 for i in range(len(args.rows))], [f"{m} rows" for m in args.rows])
    ax.set_ylabel("ms per decode step (GEMMs)")
    ax.set_title(f"SmolLM2-135M GEMMs by weight format, {info['cpu']}")
    ax.legend(fontsize=8)
    save(args.name if args.name != "benchmark_quant" else "benchmark_quant_gemv",
         {"threads": args.threads, "rows": rows, "step": step_rows, "q4_k_m_layout": Q4_K_M,
          "repacked": repacked}, fig)


def decode_tok_s(llm, batch: int, tokens: int) -> float:
    from vllm import SamplingParams
    prompts = [f"Tell me a story about the number {i}." for i in range(batch)]

    def run(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0
    run(2)                                              # warm-up
    return batch * (tokens - 1) / (run(tokens) - run(1))


def build_engines(formats: List[str], max_batch: int) -> Dict[str, object]:
    """format -> an LLM: fp32 the float32 path; q4_1 the shipped file natively; auto the
    default (the shipped file's blocks below the crossover timed at load, float32 from there);
    others their requantized file natively."""
    from vllm import LLM
    engines = {}
    for fmt in formats:
        model = None if fmt in ("fp32", "q4_1", "auto") else requantized(fmt.upper())
        quantization = {"fp32": "none", "auto": "auto"}.get(fmt, "gguf")
        engines[fmt] = LLM(model=model, quantization=quantization,
                           max_num_seqs=max_batch, num_gpu_blocks_override=1024)
    return engines


def decode_main(args) -> None:
    from vllm.kernels import quant_kernels
    formats = ["fp32"] + [f for f in args.formats if f != "fp32"]
    engines = build_engines(formats, max(args.batches))
    runs = {(f, b): [] for f in formats for b in args.batches}
    for r in range(args.rounds):
        order = formats[r % len(formats):] + formats[:r % len(formats)]
        for b in args.batches:
            for f in order:
                runs[(f, b)].append(decode_tok_s(engines[f], b, args.tokens))
                print(f"round {r + 1} batch {b} {f}: {runs[(f, b)][-1]:.1f} tok/s", flush=True)
    rows = []
    for b in args.batches:
        row = {"batch": b}
        for f in formats:
            row[f"{f} tok/s"] = statistics.median(runs[(f, b)])
            if f != "fp32":
                ratios = [q / p for q, p in zip(runs[(f, b)], runs[("fp32", b)])]
                row[f"{f}/fp32"] = statistics.median(ratios)
                row[f"{f}/fp32 min"] = min(ratios)
        rows.append(row)
    info = cpu_info()
    lib = quant_kernels.library(quant_kernels.active_isa())
    title = (f"{info['cpu']}, quant kernels {quant_kernels.active_isa()} (vnni "
             f"{bool(lib.vq_uses_vnni())}), {args.threads} threads, {args.tokens} tokens, "
             f"median of {args.rounds} alternating rounds")
    table(rows, list(rows[0]), title)
    fig, ax = plt().subplots(figsize=(7, 3.5))
    for j, f in enumerate(formats):
        ax.bar([i + j * 0.8 / len(formats) for i in range(len(args.batches))],
               [row[f"{f} tok/s"] for row in rows], 0.8 / len(formats), label=f)
    ax.set_xticks([i + 0.4 - 0.4 / len(formats) for i in range(len(args.batches))],
                  [f"batch {b}" for b in args.batches])
    ax.set_ylabel("decode tok/s")
    ax.set_title(f"SmolLM2-135M decode by weight format, {info['cpu']}, {args.threads} threads")
    ax.legend(fontsize=8)
    save(args.name, {"threads": args.threads, "tokens": args.tokens, "rounds": args.rounds,
                     "rows": rows, "runs": {f"{f} {b}": v for (f, b), v in runs.items()}}, fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32])
    ap.add_argument("--tokens", type=int, default=33)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--formats", nargs="+", default=["fp32", "q4_1", "auto"],
                    choices=["fp32", "q4_1", "auto", "q4_0", "q8_0", "bf16"])
    ap.add_argument("--name", default="benchmark_quant", help="results file name")
    ap.add_argument("--gemv", action="store_true",
                    help="time single GEMMs of the default model's shapes per GGUF type")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16],
                    help="--gemv: activation rows")
    ap.add_argument("--blocks", action="store_true",
                    help="--gemv: every type as its GGML blocks, none repacked")
    ap.add_argument("--head", type=int, nargs=2, metavar=("N", "K"),
                    help="--gemv: one more GEMM of this shape (an LM head)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.gemv:
        gemv_main(args)
    else:
        decode_main(args)

if __name__ == "__main__":
    main()
