"""Offline throughput: this engine vs transformers `generate`, same model, prompts and batch.

All run greedy decoding of exactly --output-len new tokens for --prompt-len-token prompts (cut
from ShareGPT, so no padding is needed), in one process, one after the other per batch size:
the engine, the same engine on its torch path (C kernels off, as VLLM_KERNEL_BACKEND=torch),
and transformers.

The engine runs --rounds times per batch size and its median time is reported. With
--llamacpp DIR, llama.cpp's `llama-batched-bench` runs the same prompt length, output length and
thread count on an F32 GGUF of the default model (the same dequantized weights the engine
uses), one batch size at a time, taking turns with the engine: per batch, the torch path and
transformers once, then --rounds pairs of engine and llama.cpp in ABBA order. A shared host's
memory bandwidth drifts by half between minutes (batch 1 on the AMD EPYC host: 40-58 tok/s for
the engine, 39-47 for llama.cpp within four minutes), so vs_llamacpp is the median of the
per-pair ratios, with the lowest beside it. llama.cpp's comparable figure is generated tokens /
total time including prefill, B * output_len / T; its decode-only S_TG is shown beside it.

--weights FORMAT (q4_1, q4_0, q8_0, bf16; default f32) runs the engine with --quantization gguf
on a GGUF of that format and llama.cpp on the same file: the shipped Q4_1 file, or Q4_0 / Q8_0 /
BF16 files requantized from it (common.requantized); the torch-path and transformers columns are
float32 only and are left out. The engine's KV cache is what --kv-cache-dtype auto gives it:
bf16 for a GGUF format (16 bits, as llama.cpp's own default f16), float32 for f32;
--kv-cache-dtype float32 / bfloat16 / fp8 sets it for every run.

    python benchmarks/benchmark_throughput.py            # batch 1, 16, 32
    python benchmarks/benchmark_throughput.py --quick    # batch 1, 16
    python benchmarks/benchmark_throughput.py --threads 2 --batch-sizes 1 8 16 32 --llamacpp DIR
    python benchmarks/benchmark_throughput.py --threads 2 --llamacpp DIR --weights q4_1
    python benchmarks/benchmark_throughput.py --threads 2 --llamacpp DIR --weights q4_0 \
        --kv-cache-dtype float32
"""
import statistics
import subprocess
import time

import torch

import common


prompts = common.fixed_length_prompts

# llama-batched-bench's markdown table: header name -> our key
BATCHED_BENCH_COLUMNS = {"PP": "pp", "TG": "tg", "B": "b", "N_KV": "n_kv", "T_PP s": "t_pp_s",
                         "S_PP t/s": "s_pp", "T_TG s": "t_tg_s", "S_TG t/s": "s_tg",
                         "T s": "t_s", "S t/s": "s"}


def parse_batched_bench(text: str):
    """(rows, settings) from llama-batched-bench's output: one dict per table row with the keys
    of BATCHED_BENCH_COLUMNS, and the '...: n_kv_max = ..., n_threads = ...' line as a dict."""
    settings, rows, header = {}, [], None
    for line in text.splitlines():
        line = line.strip()
        _, _, rest = line.partition(": ")
        if rest.startswith("n_kv_max ="):            # 'main: ' or 'llama_batched_bench: '
            for item in rest.split(","):
                key, _, value = item.partition("=")
                if value:
                    settings[key.strip()] = value.strip()
            continue
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if "S_TG t/s" in cells and "PP" in cells:
            header = cells
        elif header and len(cells) == len(header) and not set("".join(cells)) <= set("-: "):
            row = {}
            for name, cell in zip(header, cells):
                if name in BATCHED_BENCH_COLUMNS:
                    num = float(cell)
                    row[BATCHED_BENCH_COLUMNS[name]] = int(num) if num.is_integer() and \
                        name in ("PP", "TG", "B", "N_KV") else num
            rows.append(row)
    return rows, settings


