"""Offline throughput: this engine vs transformers `generate`, same model, prompts and batch.

All run greedy decoding of exactly --output-len new tokens for --prompt-len-token prompts (cut
from ShareGPT, so no padding is needed), in one process, one after the other per batch size:
the engine, the same engine on its torch path (C kernels off, as VLLM_KERNEL_BACKEND=torch),
and transformers.

    python benchmarks/benchmark_throughput.py            # batch 1, 16, 32
    python benchmarks/benchmark_throughput.py --quick    # batch 1, 16
"""
import time

import torch

import common


def prompts(tokenizer, n: int, length: int, seed: int):
    try:
        pool = common.sharegpt(4 * n, tokenizer, 10 ** 6, 1, seed=seed, min_prompt=length)
    except FileNotFoundError:
        pool = []
    if len(pool) < n:
        pool = common.synthetic(n, length, 1, tokenizer.vocab_size, seed, sigma=1e-9)
    return [p[:length] for p, _ in pool][:n]


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
    args = p.parse_args()
    common.setup(args)
    import transformers
    from vllm import LLM, cpu_kernel_plan
    from vllm import _custom_ops as ops
    from vllm.model_executor.gguf_loader import resolve_model
    batches = args.batch_sizes or ([1, 16] if args.quick else [1, 16, 32])
    model_dir = resolve_model(args.model)
    print(common.machine())
    llm = LLM(model_dir, max_num_seqs=max(batches))
    plan = cpu_kernel_plan.decisions()              # the paths the engine's model chose
    if plan:
        print(f"kernel plan ({plan['source']}): {cpu_kernel_plan.summary(plan)}")
    with ops.forced_backend("torch"):
        llm_torch = LLM(model_dir, max_num_seqs=max(batches))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    tok = llm.get_tokenizer()
    all_prompts = prompts(tok, max(batches), args.prompt_len, args.seed)
    common.generate(llm, [(all_prompts[0], 8)])             # warm-up, every variant
    with ops.forced_backend("torch"):
        common.generate(llm_torch, [(all_prompts[0], 8)])
    hf_generate(hf, all_prompts[:1], 8)
    rows = []
    for b in batches:
        work = [(q, args.output_len) for q in all_prompts[:b]]
        _, t_engine = common.generate(llm, work)
        with ops.forced_backend("torch"):
            _, t_torch = common.generate(llm_torch, work)
        t_hf = hf_generate(hf, all_prompts[:b], args.output_len)
        new = b * args.output_len
        rows.append({"batch": b, "engine_tok_s": new / t_engine, "torch_path_tok_s": new / t_torch,
                     "hf_tok_s": new / t_hf, "ratio": t_hf / t_engine,
                     "c_vs_torch_path": t_torch / t_engine, "engine_s": t_engine,
                     "torch_path_s": t_torch, "hf_s": t_hf})
    title = (f"Offline generation, {args.prompt_len}-token prompts + {args.output_len} new tokens, "
             f"output tokens/s ({common.machine()})")
    text = common.table(rows, ["batch", "engine_tok_s", "torch_path_tok_s", "hf_tok_s", "ratio",
                               "c_vs_torch_path"], title)
    pyplot = common.plt()
    fig, ax = pyplot.subplots(figsize=(5, 3.2))
    x = range(len(rows))
    ax.bar([i - 0.27 for i in x], [r["engine_tok_s"] for r in rows], 0.27, label="vllm (this fork)")
    ax.bar(list(x), [r["torch_path_tok_s"] for r in rows], 0.27, label="vllm, torch path")
    ax.bar([i + 0.27 for i in x], [r["hf_tok_s"] for r in rows], 0.27, label="transformers generate")
    ax.set_xticks(list(x), [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("output tokens/s")
    ax.set_title("Offline throughput, default model, fp32, 2-core CPU", fontsize=9)
    ax.set_ylim(0, 1.45 * max(r["engine_tok_s"] for r in rows))     # room for the legend
    ax.legend(fontsize=8, loc="upper left")
    common.save("benchmark_throughput", {"args": vars(args), "rows": rows, "table": text,
                                         "kernel_plan": plan}, fig)


if __name__ == "__main__":
    main()
