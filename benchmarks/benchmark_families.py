"""Decode throughput of a model family's GGUF: this engine against llama.cpp on the same file and
transformers on its float32 checkpoint.

--model gemma3-270m (the default) is Google's Gemma 3 270M in Q4_K_M (Q4_K / Q6_K / Q5_0 / Q8_0
tensors; find_gemma3_gguf). The engine runs it as `LLM(file)` with its defaults (quantization
auto: the blocks natively, the float32 twin where the kernel plan finds it faster); llama.cpp's
`llama-batched-bench` runs the same file with the same prompt length, new tokens and threads;
transformers `generate` runs the float32 checkpoint our converter makes of it (the directory
`LLM(file, quantization="none")` loads). --model also takes a .gguf path, or a model directory
(engine and transformers only: llama.cpp needs a GGUF; the test's tiny random Gemma 3).

Per batch size: transformers once, then --rounds pairs of engine and llama.cpp taking turns in
ABBA order (benchmark_throughput.py's helpers: common.abba_order, run_llamacpp, peer_summary).
tok/s is generated tokens / wall time including prefill (greedy, ignore_eos), for llama.cpp
B * new_tokens / T; vs_llamacpp is the median of the per-pair ratios engine / llama.cpp, with
the lowest beside it, so a host whose bandwidth drifts moves both sides of a ratio alike.
Targets (the Gemma 3 issue): >= 1.0x llama.cpp at batch 1, >= 1.2x at 16 and 32 (moonshot
1.5x / 2x); the JSON's rows say which are met.

    python benchmarks/benchmark_families.py --threads 2 --llamacpp /work/llamacpp
    python benchmarks/benchmark_families.py --threads 2 --llamacpp DIR --batches 1 16 32 --rounds 3
    python benchmarks/benchmark_families.py --quick              # batch 1, 32 + 16 tokens
"""
import os
import re
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchmark_throughput as throughput  # noqa: E402
import common  # noqa: E402
from benchmark_refactor import REPO, describe  # noqa: E402


def _gemma3_270m() -> str:
    from vllm.model_executor.gguf_loader import find_gemma3_gguf
    return find_gemma3_gguf()


# --model name -> (label, short tag for the output names, the GGUF's finder)
MODELS = {"gemma3-270m": ("Gemma 3 270M Q4_K_M", "gemma3", _gemma3_270m)}
# batch -> (target, moonshot) as engine / llama.cpp tok/s
TARGETS = {1: (1.0, 1.5), 16: (1.2, 2.0), 32: (1.2, 2.0)}


def resolve(model: str):
    """--model -> (gguf path or None, engine model argument, float32 dir, label, tag)."""
    from vllm.model_executor.gguf_loader import resolve_model
    if model in MODELS:
        label, tag, finder = MODELS[model]
        gguf = finder()
        return gguf, gguf, resolve_model(gguf), label, tag
    path = os.path.abspath(os.path.expanduser(model))
    name = os.path.basename(path.rstrip("/"))
    tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", name[:-5] if name.lower().endswith(".gguf") else name)
    if path.lower().endswith(".gguf"):
        return path, path, resolve_model(path), os.path.basename(path), tag
    if os.path.isdir(path):
        return None, path, path, f"{os.path.basename(path)} (directory)", tag
    raise SystemExit(f"--model: {model!r} is neither one of {sorted(MODELS)} nor a .gguf file "
                     f"or model directory")


def weight_format(llm, quantization: str) -> str:
    """What the engine's GEMMs run on, by batch: quantization auto keeps the float32 twin for the
    row counts from the load-time crossover (CpuDecodeModel.quant_below) on."""
    from vllm.model_executor.bf16_linear import BF16Linear
    from vllm.model_executor.quant_linear import QuantLinear
    model = llm.llm_engine.model_executor.driver_worker.model
    below = getattr(model, "quant_below", 0)
    if quantization != "gguf":
        return "float32"
    if getattr(model, "quant_layers", None) is not None and below:
        return f"GGUF blocks below {below} rows, float32 from {below}"
    if any(isinstance(m, (QuantLinear, BF16Linear)) for m in model.layers[0].modules()):
        return "GGUF blocks at every batch size"
    return "float32 at every batch size (the crossover dropped the blocks)"


