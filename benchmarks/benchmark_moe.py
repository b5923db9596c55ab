"""Mixture of experts: decode throughput of a Qwen3-MoE GGUF on this engine against llama.cpp and
transformers, and KV capacity at the gpt-oss-20b shape.

decode    A Qwen3-MoE with Qwen3-30B-A3B's layer shape (hidden 2,048, 32 heads, 4 KV heads x 128,
          128 experts, 8 per token, expert intermediate 768, norm_topk_prob, vocabulary 151,936,
          rope theta 1e6, RMS eps 1e-6) but --layers layers (default 2), random seeded weights
          (routers included, so each token's 8 picks spread over the 128 experts), saved by
          transformers as float32 with the default model's tokenizer (SmolLM2's BPE: the
          converter pads the vocabulary to 151,936 with unused tokens), converted by llama.cpp's
          convert_hf_to_gguf.py (--outtype f32; from $LLAMA_CPP_SRC, default the copy `make
          install` puts in the venv) and quantized by DIR/bin/llama-quantize to each of --formats
          (Q4_0, Q8_0; f32 is the converter's file). All of it is made once under --workdir and
          reused (the F32 intermediate is dropped unless f32 is asked for); the engine's own
          conversion of each GGUF lands in its cache root.
          Per format the engine runs LLM(file) with its defaults (quantization auto) and takes
          turns with llama-batched-bench on the same file, same prompt length, new tokens and
          threads: --rounds ABBA pairs per batch, vs_llamacpp the median of the per-pair ratios
          (benchmark_throughput.take_turns / peer_summary, as benchmark_families.py). tok/s =
          generated tokens / wall time including prefill (llama.cpp B * new / T). transformers
          `generate` runs the float32 checkpoint once per batch of --hf-batches. Targets
          (benchmark_families.TARGETS): >= 1.0x llama.cpp at batch 1, >= 1.2x at 16 and 32
          (moonshot 1.5x / 2x); each JSON row says whether it meets them.
capacity  benchmark_hybrid_capacity.run_shape at the gpt-oss-20b shape (--load-format simulate:
          24 layers alternating sliding window 128 / full, 8 KV heads x 64, 32 experts, sinks):
          the largest stall-free concurrency at equal KV memory for Native in one group, Native
          with hybrid KV groups, and vToken (H2O 0.5) with groups, at --scale of the paper's
          1,008 + 12,288 tokens and 40 GiB.

    python benchmarks/benchmark_moe.py --threads 2 --llamacpp /work/llamacpp --rounds 3
    python benchmarks/benchmark_moe.py --parts capacity --scale 0.125
    python benchmarks/benchmark_moe.py --quick --llamacpp DIR     # batch 1, 32 + 16 tokens, Q4_0
"""
import gc
import os
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchmark_families as families  # noqa: E402
import benchmark_hybrid_capacity as hybrid  # noqa: E402
import benchmark_throughput as throughput  # noqa: E402
import common  # noqa: E402
from benchmark_refactor import REPO, describe  # noqa: E402

# llama.cpp's converter: `make install` unpacks it into the venv (Makefile, LLAMA_CPP_VERSION)
CONVERTER = os.path.join(os.environ.get("LLAMA_CPP_SRC", os.path.join(sys.prefix, "llama.cpp")),
                         "convert_hf_to_gguf.py")
FORMATS = ("q4_0", "q8_0", "f32")
# --shape -> Qwen3MoeConfig fields (vocab None: the tokenizer's)
SHAPES = {
    "qwen3-30b-a3b": dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, intermediate_size=6144, num_experts=128,
                          num_experts_per_tok=8, moe_intermediate_size=768, vocab_size=151936,
                          max_position_embeddings=40960),
    "tiny": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=96, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32, vocab_size=None, max_position_embeddings=4096),
}


