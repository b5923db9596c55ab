"""The token table's memory per token: each request's arrays (vllm/core/token_table.py: `slot`
int32 and `live` bool per logical token, capacity doubling as it grows) in bytes per token of
context, against the KV bytes one token takes in the pool (every layer's K and V) for the default
model and the paper's shapes (Llama-3.1-8B, Qwen2.5-14B, bf16 KV).

Two ways a request's table gets its length: `prefill` registers it at once (capacity = length),
`decode` registers a third as the prompt, then one token a step (capacity doubles: up to 2x the
bytes). Eviction does not shrink the table (a dead token keeps its entry; its slot becomes -1
when its block goes), so the figure does not depend on the eviction ratio. Beside it, the
attention view the engine keeps per running request (engine/translation_cache.py: live ids and
slots, int64 each; the worker holds the slots once more) in bytes per live token at ratio 0.5.

    python benchmarks/benchmark_token_table.py        # seconds; no model is run
"""
from typing import Dict, List

import numpy as np

import common
from vllm.core.token_table import TokenTable
from vllm.engine.translation_cache import TranslationCache

BLOCK = 16
# (label, prompt tokens, output tokens): the default model's CPU setups and the paper's
SETUPS = [("default model, capacity (CPU)", 192, 256), ("Llama-3.1-8B, capacity", 4032, 12288),
          ("Qwen2.5-14B, capacity", 8192, 8192)]
LENGTHS = [1024, 4096, 16384, 32768]


def table_bytes(tt: TokenTable, req_id: str) -> int:
    """The request's token-table arrays, as allocated (capacity, not length)."""
    e = tt._entries[req_id]
    return e.slot.nbytes + e.live.nbytes


def grown_table(prompt: int, output: int, ratio: float = 0.0) -> TokenTable:
    """A request's table after its prompt (one call) and `output` decode steps (one token each),
    evicting `ratio` of the tokens (oldest first) at the end, as the block manager drives it."""
    tt = TokenTable(BLOCK)
    tt.add_request("r")
    total = prompt + output
    blocks = list(range(-(-total // BLOCK)))
    tt.sync_new_tokens("r", blocks, prompt)
    for n in range(prompt + 1, total + 1):
        tt.sync_new_tokens("r", blocks, n)
    if ratio:
        tt.evict_tokens("r", np.arange(int(ratio * total), dtype=np.int64))
    return tt


def measure(prompt: int, output: int, ratio: float = 0.5) -> Dict[str, float]:
    """Bytes per token of one request's token table (and its attention view at `ratio`)."""
    tt = grown_table(prompt, output, ratio)
    total = prompt + output
    view = TranslationCache(tt).view("r")
    live = tt.num_live("r")
    return {"prompt": prompt, "output": output, "tokens": total,
            "capacity": len(tt._entries["r"].slot), "table_bytes": table_bytes(tt, "r"),
            "bytes_per_token": table_bytes(tt, "r") / total,
            "view_bytes_per_live_token": (view.ids.nbytes + view.slots.nbytes) / live}


def kv_bytes_per_token() -> Dict[str, int]:
    """K + V of one token over every layer, per model: the default model's CPU cache dtype, bf16
    for the paper's shapes (benchmark_capacity's sizing)."""
    import transformers

    import benchmark_capacity as cap
    from vllm.attention import kv_quant
    from vllm.model_executor.gguf_loader import resolve_model
    hf = transformers.AutoConfig.from_pretrained(resolve_model(None))
    kv = kv_quant.resolve("auto", "cpu", "float32", True)         # the GGUF model: bf16 KV
    out = {f"default ({kv})": cap.block_bytes(
        hf, kv_quant.FLOAT_DTYPES[kv].itemsize, 1)}
    for shape, (cls, kw) in common.SIM_SHAPES.items():
        cfg = getattr(transformers, cls)(**kw)
        out[f"{shape} (bf16)"] = cap.block_bytes(cfg, 2, 1)
    return out


def main():
    p = common.base_parser(__doc__)
    p.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    args = p.parse_args()
    kv = kv_bytes_per_token()
    rows: List[Dict] = []
    for n in args.lengths:
        for mode, (prompt, output) in (("prefill", (n, 0)), ("decode", (n // 3, n - n // 3))):
            rows.append({"case": f"{n} tokens, {mode}", **measure(prompt, output)})
    for label, prompt, output in SETUPS:
        rows.append({"case": label, **measure(prompt, output)})
    for r in rows:
        r.update({f"% of {m}": 100 * r["bytes_per_token"] / b for m, b in kv.items()})
    cols = ["case", "tokens", "capacity", "table_bytes", "bytes_per_token",
            "view_bytes_per_live_token"] + [f"% of {m}" for m in kv]
    title = ("Token table bytes per token of context (slot int32 + live bool per entry, "
             "allocated capacity / tokens; decode = a third prompt, the rest one token a "
             "step); KV bytes per token: "
             + ", ".join(f"{m} {b:,}" for m, b in kv.items()))
    text = common.table(rows, cols, title)
    pyplot = common.plt()
    fig, ax = pyplot.subplots(figsize=(5.5, 3.2))
    for mode, style in (("prefill", "o-"), ("decode", "s--")):
        sub = [r for r in rows if r["case"].endswith(mode)]
        ax.plot([r["tokens"] for r in sub], [r["bytes_per_token"] for r in sub], style,
                label=f"token table, {mode}")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 12)
    ax.set_xlabel("tokens in the request")
    ax.set_ylabel("bytes per token")
    ax.set_title("Token table per request (KV per token: " + ", ".join(
        f"{m.split(' (')[0]} {b / 1024:.0f} KiB" for m, b in kv.items()) + ")", fontsize=7)
    ax.legend(fontsize=7)
    common.save("benchmark_token_table", {"args": vars(args), "rows": rows,
                                          "kv_bytes_per_token": kv, "table": text}, fig)


if __name__ == "__main__":
    main()
