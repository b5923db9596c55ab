"""Decode throughput with a bf16 or fp8 KV cache against float32 (--kv-cache-dtype, CPU): the
default model's shape (SmolLM2-135M: 30 layers, hidden 576, 9 query / 3 KV heads of 64, MLP 1536,
49,152-token head) with seeded dummy weights, `batch` rows of `context` cached tokens each, one
decode step = the model forward (the plan's path: fused C decode layers or per op) + logits.
The caches take turns step by step, so a drift of the shared host moves all alike; the figure is
median tok/s = batch / step time. Caches sit on transparent huge pages as the engine's pool does
(vllm/huge_pages.py); `--pages 4k huge` runs each dtype both ways ("float32 4k", ...), the first
entry the baseline. Prints a table; writes benchmarks/results/benchmark_kv_dtype
.json and .png (tok/s relative to float32 per batch).

    python benchmarks/benchmark_kv_dtype.py --threads 2 --batch 1 16 32 --context 1024
"""
import argparse
import statistics
import time

import torch
from transformers import LlamaConfig

import common
from vllm import huge_pages
from vllm.attention import kv_quant
from vllm.attention.backend import AttentionMetadata
from vllm.model_executor.model_loader import get_model

DEFAULT_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                     max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                     tie_word_embeddings=True, head_dim=64)


def step_times(model, cfg, b: int, n: int, dtypes, steps: int, pages=("huge",)):
    """{cache name: [seconds per decode step]} for b rows of n cached tokens, caches taking
    turns; names in dtypes x pages order: "float32" for one page kind, "float32 4k",
    "float32 huge", ... for several."""
    slots = n * b + b
    g = torch.Generator().manual_seed(0)
    views = torch.randperm(n * b, generator=g).view(b, n)      # scattered, as after eviction
    meta = lambda: AttentionMetadata(                          # noqa: E731
        slot_mapping=torch.arange(n * b, n * b + b), num_decodes=b, decode_views=views,
        decode_lens=torch.full((b,), n), decode_mass=torch.zeros(b, n))
    caches = {}
    for dtype_name, page in [(d, p) for d in dtypes for p in pages]:
        name = dtype_name if len(pages) == 1 else f"{dtype_name} {page}"
        dtype = kv_quant.cache_dtype(dtype_name, torch.float32)
        shape = (cfg.num_hidden_layers, slots, 2, 3, 64)
        kv = huge_pages.zeros(shape, dtype) if page == "huge" else torch.zeros(shape, dtype=dtype)
        kv.view(torch.uint8).copy_(
            (torch.randn(shape, generator=g) * 2).to(dtype).view(torch.uint8))
        if kv_quant.is_fp8(kv):
            kv_quant.register(kv)
        caches[name] = kv
    ids, pos = torch.randint(0, cfg.vocab_size, (b,), generator=g), torch.full((b,), n)
    times = {name: [] for name in caches}
    with torch.inference_mode():
        for step in range(steps + 2):
            for name, kv in caches.items():
                t0 = time.perf_counter()
                model.compute_logits(model(ids, pos, kv, meta()))
                if step >= 2:
                    times[name].append(time.perf_counter() - t0)
    return times, {name: kv.nbytes for name, kv in caches.items()}


def ratio_plot(rows, base: str):
    plt = common.plt()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    batches = sorted({r["batch"] for r in rows})
    names = list(dict.fromkeys(r["kv_dtype"] for r in rows))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ys = [next(r["x_base"] for r in rows if r["batch"] == b and r["kv_dtype"] == name)
              for b in batches]
        ax.bar([j + i * width for j in range(len(batches))], ys, width, label=name)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))], [str(b) for b in batches])
    ax.set_xlabel(f"batch ({rows[0]['context']}-token contexts)")
    ax.set_ylabel(f"decode tok/s relative to {base}")
    ax.set_title(f"{common.cpu_info()['cpu']}, {rows[0]['threads']} threads", fontsize=8)
    ax.legend(fontsize=7)
    return fig


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, nargs="+", default=[32])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "fp8_e4m3", "fp8_e5m2"])
    ap.add_argument("--pages", nargs="+", default=["huge"], choices=["huge", "4k"],
                    help="the caches' pages: huge (as the engine's pool) and/or 4k")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfg = LlamaConfig(**DEFAULT_SHAPE)
    model = get_model("", cfg, "float32", 4096, "dummy", 0, torch.device("cpu"))
    rows = []
    for b in a.batch:
        times, nbytes = step_times(model, cfg, b, a.context, a.dtypes, a.steps, a.pages)
        base_name = next(iter(times))                          # the first dtype and page kind
        base = statistics.median(times[base_name])
        path = "fused C layers" if model.plan and model.plan.use_decode_layer(b) else "per op"
        for name, ts in times.items():
            med = statistics.median(ts)
            rows.append({"batch": b, "context": a.context, "threads": a.threads,
                         "kv_dtype": name, "tok_s": b / med, "ms_step": med * 1e3,
                         "x_base": base / med, "kv_mib": nbytes[name] / 2**20, "path": path,
                         "steps_ms": [t * 1e3 for t in ts]})
    common.table(rows, ["batch", "kv_dtype", "tok_s", "ms_step", "x_base", "kv_mib", "path"],
                 f"# {common.machine()}\ndecode, {a.context}-token contexts, {a.threads} threads "
                 f"(x_base: tok/s relative to {base_name})")
    common.save("benchmark_kv_dtype", {"rows": rows, "args": vars(a)},
                ratio_plot(rows, base_name))


if __name__ == "__main__":
    main()