# ---- the model and its GGUFs ------------------------------------------------------------------
def checkpoint(workdir: str, shape: str, layers: int, seed: int) -> str:
    """WORKDIR/hf: the random float32 Qwen3-MoE and its tokenizer, written once (atomically)."""
    import transformers
    path = os.path.join(workdir, "hf")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    tok = common.tokenizer_for(None)                # SmolLM2's BPE, from the default model
    fields = dict(SHAPES[shape])
    fields["vocab_size"] = fields["vocab_size"] or len(tok)
    cfg = transformers.Qwen3MoeConfig(
        **fields, num_hidden_layers=layers, norm_topk_prob=True, rms_norm_eps=1e-6,
        tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    print(f"writing {path}: random Qwen3-MoE, {shape} shape, {layers} layers", flush=True)
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(cfg).float()
    tmp = f"{path}.tmp-{os.getpid()}"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    del model
    gc.collect()
    os.replace(tmp, path)
    return path


def gguf_file(workdir: str, hf_dir: str, fmt: str, llamacpp: str, threads: int) -> str:
    """WORKDIR/model-<FMT>.gguf: f32 by llama.cpp's converter, the others by llama-quantize."""
    dst = os.path.join(workdir, f"model-{fmt.upper()}.gguf")
    if os.path.exists(dst):
        return dst
    tmp = f"{dst}.tmp-{os.getpid()}"
    if fmt == "f32":
        if not os.path.isfile(CONVERTER):
            raise FileNotFoundError(f"{CONVERTER} not found (set LLAMA_CPP_SRC to a llama.cpp "
                                    f"source tree)")
        env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}   # its gguf-py
        cmd = [sys.executable, CONVERTER, "--outtype", "f32", "--outfile", tmp, hf_dir]
    else:
        if not llamacpp:
            raise SystemExit(f"{fmt}: {dst} is not made yet and needs llama-quantize: pass "
                             f"--llamacpp DIR (or --formats f32)")
        env = None
        cmd = [common.llamacpp_binary(llamacpp, "llama-quantize"),
               gguf_file(workdir, hf_dir, "f32", llamacpp, threads), tmp, fmt.upper(),
               str(threads)]
    print(" ".join(cmd), flush=True)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        if os.path.exists(tmp):
            os.remove(tmp)
        tool = os.path.basename(cmd[1 if fmt == "f32" else 0])
        raise RuntimeError(f"{tool} failed:\n{(r.stdout + r.stderr)[-3000:]}")
    os.replace(tmp, dst)
    return dst


def model_files(args) -> dict:
    """{"hf": checkpoint dir, fmt: gguf path}; the F32 intermediate dropped once quantized."""
    os.makedirs(args.workdir, exist_ok=True)
    files = {"hf": checkpoint(args.workdir, args.shape, args.layers, args.seed)}
    for fmt in args.formats:
        files[fmt] = gguf_file(args.workdir, files["hf"], fmt, args.llamacpp, args.threads)
    f32 = os.path.join(args.workdir, "model-F32.gguf")
    if "f32" not in args.formats and os.path.exists(f32):
        os.remove(f32)
    return files


# ---- decode -----------------------------------------------------------------------------------
def hf_rates(hf_dir: str, prompts, batches, new_tokens: int) -> dict:
    """batch -> (tok/s, seconds) of transformers generate on the float32 checkpoint; the model
    is freed before the engines load."""
    import transformers
    if not batches:
        return {}
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    throughput.hf_generate(hf, prompts[:1], 4)              # warm-up
    out = {}
    for b in batches:
        t = throughput.hf_generate(hf, prompts[:b], new_tokens)
        out[b] = (b * new_tokens / t, t)
        print(f"  batch {b} transformers: {out[b][0]:.1f} tok/s", flush=True)
    del hf
    gc.collect()
    return out


def format_rows(fmt: str, gguf: str, prompts, hf: dict, args, peer: dict):
    """The rows of one GGUF format: the engine (LLM(file), its defaults) per batch, in turns
    with llama.cpp on the same file. -> (rows, how the engine ran)."""
    from vllm import LLM
    from vllm.kernels import cpu_kernel_plan
    llm = LLM(gguf, max_num_seqs=max(args.batches))
    quantization = getattr(llm.llm_engine.model_config, "quantization", None)
    engine = {"quantization": quantization, "weights": families.weight_format(llm, quantization),
              "kernel_plan": cpu_kernel_plan.decisions()}
    print(f"{fmt}: engine weights {engine['weights']}", flush=True)
    common.generate(llm, [(prompts[0], 8)])                 # warm-up
    rows = []
    for b in args.batches:
        work = [(q, args.new_tokens) for q in prompts[:b]]
        engine_s, peer_rows = throughput.take_turns(
            llm, work, args.rounds, args.llamacpp, gguf, args.prompt_len, args.threads, peer,
            lambda who, tok_s, b=b: print(f"  {fmt} batch {b} {who}: {tok_s:.1f} tok/s",
                                          flush=True))
        new, t = b * args.new_tokens, statistics.median(engine_s)
        row = {"format": fmt, "batch": b, "engine_tok_s": new / t, "engine_s": t,
               "engine_rounds_tok_s": [new / s for s in engine_s]}
        if b in hf:
            row.update({"hf_tok_s": hf[b][0], "hf_s": hf[b][1], "vs_hf": hf[b][1] / t})
        if args.llamacpp:
            row.update(throughput.peer_summary(peer_rows, row["engine_rounds_tok_s"], b))
            target, moonshot = families.TARGETS.get(b, (None, None))
            row.update({"target": target, "moonshot": moonshot,
                        "meets_target": None if target is None else row["vs_llamacpp"] >= target,
                        "meets_moonshot": None if moonshot is None
                        else row["vs_llamacpp"] >= moonshot})
        rows.append(row)
    del llm
    gc.collect()
    return rows, engine


