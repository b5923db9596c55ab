"""Capacity on models with sliding-window layers: the same KV memory, the paper's workload
(1,008-token prompts, 12,288 new tokens, H2O ratio 0.5, block 16), --load-format simulate at
paper-scale shapes (the real scheduler, block manager, token tables, sliding-window blocks,
policy and planner; synthetic attention statistics):

    Native, one group   --disable-hybrid-kv-cache-manager: every layer full-size (a block holds
                        all layers' pages)
    Native, groups      the hybrid layout: a block holds a page per full layer, the sliding
                        layers take ceil(W / 16) + 1 blocks per subgroup and request
    vToken, groups      H2O 0.5 on the full-attention group, reclaimed by repacking
    ideal (groups)      blocks / (packed live blocks + sliding blocks) per request

Shapes: Gemma-3-27B (62 layers, every 6th full, window 1,024, 16 KV heads x 128) and Qwen3-8B
(36 full layers, 8 KV heads x 128: one group, the dense reference); gpt-oss-20b (24 layers
alternating window 128 / full, 8 KV heads x 64, attention sinks; benchmark_moe.py runs it) on
request. --scale shrinks lengths, memory and the window together, so blocks per request keep
their paper-scale ratios. KV bytes per token are reported per variant (bf16): the full group's
per token, plus the sliding windows' per request.

    python benchmarks/benchmark_hybrid_capacity.py --quick      # scale 1/16
    python benchmarks/benchmark_hybrid_capacity.py --scale 0.125
"""
import tempfile
import time
from typing import Dict, List

import benchmark_capacity as cap
import common

BLOCK = cap.BLOCK
ELEM = 2                       # bf16 KV


