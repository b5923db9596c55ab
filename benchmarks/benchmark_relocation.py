"""Relocation cost per launch and per moved token, against the copy ceiling of the same run.

    python benchmarks/benchmark_relocation.py                  # CPU: the torch path vs memcpy
    python benchmarks/benchmark_relocation.py --device cuda    # CUDA op, Triton, torch vs D2D copy

A moved token reads and writes one K/V row in every layer: 2 * layers * row_bytes. The ceiling is
what one large contiguous copy achieves (bytes read + written per second: memcpy on CPU,
device-to-device on CUDA), so `of ceiling` is the fraction of copy bandwidth a relocation gets.
On CUDA every timed launch follows a write of --flush-mb (default 256 MB, over the L2 of any
current GPU), so each launch reads its rows from HBM, as in serving, not from a warm L2.
`headline` in the JSON: each backend's share of the ceiling at >= 256 tokens moved (issue 12's
target: >= 50% for the CUDA op). Prints a table; writes <out-dir>/relocation_<device>.json and
.png.
"""
import argparse
import json
import os
import statistics
import time

import torch

from vllm.kernels import ops

SHAPES = {"cpu": (30, 3, 64, "float32"),      # the default model, SmolLM2-135M, on CPU
          "cuda": (32, 8, 128, "bfloat16")}   # a Llama-3.1-8B-sized cache on a GPU


def timed(fn, device: str, repeats: int, flush: torch.Tensor = None) -> float:
    """Seconds of fn() after one warm-up: median on CUDA, best of repeats on a (shared) CPU.
    flush (CUDA): a buffer written before each timed launch, outside the timed interval."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            if flush is not None:
                flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times) if device == "cuda" else min(times)


def copy_ceiling(device: str, nbytes: int, repeats: int, flush=None) -> float:
    """Bytes read + written per second by one contiguous copy of nbytes."""
    a = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    return 2 * nbytes / timed(lambda: b.copy_(a), device, repeats, flush)


def run(args) -> dict:
    layers, kvh, d, dtype = SHAPES[args.device]
    kv = torch.randn(layers, args.slots, 2, kvh, d, device=args.device).to(getattr(torch, dtype))
    row_bytes = kv[0, 0].numel() * kv.element_size()
    flush = None
    if args.device == "cuda" and args.flush_mb > 0:
        flush = torch.empty(args.flush_mb << 20, dtype=torch.uint8, device="cuda")
    ceiling = copy_ceiling(args.device, args.ceiling_mb << 20, args.repeats, flush)
    result = {"device": args.device, "gpu": gpu_name(args.device),
              "shape": {"layers": layers, "kv_heads": kvh, "head_dim": d, "dtype": dtype,
                        "slots": args.slots}, "bytes_per_token": 2 * layers * row_bytes,
              "ceiling_GBps": ceiling / 1e9, "l2_flush_MB": args.flush_mb if flush is not None
              else 0, "rows": []}
    backends = ["torch"] if args.device == "cpu" else \
        [b for b in ("cuda", "triton", "torch") if ops._available(b)]
    for backend in backends:
        for n in [t for t in args.tokens if 2 * t <= args.slots]:
            perm = torch.randperm(args.slots, device=args.device)    # scattered, disjoint moves
            src, dst = perm[:n], perm[n:2 * n]
            sec = timed(lambda: ops.relocate_kv(kv, src, dst, backend=backend), args.device,
                        args.repeats, flush)
            bw = n * 2 * layers * row_bytes / sec
            result["rows"].append({"backend": backend, "tokens": n, "time_us": sec * 1e6,
                                   "us_per_token": sec * 1e6 / n, "GBps": bw / 1e9,
                                   "of_ceiling": bw / ceiling})
    result["headline"] = {b: {str(r["tokens"]): round(r["of_ceiling"], 4)
                              for r in result["rows"] if r["backend"] == b and r["tokens"] >= 256}
                          for b in backends}
    return result


def gpu_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def report(result: dict, out_dir: str) -> None:
    print(f"device {result['device']}  shape {result['shape']}  "
          f"{result['bytes_per_token'] / 1024:.1f} KiB read+written per moved token")
    print(f"copy ceiling: {result['ceiling_GBps']:.1f} GB/s (read + write), L2 flush "
          f"{result['l2_flush_MB']} MB before each launch ({result['gpu']})")
    print(f"{'backend':>8} {'tokens':>7} {'us/launch':>10} {'us/token':>9} {'GB/s':>8} "
          f"{'of ceiling':>10}")
    for r in result["rows"]:
        print(f"{r['backend']:>8} {r['tokens']:>7} {r['time_us']:>10.1f} {r['us_per_token']:>9.3f} "
              f"{r['GBps']:>8.1f} {r['of_ceiling']:>10.1%}")
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"relocation_{result['device']}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result, stem + ".png")
    print(f"wrote {stem}.json and {stem}.png")


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for backend in dict.fromkeys(r["backend"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["backend"] == backend]
        tokens = [r["tokens"] for r in rows]
        left.plot(tokens, [r["us_per_token"] for r in rows], "o-", label=backend)
        right.plot(tokens, [100 * r["of_ceiling"] for r in rows], "o-", label=backend)
    left.set(xscale="log", yscale="log", xlabel="tokens moved per launch", ylabel="us per token",
             title="relocation cost per moved token")
    right.set(xscale="log", xlabel="tokens moved per launch", ylabel="% of copy ceiling",
              ylim=(0, 110), title=f"ceiling {result['ceiling_GBps']:.0f} GB/s "
                                   f"({result['device']})")
    right.axhline(100, color="gray", lw=0.8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--slots", type=int, default=None, help="cache slots (cpu 8192, cuda 32768)")
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256, 1024, 4096])
    p.add_argument("--repeats", type=int, default=None, help="timed runs (cpu 5, cuda 50)")
    p.add_argument("--ceiling-mb", type=int, default=256)
    p.add_argument("--flush-mb", type=int, default=256,
                   help="CUDA: bytes written before each timed launch to empty the L2 (0: off)")
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args()
    args.slots = args.slots or (8192 if args.device == "cpu" else 32768)
    args.repeats = args.repeats or (5 if args.device == "cpu" else 50)
    report(run(args), args.out_dir)


if __name__ == "__main__":
    main()