def plot_decode(rows, formats, title: str):
    pyplot = common.plt()
    fig, axes = pyplot.subplots(1, len(formats), figsize=(4.2 * len(formats), 3.4), squeeze=False)
    for ax, fmt in zip(axes[0], formats):
        sub = [r for r in rows if r["format"] == fmt]
        series = [(k, label) for k, label in (
            ("engine_tok_s", "vllm (this fork), LLM(file)"),
            ("llamacpp_tok_s", "llama.cpp, same GGUF"),
            ("hf_tok_s", "transformers, float32")) if any(k in r for r in sub)]
        width = 0.8 / len(series)
        for k, (key, label) in enumerate(series):
            off = (k - (len(series) - 1) / 2) * width
            ax.bar([i + off for i in range(len(sub))], [r.get(key, 0) for r in sub], width,
                   label=label)
        for i, r in enumerate(sub):
            if "vs_llamacpp" in r:
                ax.annotate(f"{r['vs_llamacpp']:.2f}x", (i - (len(series) - 1) / 2 * width,
                                                         r["engine_tok_s"]),
                            ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(sub)), [f"batch {r['batch']}" for r in sub])
        ax.set_title(fmt.upper(), fontsize=9)
        ax.set_ylim(0, 1.45 * max(r.get(k, 0) for r in sub for k, _ in series))
        ax.legend(fontsize=6.5, loc="upper left")
    axes[0][0].set_ylabel("generated tokens/s (incl. prefill)")
    fig.suptitle(title, fontsize=8, y=1.04)
    return fig


def run_decode(args, save):
    files = model_files(args)
    tok = common.tokenizer_for(files["hf"])
    prompts = common.fixed_length_prompts(tok, max(args.batches), args.prompt_len, args.seed)
    peer = {}
    if args.llamacpp:                       # fail early: the binary before the long runs
        binary = common.llamacpp_binary(args.llamacpp, "llama-batched-bench")
        peer = {"version": common.llamacpp_version(binary),
                "build": common.llamacpp_build(args.llamacpp), "formats": {}}
        print(f"llama.cpp {peer['version']} ({peer['build']})", flush=True)
    hf = hf_rates(files["hf"], prompts, [b for b in args.batches if b in args.hf_batches],
                  args.new_tokens)
    rows, engines = [], {}
    for fmt in args.formats:
        fmt_peer = {"gguf": files[fmt]}
        fmt_rows, engines[fmt] = format_rows(fmt, files[fmt], prompts, hf, args, fmt_peer)
        rows += fmt_rows
        if peer:
            peer["formats"][fmt] = fmt_peer
    cols = ["format", "batch", "engine_tok_s"]
    if args.llamacpp:
        cols += ["llamacpp_tok_s", "llamacpp_decode_tok_s", "vs_llamacpp", "vs_llamacpp_min",
                 "target", "meets_target"]
    if hf:
        cols += ["hf_tok_s", "vs_hf"]
    label = (f"Qwen3-MoE, {args.shape} layer shape x {args.layers} layers, random weights, "
             f"{args.prompt_len}-token prompts + {args.new_tokens} new tokens")
    title = (f"{label}, generated tokens/s incl. prefill, greedy ({common.machine()}); engine "
             f"LLM(file) defaults: " + "; ".join(f"{f} {e['weights']}" for f, e in engines.items()))
    if args.llamacpp:
        title += (f"\nllama.cpp ({peer['build']}): llama-batched-bench on the same GGUF, "
                  f"{args.threads} threads, {args.rounds} ABBA rounds per batch; vs_llamacpp = "
                  f"median of the per-round ratios, vs_llamacpp_min the lowest")
    if hf:
        title += "\ntransformers generate on the float32 checkpoint, once per batch"
    text = common.table(rows, cols, title)
    info = common.cpu_info()
    fig = plot_decode(rows, args.formats, f"{label}\n{info['cpu']}, {args.threads} threads, "
                                          f"C kernels {info['isa']}")
    save("benchmark_moe_decode", {
        "model": label, "files": files, "engines": engines, "rows": rows, "table": text,
        "formats": args.formats, "batches": args.batches, "hf_batches": sorted(hf),
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "rounds": args.rounds,
        "threads": args.threads, "llamacpp": peer or None,
        "targets": {str(b): {"target": t, "moonshot": m}
                    for b, (t, m) in families.TARGETS.items()}}, fig)
    return rows


# ---- capacity ---------------------------------------------------------------------------------
CAPACITY_COLS = ["shape", "prompt", "output", "memory MiB", "Native, one group", "Native, groups",
                 "vToken, groups", "ideal (groups)", "vToken / Native (groups)",
                 "Native, one group KV B/token", "Native, groups KV B/token",
                 "Native, groups sliding blocks/req"]