def plot(rows, title: str, with_hf: bool, with_peer: bool):
    pyplot = common.plt()
    fig, ax = pyplot.subplots(figsize=(5.8, 3.4))
    series = [("engine_tok_s", "vllm (this fork), LLM(file) defaults")]
    if with_peer:
        series.append(("llamacpp_tok_s", "llama.cpp, same GGUF (incl. prefill)"))
    if with_hf:
        series.append(("hf_tok_s", "transformers generate, float32"))
    x = list(range(len(rows)))
    width = 0.8 / len(series)
    for k, (key, label) in enumerate(series):
        off = (k - (len(series) - 1) / 2) * width
        ax.bar([i + off for i in x], [r[key] for r in rows], width, label=label)
    top = max(r[key] for r in rows for key, _ in series)
    if with_peer:
        off = -(len(series) - 1) / 2 * width            # over the engine's bar
        for i, r in zip(x, rows):
            ax.annotate(f"{r['vs_llamacpp']:.2f}x\n(min {r['vs_llamacpp_min']:.2f})",
                        (i + off, r["engine_tok_s"]), ha="center", va="bottom", fontsize=6.5,
                        xytext=(0, 2), textcoords="offset points")
        off = (1 - (len(series) - 1) / 2) * width
        ax.plot([i + off for i in x], [r["llamacpp_decode_tok_s"] for r in rows], "k_", ms=10,
                mew=2, ls="none", label="llama.cpp decode-only (S_TG)")
        top = max(top, *(r["llamacpp_decode_tok_s"] for r in rows))
    ax.set_xticks(x, [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("generated tokens/s")
    ax.set_title(title, fontsize=8.5)
    ax.set_ylim(0, 1.5 * top)                           # room for the legend
    ax.legend(fontsize=7, loc="upper left")
    return fig


def main():
    p = common.base_parser(__doc__)
    model = next(a for a in p._actions if a.dest == "model")        # base_parser's, ours
    model.default = "gemma3-270m"
    model.help = (f"one of {sorted(MODELS)} (default %(default)s), a .gguf file or a model "
                  f"directory (no llama.cpp then)")
    p.add_argument("--batches", type=int, nargs="+", default=None,
                   help="batch sizes (default 1 16 32; --quick 1)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 128 (--quick 32)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 128 (--quick 16)")
    p.add_argument("--rounds", type=int, default=None,
                   help="engine runs per batch, with --llamacpp each paired with a "
                        "llama-batched-bench run (ABBA order) (default 3, --quick 1)")
    p.add_argument("--llamacpp", metavar="DIR", default=None,
                   help="llama.cpp build with DIR/bin/llama-batched-bench (build_llamacpp.sh)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--out", default=common.RESULTS, help="folder for the JSON and PNG "
                                                         "(default %(default)s)")
    args = p.parse_args()
    batches = args.batches or ([1] if args.quick else [1, 16, 32])
    prompt_len = args.prompt_len or (32 if args.quick else 128)
    new_tokens = args.new_tokens or (16 if args.quick else 128)
    rounds = args.rounds or (1 if args.quick else 3)
    common.setup(args)
    gguf, engine_model, f32_dir, label, tag = resolve(args.model)
    if args.llamacpp and gguf is None:
        p.error("--llamacpp needs a GGUF --model (llama.cpp runs the same file)")
    import transformers
    from vllm import LLM
    from vllm.kernels import cpu_kernel_plan
    print(common.machine())
    revision = describe(REPO)
    print(f"this checkout: {revision['short']} {revision['subject'][:80]}"
          + (f" + uncommitted {revision['dirty_files']}" if revision["dirty_files"] else ""))
    peer = {}
    if args.llamacpp:                       # fail early: the binary before the long runs
        binary = common.llamacpp_binary(args.llamacpp, "llama-batched-bench")
        peer = {"gguf": gguf, "version": common.llamacpp_version(binary),
                "build": common.llamacpp_build(args.llamacpp)}
        print(f"llama.cpp {peer['version']} ({peer['build']})")
    llm = LLM(engine_model, max_num_seqs=max(batches))
    plan = cpu_kernel_plan.decisions()
    if plan:
        print(f"kernel plan ({plan['source']}): {cpu_kernel_plan.summary(plan)}")
    config = llm.llm_engine.model_config
    quantization = getattr(config, "quantization", None)
    weights = weight_format(llm, quantization)
    print(f"engine weights: {weights}")
    tok = llm.get_tokenizer()
    prompts = common.fixed_length_prompts(tok, max(batches), prompt_len, args.seed)
    common.generate(llm, [(prompts[0], 8)])                 # warm-up
    hf = None
    if not args.no_hf:
        hf = transformers.AutoModelForCausalLM.from_pretrained(f32_dir,
                                                               dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
        throughput.hf_generate(hf, prompts[:1], 8)
    rows = []
    for b in batches:
        work = [(q, new_tokens) for q in prompts[:b]]
        new = b * new_tokens
        row = {"batch": b}
        if hf is not None:
            t_hf = throughput.hf_generate(hf, prompts[:b], new_tokens)
            row.update({"hf_tok_s": new / t_hf, "hf_s": t_hf})
        engine_s, peer_rows = throughput.take_turns(
            llm, work, rounds, args.llamacpp, gguf, prompt_len, args.threads, peer,
            lambda who, tok_s, b=b: print(f"  batch {b} {who}: {tok_s:.1f} tok/s", flush=True))
        t_engine = statistics.median(engine_s)
        row.update({"engine_tok_s": new / t_engine, "engine_s": t_engine,
                    "engine_rounds_tok_s": [new / t for t in engine_s]})
        if hf is not None:
            row["vs_hf"] = t_hf / t_engine
        if args.llamacpp:
            row.update(throughput.peer_summary(peer_rows, row["engine_rounds_tok_s"], b))
            target, moonshot = TARGETS.get(b, (None, None))
            row.update({"target": target, "moonshot": moonshot,
                        "meets_target": None if target is None else row["vs_llamacpp"] >= target})
        rows.append(row)
    cols = ["batch", "engine_tok_s"]
    if args.llamacpp:
        cols += ["llamacpp_tok_s", "llamacpp_decode_tok_s", "vs_llamacpp", "vs_llamacpp_min",
                 "target"]
    if hf is not None:
        cols += ["hf_tok_s", "vs_hf"]
    info = common.cpu_info()
    title = (f"{label}: {prompt_len}-token prompts + {new_tokens} new tokens, generated tokens/s "
             f"incl. prefill, greedy ({common.machine()}); engine LLM(model) quantization "
             f"{quantization}: {weights}")
    if args.llamacpp:
        title += (f"\nllama.cpp ({peer['build']}): llama-batched-bench on the same GGUF, "
                  f"{args.threads} threads, {rounds} rounds per batch taking turns with the engine "
                  f"(ABBA); llamacpp_tok_s = B*{new_tokens}/T incl. prefill (median), decode = "
                  f"S_TG; vs_llamacpp = median of the per-round ratios engine / llama.cpp, "
                  f"vs_llamacpp_min the lowest; target from the issue")
    if hf is not None:
        title += "\ntransformers generate on the float32 checkpoint, once per batch"
    text = common.table(rows, cols, title)
    fig = plot(rows, f"{label}, {prompt_len}+{new_tokens} tokens, {info['cpu']}, "
                     f"{args.threads} threads, C kernels {info['isa']}", hf is not None,
               bool(args.llamacpp))
    results, common.RESULTS = common.RESULTS, args.out     # common.save writes there
    try:
        common.save(f"benchmark_families_{tag}",
                    {"args": vars(args), "revision": revision, "model": label, "gguf": gguf,
                     "float32_dir": f32_dir, "weights": weights,
                     "quantization": quantization, "batches": batches, "prompt_len": prompt_len,
                     "new_tokens": new_tokens, "rounds": rounds, "threads": args.threads,
                     "rows": rows, "table": text, "kernel_plan": plan, "llamacpp": peer or None,
                     "targets": {str(b): {"target": t, "moonshot": m}
                                 for b, (t, m) in TARGETS.items()}},
                    fig)
    finally:
        common.RESULTS = results


if __name__ == "__main__":
    main()