def run_llamacpp(llamacpp_dir: str, gguf: str, batches, prompt_len: int, output_len: int,
                 threads: int):
    """llama-batched-bench with the engine rows' settings -> {batch: row}, command, settings."""
    binary = common.llamacpp_binary(llamacpp_dir, "llama-batched-bench")
    ctx = max(12000, max(batches) * (prompt_len + output_len) + 256)
    cmd = [binary, "-m", gguf, "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp",
           str(prompt_len), "-ntg", str(output_len), "-npl", ",".join(map(str, batches)),
           "-t", str(threads)]
    print("llama.cpp:", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    out = r.stdout + "\n" + r.stderr
    rows, settings = parse_batched_bench(out)
    if r.returncode != 0 or not rows:
        raise RuntimeError(f"llama-batched-bench failed (rc {r.returncode}):\n{out[-3000:]}")
    settings["system_info"] = common.llamacpp_system_info(out)
    by_batch = {row["b"]: row for row in rows}
    missing = [b for b in batches if b not in by_batch]
    if missing:
        raise RuntimeError(f"llama-batched-bench gave no row for batch {missing}:\n{out[-3000:]}")
    return by_batch, cmd, settings


def peer_summary(peer_rows, engine_tok_s, batch: int):
    """llama.cpp's columns of one batch row from its rounds (llama-batched-bench rows) and the
    engine's tok/s in the same rounds, paired in order: medians, and the per-pair ratios."""
    tok_s = [batch * r["tg"] / r["t_s"] for r in peer_rows]     # incl. prefill, like ours
    pairs = [ours / theirs for ours, theirs in zip(engine_tok_s, tok_s)]
    return {"llamacpp_tok_s": statistics.median(tok_s),
            "llamacpp_decode_tok_s": statistics.median(r["s_tg"] for r in peer_rows),
            "vs_llamacpp": statistics.median(pairs), "vs_llamacpp_min": min(pairs),
            "vs_llamacpp_rounds": pairs, "llamacpp_rounds_tok_s": tok_s,
            "llamacpp_s": statistics.median(r["t_s"] for r in peer_rows),
            "llamacpp_raw": peer_rows}


def take_turns(llm, work, rounds: int, llamacpp_dir, gguf: str, prompt_len: int,
               threads: int, peer: dict, say=None):
    """`rounds` engine runs of `work` (one batch of (prompt, new tokens)) and, with a llama.cpp
    dir, as many llama-batched-bench runs of that batch on `gguf`, in ABBA order (the other
    idles meanwhile); llama.cpp's commands and settings land in `peer`. -> (engine seconds per
    round, llama.cpp's row per round). say(who, tok_s): a line per round, or None."""
    b, new_tokens = len(work), work[0][1]
    engine_s, peer_rows = [], []
    order = common.abba_order(rounds, "engine", "llamacpp") if llamacpp_dir \
        else ["engine"] * rounds
    for who in order:
        if who == "engine":
            engine_s.append(common.generate(llm, work)[1])
            if say:
                say("engine", b * new_tokens / engine_s[-1])
            continue
        by_batch, command, peer["settings"] = run_llamacpp(
            llamacpp_dir, gguf, [b], prompt_len, new_tokens, threads)
        peer.setdefault("commands", []).append(command)
        peer_rows.append(by_batch[b])
        if say:
            say("llama.cpp", b * new_tokens / by_batch[b]["t_s"])
    return engine_s, peer_rows


def hf_generate(model, batch, output_len: int) -> float:
    ids = torch.tensor(batch)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=0)
    assert out.shape[1] == ids.shape[1] + output_len
    return time.perf_counter() - t0


