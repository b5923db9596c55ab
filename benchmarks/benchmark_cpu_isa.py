"""Which build of the C kernels is fastest on this CPU: every variant this CPU runs (avx512,
avx2, generic; vllm/kernels/cpu_kernels.py), each with its next-panel prefetch on and off ("_nopf"; the
kernel plan picks this per batch band), on one decode step's GEMMs of the default model.

A step here is every GEMM of the model in layer order (30 x QKV, O, gate_up, down, then the LM
head) on random weights of the real shapes (538 MB of fp32, each variant with its own packing, so
each call streams its weight from memory as in a real step), at each row count (= batch size).
The variants take turns call by call, in alternating order, so a drift of the shared host's memory
bandwidth moves them alike; the table gives the median ms per step and each candidate's time
relative to the build this machine uses by default (`active_isa()`: the first runnable of avx512,
avx2, generic) with prefetch on; the JSON also has GB/s and GFLOP/s.

    python benchmarks/benchmark_cpu_isa.py --threads 2
    python benchmarks/benchmark_cpu_isa.py --quick --isas avx512 avx2
"""
import statistics
import time
from typing import Dict, List, Tuple

import torch

import common

# (K, N, count) of the default model's GEMMs: SmolLM2-135M, hidden 576, 9 + 2 x 3 heads of 64,
# MLP 1536, 30 layers, 49,152-token LM head
DEFAULT_MODEL_GEMMS = ((576, 960, 30), (576, 576, 30), (576, 3072, 30), (1536, 576, 30),
                       (576, 49152, 1))


def step_calls(isa: str, weights: List[Tuple[int, int, List[torch.Tensor]]], m: int,
               prefetch: bool = True):
    """One decode step's GEMMs in layer order with `isa`'s kernels, as a callable."""
    from vllm.kernels import cpu_kernels
    lib = cpu_kernels.library(isa)
    packed = [(k, n, [cpu_kernels.pack_weight(w, isa=isa) for w in ws]) for k, n, ws in weights]
    xs = {k: torch.randn(m, k) for k, _, _ in weights}
    ys = {n: torch.empty(m, n) for _, n, _ in weights}
    order = [(k, n, ws[i]) for i in range(max(len(ws) for _, _, ws in packed))
             for k, n, ws in packed if i < len(ws)]

    def step():
        for k, n, w in order:
            lib.vtok_packed_gemm(xs[k].data_ptr(), m, k, w.data_ptr(), n, None, None,
                                 ys[n].data_ptr(), prefetch)
    return step


def candidates(isas: List[str]) -> Dict[str, Tuple[str, bool]]:
    """name -> (variant, prefetch): avx2 -> avx2 with prefetch, avx2_nopf -> without."""
    return {f"{isa}{'' if pf else '_nopf'}": (isa, pf) for isa in isas for pf in (True, False)}


def measure(isas: List[str], rows: List[int], reps: int,
            gemms=DEFAULT_MODEL_GEMMS) -> List[Dict]:
    weights = [(k, n, [torch.randn(k, n) for _ in range(count)]) for k, n, count in gemms]
    nbytes = sum(4 * k * n * count for k, n, count in gemms)
    names = list(candidates(isas))
    out = []
    for m in rows:
        steps = {name: step_calls(isa, weights, m, pf)
                 for name, (isa, pf) in candidates(isas).items()}
        times = {name: [] for name in names}
        for rep in range(reps + 1):                  # rep 0 warms up
            for name in (names if rep % 2 else names[::-1]):
                t0 = time.perf_counter()
                steps[name]()
                if rep:
                    times[name].append(time.perf_counter() - t0)
        row = {"rows": m}
        for name in names:
            ms = statistics.median(times[name]) * 1e3
            row[f"{name}_ms"], row[f"{name}_gb_s"] = ms, nbytes / ms / 1e6
            row[f"{name}_gflop_s"] = 2 * m * nbytes / 4 / ms / 1e6
        out.append(row)
        print("  " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
        del steps
    return out


def main():
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--isas", nargs="+", default=None, help="default: every runnable variant")
    p.add_argument("--rows", type=int, nargs="+", default=None)
    p.add_argument("--reps", type=int, default=None)
    args = p.parse_args()
    common.setup(args)
    from vllm.kernels import cpu_kernels
    runnable = cpu_kernels.runnable_isas()
    isas = args.isas or runnable
    bad = [isa for isa in isas if isa not in runnable]
    if bad:
        raise SystemExit(f"this CPU cannot run {bad}; it runs {runnable}")
    default = cpu_kernels.active_isa()
    rows = args.rows or ([1, 16, 32] if args.quick else [1, 4, 8, 16, 32, 64, 128])
    reps = args.reps or (4 if args.quick else 10)
    print(common.machine(), flush=True)
    table_rows = measure(isas, rows, reps)
    ref = default if default in isas else isas[0]
    names = list(candidates(isas))
    for r in table_rows:
        for name in names:
            r[f"{name}_vs_{ref}"] = r[f"{name}_ms"] / r[f"{ref}_ms"]
    cols = ["rows"] + [f"{name}_ms" for name in names] + \
        [f"{name}_vs_{ref}" for name in names if name != ref]
    title = (f"One decode step's GEMMs (default model shapes, 538 MB fp32), median ms per step, "
             f"variants taking turns; X_vs_{ref} = X's time / {ref}'s ({ref}: this machine's "
             f"default build)\n{common.machine()}")
    text = common.table(table_rows, cols, title)
    pyplot = common.plt()
    fig, ax = pyplot.subplots(figsize=(5, 3.2))
    for name in names:
        ax.plot(rows, [r[f"{name}_gflop_s"] for r in table_rows], marker="o", label=name,
                linestyle="-" if name in isas else "--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows (batch size)")
    ax.set_ylabel("GFLOP/s (GEMMs of a decode step)")
    ax.set_title(f"C kernel variants on {cpu_kernels.cpu_name()}, {args.threads} threads",
                 fontsize=8)
    ax.legend(fontsize=8)
    common.save("benchmark_cpu_isa", {"default_isa": default, "args": vars(args),
                                      "rows": table_rows, "table": text}, fig)


if __name__ == "__main__":
    main()