def shape_dir(name: str, scale: float) -> str:
    """A config.json of the named shape in a temp dir, its sliding window scaled with the
    lengths (a small vocabulary: it has no effect on the KV plane and keeps the simulated
    logits cheap)."""
    import transformers
    path = tempfile.mkdtemp(prefix=f"vtoken-{name}-")
    if name == "gemma3-27b":
        cfg = transformers.Gemma3TextConfig(
            vocab_size=32000, hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
            num_attention_heads=32, num_key_value_heads=16, head_dim=128,
            sliding_window=max(BLOCK, round(1024 * scale)),
            query_pre_attn_scalar=168, max_position_embeddings=131072)
        cfg.architectures = ["Gemma3ForCausalLM"]
    elif name == "gpt-oss-20b":           # sliding / full alternating (layer_types), sinks
        cfg = transformers.GptOssConfig(
            vocab_size=32000, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
            num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
            num_experts_per_tok=4, sliding_window=max(BLOCK, round(128 * scale)),
            max_position_embeddings=131072,
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                             "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False})
        cfg.architectures = ["GptOssForCausalLM"]
    else:
        cfg = transformers.Qwen3Config(
            vocab_size=32000, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128,
            max_position_embeddings=131072)
        cfg.architectures = ["Qwen3ForCausalLM"]
    cfg.save_pretrained(path)
    return path


def layout(model: str, one_group: bool, total: int) -> Dict:
    """Bytes of a pool block and of one token, and the sliding blocks a request of `total`
    tokens holds at most, from the engine's own rule (layers/attention.py kv_groups)."""
    import transformers
    from vllm.model_executor.layers.attention import ONE_KV_GROUP_ATTR, kv_groups
    hf = transformers.AutoConfig.from_pretrained(model)
    if one_group:
        setattr(hf, ONE_KV_GROUP_ATTR, True)
    g = kv_groups(hf)
    page = 2 * hf.num_key_value_heads * hf.head_dim * ELEM          # one layer, one token
    sliding = g.num_sliding_groups * min(-(-g.window // BLOCK) + 1, -(-total // BLOCK)) \
        if g.hybrid else 0
    return {"block_bytes": g.num_tensors * page * BLOCK, "token_bytes": g.num_tensors * page,
            "sliding_blocks": sliding, "tensors": g.num_tensors,
            "layers": hf.num_hidden_layers}


def run_shape(name: str, args, log) -> Dict:
    scale = args.scale or (1 / 16 if args.quick else 0.125)
    model = shape_dir(name, scale)
    prompt, output = round(1008 * scale), round(12288 * scale)
    total = prompt + output
    memory = args.memory_gib * 2 ** 30 * scale
    work = [(p, o) for p, o in ((w[:prompt], output) for w, _ in common.synthetic(
        args.max_c, prompt, output, 32000, args.seed, sigma=1e-9))]
    extra = dict(load_format="simulate", max_model_len=total + BLOCK)
    row = {"shape": name, "prompt": prompt, "output": output,
           "memory MiB": memory / 2 ** 20}
    variants = [("Native, one group", True, dict(kv_eviction_policy="none")),
                ("Native, groups", False, dict(kv_eviction_policy="none")),
                ("vToken, groups", False, cap.eviction("vtoken"))]
    seen = set()
    for label, one, kw in variants:
        lay = layout(model, one, total)
        key = (lay["tensors"], kw["kv_eviction_policy"])
        if key in seen:                       # a dense model: groups change nothing
            continue
        seen.add(key)
        blocks = int(memory // lay["block_bytes"])
        kw = dict(kw, num_gpu_blocks_override=blocks, **extra,
                  disable_hybrid_kv_cache_manager=one)
        per_req = (-(-total // BLOCK) if kw["kv_eviction_policy"] == "none" else
                   cap.packed_blocks(total)) + lay["sliding_blocks"]
        c, tried = cap.frontier(lambda c: cap.trial(model, kw, work, c), blocks // per_req,
                                min(len(work), blocks // max(per_req // 2, 1) + 2), log,
                                f"{name} {label}")
        row[label] = c
        row[f"{label} blocks"] = blocks
        row[f"{label} KV B/token"] = lay["token_bytes"]
        row[f"{label} sliding blocks/req"] = lay["sliding_blocks"]
        if label == "vToken, groups" or (one is False and "vToken, groups" not in row):
            row["ideal (groups)"] = blocks // (cap.packed_blocks(total) + lay["sliding_blocks"])
    base = row.get("Native, groups") or row.get("Native, one group")
    if base and "vToken, groups" in row:
        row["vToken / Native (groups)"] = row["vToken, groups"] / base
    return row


def main():
    p = common.base_parser(__doc__)
    p.add_argument("--scale", type=float, default=None, help="length and memory scale")
    p.add_argument("--memory-gib", type=float, default=40.0,
                   help="KV memory at scale 1 (scaled with the lengths)")
    p.add_argument("--max-c", type=int, default=160, help="requests available to the search")
    p.add_argument("--shapes", nargs="+", default=["gemma3-27b", "qwen3-8b"],
                   choices=["gemma3-27b", "qwen3-8b", "gpt-oss-20b"])
    args = p.parse_args()
    common.setup(args)
    t0 = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t0:6.0f}s] {msg}", flush=True)

    rows: List[Dict] = [run_shape(s, args, log) for s in args.shapes]
    cols = ["shape", "prompt", "output", "memory MiB", "Native, one group", "Native, groups",
            "vToken, groups", "ideal (groups)", "vToken / Native (groups)",
            "Native, one group KV B/token", "Native, groups KV B/token",
            "Native, groups sliding blocks/req"]
    text = common.table(rows, cols, "Capacity frontier (max concurrency, all resident, "
                        "stall-free, no preemption) at equal KV memory, H2O 0.5, bf16 KV, "
                        f"block {BLOCK}, --load-format simulate; {common.machine()}")
    print(text)
    pyplot = common.plt()
    fig, ax = pyplot.subplots(figsize=(6.4, 3.2))
    names = ["Native, one group", "Native, groups", "vToken, groups", "ideal (groups)"]
    width = 0.8 / len(names)
    for k, n in enumerate(names):
        bars = ax.bar([i + (k - len(names) / 2 + 0.5) * width for i in range(len(rows))],
                      [r.get(n, 0) for r in rows], width, label=n)
        ax.bar_label(bars, fontsize=6)
    ax.set_xticks(range(len(rows)), [r["shape"] for r in rows])
    ax.set_ylabel("max concurrency, stall-free")
    ax.set_title("Capacity at equal KV memory with hybrid KV groups (simulate)", fontsize=8)
    ax.legend(fontsize=6)
    common.save("benchmark_hybrid_capacity", {"args": vars(args), "rows": rows, "table": text,
                                              "seconds": time.perf_counter() - t0}, fig)


if __name__ == "__main__":
    main()