def main():
    p = common.base_parser(__doc__)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=None,
                   help="engine runs per batch size, with --llamacpp each paired with a "
                        "llama-batched-bench run (ABBA order); medians reported (default 3, "
                        "--quick 1)")
    p.add_argument("--weights", default="f32", choices=common.WEIGHT_FORMATS,
                   help="the default model's weight format, the same GGUF file for the engine "
                        "(--quantization gguf) and llama.cpp")
    p.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "fp8"],
                   help="the engine's KV cache (llama.cpp keeps its default f16)")
    common.add_llamacpp_args(p, "llama-batched-bench, one batch size at a time, taking turns "
                                "with the engine")
    args = p.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    if (args.llamacpp or args.weights != "f32") and args.model not in (None, "", "default"):
        p.error("--llamacpp and --weights compare on the default model only; drop --model")
    common.setup(args)
    import transformers
    from vllm import LLM
    from vllm.kernels import cpu_kernel_plan
    from vllm.kernels import ops
    from vllm.model_executor.gguf_loader import resolve_model
    batches = args.batch_sizes or ([1, 16] if args.quick else [1, 16, 32])
    model_dir = resolve_model(args.model)
    print(common.machine())
    f32 = args.weights == "f32"
    gguf = common.weights_gguf(args.weights, args.llamacpp, args.peer_scripts)
    peer = {}
    if args.llamacpp:                       # fail early: binary and GGUF before the long runs
        binary = common.llamacpp_binary(args.llamacpp, "llama-batched-bench")
        peer = {"gguf": gguf,
                "version": common.llamacpp_version(binary),
                "build": common.llamacpp_build(args.llamacpp)}
        print(f"llama.cpp {peer['version']}")
    kv = dict(kv_cache_dtype=args.kv_cache_dtype)
    llm = (LLM(model_dir, max_num_seqs=max(batches), **kv) if f32 else
           LLM(gguf, quantization="gguf", max_num_seqs=max(batches), **kv))
    plan = cpu_kernel_plan.decisions()              # the paths the engine's model chose
    if plan:
        print(f"kernel plan ({plan['source']}): {cpu_kernel_plan.summary(plan)}")
    tok = llm.get_tokenizer()
    all_prompts = prompts(tok, max(batches), args.prompt_len, args.seed)
    common.generate(llm, [(all_prompts[0], 8)])             # warm-up, every variant
    if f32:
        with ops.forced_backend("torch"):
            llm_torch = LLM(model_dir, max_num_seqs=max(batches), **kv)
            common.generate(llm_torch, [(all_prompts[0], 8)])
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                               dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
        hf_generate(hf, all_prompts[:1], 8)
    rows = []
    for b in batches:
        work = [(q, args.output_len) for q in all_prompts[:b]]
        if f32:
            with ops.forced_backend("torch"):
                _, t_torch = common.generate(llm_torch, work)
            t_hf = hf_generate(hf, all_prompts[:b], args.output_len)
        engine_s, peer_rows = take_turns(llm, work, rounds, args.llamacpp, peer.get("gguf"),
                                         args.prompt_len, args.threads, peer)
        t_engine = statistics.median(engine_s)
        new = b * args.output_len
        row = {"batch": b, "engine_tok_s": new / t_engine, "engine_s": t_engine,
               "engine_rounds_tok_s": [new / t for t in engine_s]}
        if f32:
            row.update({"torch_path_tok_s": new / t_torch, "hf_tok_s": new / t_hf,
                        "ratio": t_hf / t_engine, "c_vs_torch_path": t_torch / t_engine,
                        "torch_path_s": t_torch, "hf_s": t_hf})
        if args.llamacpp:
            row.update(peer_summary(peer_rows, row["engine_rounds_tok_s"], b))
        rows.append(row)
    cols = ["batch", "engine_tok_s"]
    if f32:
        cols += ["torch_path_tok_s", "hf_tok_s", "ratio", "c_vs_torch_path"]
    if args.llamacpp:
        cols += ["llamacpp_tok_s", "llamacpp_decode_tok_s", "vs_llamacpp", "vs_llamacpp_min"]
    title = (f"Offline generation, {args.weights.upper()} weights, KV cache "
             f"{args.kv_cache_dtype}, {args.prompt_len}-token prompts + {args.output_len} new "
             f"tokens, output tokens/s ({common.machine()})")
    if args.llamacpp:
        title += (f"\nllama.cpp ({peer['build']}): llama-batched-bench, the same "
                  f"{args.weights.upper()} GGUF, "
                  f"{args.threads} threads, {rounds} rounds per batch taking turns with the "
                  f"engine (ABBA), medians; llamacpp_tok_s = B*{args.output_len}/T incl. "
                  f"prefill, decode = S_TG; vs_llamacpp = median of the per-round ratios "
                  f"engine / llama.cpp, vs_llamacpp_min the lowest")
    text = common.table(rows, cols, title)
    pyplot = common.plt()
    fig, ax = pyplot.subplots(figsize=(5.6 if args.llamacpp else 5, 3.2))
    x = list(range(len(rows)))
    series = [("engine_tok_s", "vllm (this fork)")]
    if f32:
        series += [("torch_path_tok_s", "vllm, torch path"), ("hf_tok_s", "transformers generate")]
    if args.llamacpp:
        series.append(("llamacpp_tok_s", "llama.cpp (incl. prefill)"))
    width = 0.8 / len(series)
    for k, (key, label) in enumerate(series):
        off = (k - (len(series) - 1) / 2) * width
        ax.bar([i + off for i in x], [r[key] for r in rows], width, label=label)
    top = max(r[key] for r in rows for key, _ in series)
    if args.llamacpp:
        off = (len(series) - 1) / 2 * width
        ax.plot([i + off for i in x], [r["llamacpp_decode_tok_s"] for r in rows], "k_", ms=12,
                mew=2, ls="none", label="llama.cpp decode-only (S_TG)")
        top = max(top, *(r["llamacpp_decode_tok_s"] for r in rows))
        handles, labels = ax.get_legend_handles_labels()        # the marker after the bars
        ax.legend(handles[1:] + handles[:1], labels[1:] + labels[:1], fontsize=7,
                  loc="upper left")
    ax.set_xticks(x, [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Offline throughput, default model, {args.weights.upper()}, "
                 f"{common.cpu_info()['cores']}-core CPU", fontsize=9)
    ax.set_ylim(0, 1.45 * top)                      # room for the legend
    if not args.llamacpp:
        ax.legend(fontsize=8, loc="upper left")
    name = "benchmark_throughput" + ("" if f32 else f"_{args.weights}") + \
        ("" if args.kv_cache_dtype == "auto" else f"_kv_{args.kv_cache_dtype}")
    common.save(name, {"args": vars(args), "rows": rows, "table": text, "kernel_plan": plan,
                       "llamacpp": peer or None}, fig)


if __name__ == "__main__":
    main()