def run_capacity(args, save):
    t0 = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t0:6.0f}s] {msg}", flush=True)

    hyb = SimpleNamespace(scale=args.scale, quick=args.quick, memory_gib=args.memory_gib,
                          max_c=args.max_c, seed=args.seed)
    row = hybrid.run_shape("gpt-oss-20b", hyb, log)
    text = common.table([row], CAPACITY_COLS, "Capacity frontier (max concurrency, all resident, "
                        "stall-free, no preemption) at equal KV memory, gpt-oss-20b shape, H2O "
                        f"0.5, bf16 KV, block {hybrid.BLOCK}, --load-format simulate; "
                        f"{common.machine()}")
    pyplot = common.plt()
    fig, ax = pyplot.subplots(figsize=(4.6, 3.0))
    names = ["Native, one group", "Native, groups", "vToken, groups", "ideal (groups)"]
    bars = ax.bar(range(len(names)), [row.get(n, 0) for n in names],
                  color=["C0", "C1", "C2", "C7"])
    ax.bar_label(bars, fontsize=7)
    ax.set_xticks(range(len(names)), [n.replace(", ", "\n") for n in names], fontsize=7)
    ax.set_ylabel("max concurrency, stall-free")
    ax.set_title(f"gpt-oss-20b shape (simulate), {row['prompt']} + {row['output']} tokens, "
                 f"{row['memory MiB']:.0f} MiB KV", fontsize=8)
    save("benchmark_moe_capacity", {"row": row, "table": text, "scale": hyb.scale or
                                    (1 / 16 if args.quick else 0.125),
                                    "seconds": time.perf_counter() - t0}, fig)
    return row


def main():
    p = common.base_parser(__doc__)
    p.add_argument("--parts", nargs="+", default=["decode", "capacity"],
                   choices=["decode", "capacity"])
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default %(default)s)")
    p.add_argument("--formats", nargs="+", default=None, choices=FORMATS,
                   help="GGUF formats (default q4_0 q8_0; --quick q4_0)")
    p.add_argument("--workdir", default=None, help="where the checkpoint and GGUFs are kept "
                   "(default ~/.cache/vllm/bench-moe/<shape>-<layers>L-seed<seed>)")
    p.add_argument("--batches", type=int, nargs="+", default=None,
                   help="batch sizes (default 1 16 32; --quick 1)")
    p.add_argument("--hf-batches", type=int, nargs="*", default=[1, 16, 32],
                   help="batch sizes transformers runs too (none: skip it)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 128 (--quick 32)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 128 (--quick 16)")
    p.add_argument("--rounds", type=int, default=None,
                   help="engine runs per batch, with --llamacpp each paired with a "
                        "llama-batched-bench run in ABBA order (default 3, --quick 1)")
    p.add_argument("--llamacpp", metavar="DIR", default=None,
                   help="llama.cpp build: DIR/bin/llama-batched-bench (the peer) and "
                        "llama-quantize (makes the Q4_0 / Q8_0 files)")
    p.add_argument("--scale", type=float, default=None, help="capacity: length and memory "
                   "scale (default 0.125, --quick 1/16)")
    p.add_argument("--memory-gib", type=float, default=40.0, help="capacity: KV memory at scale 1")
    p.add_argument("--max-c", type=int, default=400, help="capacity: requests available")
    p.add_argument("--out", default=common.RESULTS, help="folder for the JSON and PNG files")
    args = p.parse_args()
    args.formats = args.formats or (["q4_0"] if args.quick else ["q4_0", "q8_0"])
    args.batches = args.batches or ([1] if args.quick else [1, 16, 32])
    args.prompt_len = args.prompt_len or (32 if args.quick else 128)
    args.new_tokens = args.new_tokens or (16 if args.quick else 128)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.workdir = os.path.expanduser(args.workdir or os.path.join(
        "~/.cache/vllm/bench-moe", f"{args.shape}-{args.layers}L-seed{args.seed}"))
    common.setup(args)
    print(common.machine())
    revision = describe(REPO)
    print(f"this checkout: {revision['short']} {revision['subject'][:80]}"
          + (f" + uncommitted {revision['dirty_files']}" if revision["dirty_files"] else ""))

    def save(name, data, fig):
        results, common.RESULTS = common.RESULTS, args.out      # common.save writes there
        try:
            common.save(name, {"args": vars(args), "revision": revision, **data}, fig)
        finally:
            common.RESULTS = results

    if "decode" in args.parts:
        run_decode(args, save)
    if "capacity" in args.parts:
        run_capacity(args, save)


if __name__ == "__main__":
    main()
