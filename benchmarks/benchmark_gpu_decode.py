"""The engine on a GPU at the paper's model shape: decode throughput against transformers
`generate`, the indirection overhead, and the capacity frontier and SLA scan at 1/4 scale.

    python benchmarks/benchmark_gpu_decode.py                     # CUDA, all parts (H200: minutes)
    python benchmarks/benchmark_gpu_decode.py --parts decode      # one part
    python benchmarks/benchmark_gpu_decode.py --device cpu --quick  # toy config, CPU smoke
    python benchmarks/benchmark_gpu_decode.py --parts fp8         # fp8 KV cache vs bf16 KV

Model: a Llama-3.1-8B-shaped config.json written into a temp dir (hidden 4096, 32 layers, 32
heads, 8 KV heads, intermediate 14336, vocab 128256, RoPE theta 500000) with seeded random weights
(--load-format dummy), bf16 on CUDA. --quick: a 2-layer toy config instead.

Parts (each merges into the JSON at --out, saved after every measurement, so a part cut by a
timeout keeps what it measured; the headline figures are measured first):
  decode    steady-state decode tokens/s at batch 1 / 16 / 64 (256-token prompts) of Native,
            Naive-Evict (H2O 0.5, --kv-reclamation none), vToken (H2O 0.5, vtoken) and transformers
            `generate` (AutoModelForCausalLM.from_config, same shape and dtype, same device), with
            their ratios; and `indirection`: vToken's hooks on with nothing evicted (StreamingLLM at
            ratio 0, as benchmarks/benchmark_overhead.py) against Native, step time ratio - 1.
            Order: Native, vToken and transformers at batch 16 (the headline vToken / transformers
            ratio), then at the other batches, then the indirection rounds, then Naive-Evict.
  capacity  the paper's capacity frontier at --capacity-scale (default 1/4: 1,008 prompt + 3,072
            output tokens, 1,357 KV blocks, H2O 0.5): the highest C whose C requests all stay
            resident and finish without preemption, per variant: Native and vToken first (their
            ratio, vToken_vs_Native, is saved as soon as both are known), then Naive-Evict.
            --capacity-variants runs some of them (a later run at the same scale merges in).
  sla       one wave of C requests per level (the frontiers found, or --sla-levels), run to the
            end even through preemption: per-request latency p95 and tokens/s; SLA = 1.05 x
            Naive-Evict's p95 at its frontier; C_sel = each variant's highest-throughput level
            within the SLA.
  fp8       (not in the default parts) decode tokens/s with --kv-cache-dtype fp8 (e4m3) against
            the model's dtype, Native and vToken (H2O 0.5), at --fp8-batches (default 16, then
            64) over --fp8-context-token prompts (default 1,024: attention's share of a
            step is large enough to show), both engines resident, runs interleaved: the ratios
            fp8 / auto and the KV bytes per token (half on CUDA).
The other parts' variants share two engines: one with --kv-reclamation vtoken (Native,
indirection and vToken are per-request settings, KVEvictionParams) and one with none
(Naive-Evict). gpu_check.sh runs fp8 last, after the SLA scan, in the same step.
"""
import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from typing import Dict, List

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vllm import LLM, KVEvictionParams, SamplingParams  # noqa: E402

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5)
TOY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, vocab_size=512, rope_theta=500000.0,
           max_position_embeddings=8192, rms_norm_eps=1e-5)
# per-request settings: (engine, KVEvictionParams)
VARIANTS = {"Native": ("vtoken", KVEvictionParams(policy="none")),
            "indirection": ("vtoken", KVEvictionParams(policy="streamingllm", eviction_ratio=0.0)),
            "vToken": ("vtoken", KVEvictionParams(policy="h2o", eviction_ratio=0.5)),
            "Naive-Evict": ("none", KVEvictionParams(policy="h2o", eviction_ratio=0.5))}
PREFILL_CHUNK = 2048     # --max-num-batched-tokens: prompt tokens a step prefills


def write_config(shape: Dict) -> str:
    import transformers
    path = tempfile.mkdtemp(prefix="vtoken-gpu-")
    transformers.LlamaConfig(**shape, tie_word_embeddings=False).save_pretrained(path)
    return path


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build_engine(args, reclamation: str, kv_cache_dtype: str = "auto",
                 blocks: int = 0) -> LLM:
    return LLM(args.model_dir, load_format="dummy", device=args.device, dtype=args.dtype,
               num_gpu_blocks_override=blocks or args.blocks, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=PREFILL_CHUNK,
               max_model_len=args.max_model_len, kv_min_tokens=0, kv_reclamation=reclamation,
               enforce_eager=args.enforce_eager, kv_cache_dtype=kv_cache_dtype, seed=0)


def prompts(n: int, length: int, vocab: int, seed: int) -> List[List[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(3, vocab, (n, length)).tolist()


# ---- decode ---------------------------------------------------------------------------------
def decode_tokens(args, batch: int) -> int:
    """Output tokens a decode request may need: the first requests' prefills finish up to
    batch * prompt_len / PREFILL_CHUNK steps before the last one's (batch 64 of 256-token
    prompts: 8 steps), and they decode in those steps, then warm-up and timed steps."""
    return -(-batch * args.prompt_len // PREFILL_CHUNK) + args.warmup + args.steps + 4


def engine_decode(eng, ev: KVEvictionParams, batch: int, args, tag: str) -> Dict:
    """Steady-state decode of `batch` requests: prefill, args.warmup decode steps (graph capture),
    then args.steps timed steps in which every request decodes one token."""
    ids = [f"{tag}-{i}" for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=decode_tokens(args, batch),
                            ignore_eos=True)
    for rid, p in zip(ids, prompts(batch, args.prompt_len, args.vocab, seed=batch)):
        eng.add_request(rid, {"prompt_token_ids": p}, params, kv_eviction=ev)
    outputs = lambda: [eng.requests[r].seqs[0].num_output_tokens  # noqa: E731
                       if r in eng.requests else None for r in ids]
    try:
        while min(outputs()) < args.warmup:
            eng.step()
        before, stats0 = outputs(), eng.get_kv_stats()
        sync(args.device)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            eng.step()
        sync(args.device)
        dt = time.perf_counter() - t0
        assert [b + args.steps for b in before] == outputs(), "a request stalled or finished"
        stats = eng.get_kv_stats()
    finally:                          # a failed measurement leaves the engine empty too
        eng.abort_request(ids)
    return {"tok_s": batch * args.steps / dt, "step_ms": 1e3 * dt / args.steps,
            "relocation_events": stats.get("relocation_events", 0)
            - stats0.get("relocation_events", 0)}


def hf_model(args):
    import transformers
    cfg = transformers.AutoConfig.from_pretrained(args.model_dir)
    dtype = getattr(torch, args.dtype)
    with torch.device(args.device):
        try:
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        except TypeError:                                   # transformers 4.x
            model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
    model.generation_config.eos_token_id = None
    return model.to(args.device, dtype).eval()


@torch.inference_mode()
def hf_decode(model, batch: int, args) -> Dict:
    """transformers `generate` (greedy, no EOS): decode rate from generating 1 + steps tokens
    against 1 token (prefill and the first token cancel out)."""
    ids = torch.tensor(prompts(batch, args.prompt_len, args.vocab, seed=batch),
                       device=args.device)
    mask = torch.ones_like(ids)

    def generate(n):
        sync(args.device)
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)
        sync(args.device)
        return time.perf_counter() - t0

    generate(2)                                           # warm-up
    t1, tn = generate(1), generate(1 + args.steps)
    return {"tok_s": batch * args.steps / (tn - t1), "step_ms": 1e3 * (tn - t1) / args.steps}


HEADLINE_BATCH = 16      # the decode target: vToken / transformers at batch 16
FAILED: List[str] = []   # measurements that raised (main exits 1 after saving the rest)


def attempt(cell: Dict, key: str, measure) -> bool:
    """cell[key] = measure(), or {"error": ...} with the traceback printed, so that one failed
    measurement (batch 64 once finished a request early) costs only itself on a lent GPU."""
    try:
        cell[key] = measure()
        return True
    except Exception as e:  # noqa: BLE001 (recorded, and the run exits 1)
        traceback.print_exc()
        cell[key] = {"error": f"{type(e).__name__}: {e}"}
        FAILED.append(key)
        return False


def part_decode(args, out: Dict) -> None:
    res = {b: {} for b in args.batches}
    order = sorted(args.batches, key=lambda b: b != HEADLINE_BATCH)    # the headline batch first

    def save():    # after every measurement: a step cut by its timeout keeps what it measured
        out["decode"] = {str(b): ratios(dict(r)) for b, r in res.items()}
        args.save()
    eng = build_engine(args, "vtoken").llm_engine
    model = None if args.no_hf else hf_model(args)     # resident beside the engine: no rebuild
    for b in order:                  # the headline (batch 16 vToken / transformers) after 3 runs
        for name in ("Native", "vToken"):
            attempt(res[b], name, lambda: engine_decode(eng, VARIANTS[name][1], b, args,
                                                        f"{name}-{b}"))
            save()
        if model is not None:
            attempt(res[b], "transformers", lambda: hf_decode(model, b, args))
            save()
    model = None
    release()
    for b in order:
        # indirection: alternate with Native, medians of the step times
        if "step_ms" in res[b]["Native"]:
            attempt(res[b], "indirection_overhead", lambda: indirection(eng, b, args,
                                                                        res[b]["Native"]))
            save()
    eng = None
    release()
    eng = build_engine(args, "none").llm_engine
    for b in order:
        attempt(res[b], "Naive-Evict", lambda: engine_decode(eng, VARIANTS["Naive-Evict"][1], b,
                                                             args, f"naive-{b}"))
        save()
    eng = None
    release()
    out["decode"] = {str(b): ratios(r) for b, r in res.items()}
    print_decode(out["decode"])


def indirection(eng, b: int, args, native: Dict) -> float:
    """StreamingLLM at ratio 0 (the token table's indirection, nothing evicted) against Native,
    alternating, medians of the step times: the relative overhead."""
    nat, ind = [native["step_ms"]], []
    for r in range(args.rounds):
        ind.append(engine_decode(eng, VARIANTS["indirection"][1], b, args,
                                 f"ind-{b}-{r}")["step_ms"])
        if r + 1 < args.rounds:
            nat.append(engine_decode(eng, VARIANTS["Native"][1], b, args,
                                     f"nat-{b}-{r}")["step_ms"])
    return statistics.median(ind) / statistics.median(nat) - 1


def ratios(r: Dict) -> Dict:
    tok = {k: v["tok_s"] for k, v in r.items() if isinstance(v, dict) and "tok_s" in v}
    r["ratios"] = {f"{a} / {b}": tok[a] / tok[b] for a, b in (
        ("vToken", "transformers"), ("Native", "transformers"), ("Naive-Evict", "transformers"),
        ("vToken", "Native"), ("vToken", "Naive-Evict")) if a in tok and b in tok}
    return r


def print_decode(dec: Dict) -> None:
    names = ["Native", "Naive-Evict", "vToken", "transformers"]
    print(f"{'batch':>5} " + " ".join(f"{n + ' tok/s':>18}" for n in names) +
          f" {'vToken/HF':>9} {'indirection':>11}")
    for b, r in dec.items():
        cells = [f"{r[n]['tok_s']:>18.1f}" if "tok_s" in r.get(n, {}) else f"{'-':>18}"
                 for n in names]
        vs_hf, ind = r["ratios"].get("vToken / transformers"), r.get("indirection_overhead")
        print(f"{b:>5} " + " ".join(cells) + (f" {vs_hf:>8.2f}x" if vs_hf else f" {'-':>9}") +
              (f" {100 * ind:>+10.2f}%" if isinstance(ind, float) else f" {'-':>11}"))


# ---- capacity and SLA -----------------------------------------------------------------------
def wave(eng, ev: KVEvictionParams, c: int, args, tag: str, to_end: bool) -> Dict:
    """C requests at once under the pool; stops at the first preemption unless to_end."""
    ids = [f"{tag}-{i}" for i in range(c)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for rid, p in zip(ids, prompts(c, args.cap_prompt_len, args.vocab, seed=1000 + c)):
        eng.add_request(rid, {"prompt_token_ids": p}, params, kv_eviction=ev)
    sched, bm = eng.scheduler, eng.kv.bm
    preempted0, done, peak, max_running = sched.num_preemptions, [], 0, 0
    t0 = time.perf_counter()
    while any(r in eng.requests for r in ids):
        done += [o for o in eng.step() if o.finished]
        peak = max(peak, bm.num_blocks - bm.num_free_blocks)
        max_running = max(max_running, len(sched.running))
        if sched.num_preemptions > preempted0 and not to_end:
            break
    secs = time.perf_counter() - t0
    eng.abort_request(ids)
    preemptions = sched.num_preemptions - preempted0
    full = len(done) == c and all(len(o.outputs[0].token_ids) == args.output_len for o in done)
    lat = [o.metrics["finished_time"] - o.metrics["arrival_time"] for o in done]
    return {"c": c, "feasible": bool(full and not preemptions and max_running == c),
            "preemptions": preemptions, "completed": full, "seconds": secs,
            "pool_peak_blocks": peak, "tok_s": c * args.output_len / secs if full else None,
            "p95_latency_s": float(np.percentile(lat, 95)) if full else None,
            "request_peak_blocks": float(np.mean([o.kv_stats["peak_blocks"] for o in done]))
            if done else None}


def frontier(eng, ev, guess: int, args, name: str, log: Dict) -> int:
    """Walk from the guess: up while feasible, down while not. log[name]: the waves so far."""
    tried = log[name] = {}

    def feasible(c):
        if c not in tried:
            tried[c] = wave(eng, ev, c, args, f"cap-{name}-{c}", to_end=False)
            args.save()
            print(f"  {name} C={c}: {'feasible' if tried[c]['feasible'] else 'infeasible'} "
                  f"(pool peak {tried[c]['pool_peak_blocks']}, {tried[c]['seconds']:.0f} s)",
                  flush=True)
        return tried[c]["feasible"]

    c = max(1, min(guess, args.max_num_seqs))
    if feasible(c):
        while c < args.max_num_seqs and feasible(c + 1):
            c += 1
    else:
        while c > 1 and not feasible(c - 1):
            c -= 1
        c -= 1
    return c


def per_request_blocks(args) -> Dict[str, int]:
    """Blocks a request needs at its end: every token (Native, Naive-Evict) or the live half
    packed (vToken at the default --kv-frag-threshold 0.25, which leaves up to 1/8 dead)."""
    total = args.cap_prompt_len + args.output_len
    ideal = -(-int(0.5 * total) // 16)
    return {"full": -(-total // 16), "ideal": ideal, "vToken": int(ideal / (1 - 0.25 / 2))}


CAPACITY_VARIANTS = ("Native", "vToken", "Naive-Evict")     # the run order: the headline first


def part_capacity(args, out: Dict) -> None:
    need = per_request_blocks(args)
    guesses = {"Native": args.blocks // need["full"], "Naive-Evict": args.blocks // need["full"],
               "vToken": args.blocks // need["vToken"]}
    scale = {"prompt_len": args.cap_prompt_len, "output_len": args.output_len,
             "blocks": args.blocks, "ideal_packed": args.blocks // need["ideal"]}
    res = out.get("capacity")
    if not res or any(res.get(k) != v for k, v in scale.items()):    # else merge: same scale
        res = dict(scale, trials={})
    out["capacity"] = res
    for reclamation, names in (("vtoken", ("Native", "vToken")), ("none", ("Naive-Evict",))):
        names = [n for n in names if n in args.capacity_variants]
        if not names:
            continue
        eng = build_engine(args, reclamation).llm_engine
        for name in names:
            res[name] = frontier(eng, VARIANTS[name][1], guesses[name], args, name, res["trials"])
            if res.get("Native") is not None and res.get("vToken") is not None:
                res["vToken_vs_Native"] = res["vToken"] / max(res["Native"], 1) - 1
            args.save()                 # the headline ratio lands before Naive-Evict's search
        del eng
        release()
    found = ", ".join(f"{n} {res[n]}" for n in CAPACITY_VARIANTS if n in res)
    ratio = res.get("vToken_vs_Native")
    print(f"capacity frontier ({args.blocks} blocks, {args.cap_prompt_len} + {args.output_len} "
          f"tokens, H2O 0.5): {found}" + (f", vToken vs Native {100 * ratio:+.0f}%"
                                         if ratio is not None else "") +
          f", ideal packed {res['ideal_packed']}")


def sla_levels(args, out: Dict) -> List[int]:
    if args.sla_levels:
        return sorted(set(args.sla_levels))
    cap = out.get("capacity")
    if cap is None or any(cap.get(n) is None for n in ("Native", "Naive-Evict", "vToken")):
        need = per_request_blocks(args)
        return sorted({args.blocks // need["full"], args.blocks // need["vToken"]})
    return sorted({cap["Native"], cap["Naive-Evict"], cap["vToken"]} - {0})


def part_sla(args, out: Dict) -> None:
    """One wave per (variant, level), run to the end; a frontier trial that completed (same
    scale) is such a wave already. Past-frontier waves first: they are the comparison."""
    levels = sla_levels(args, out)
    cap = out.get("capacity") or {}
    same = cap.get("blocks") == args.blocks and cap.get("output_len") == args.output_len
    waves = {name: {} for name in ("Native", "Naive-Evict", "vToken")}
    for name, trials in (cap.get("trials") or {}).items():
        for c, w in (trials.items() if same else ()):
            if w["completed"] and int(c) in levels:
                waves[name][int(c)] = w
    res = out["sla"] = {"levels": levels, "waves": waves}
    for reclamation, names in (("vtoken", ("Native", "vToken")), ("none", ("Naive-Evict",))):
        todo = [(n, c) for n in names for c in reversed(levels) if c not in waves[n]]
        if not todo:
            continue
        eng = build_engine(args, reclamation).llm_engine
        for name, c in todo:
            w = waves[name][c] = wave(eng, VARIANTS[name][1], c, args, f"sla-{name}-{c}",
                                      to_end=True)
            args.save()
            print(f"  {name} C={c}: {w['tok_s'] or 0:.1f} tok/s, p95 "
                  f"{w['p95_latency_s'] or 0:.1f} s, {w['preemptions']} preemptions", flush=True)
        del eng
        release()
    select(res, cap.get("Naive-Evict") or levels[0])
    if res["selected"] is None:
        print("SLA: no Naive-Evict wave completed, no reference latency")
        return
    print(f"SLA {res['sla_s']:.1f} s (1.05 x {res['reference']}): " + ", ".join(
        f"{n} C_sel {s['C_sel']} {s['tok_s']:.1f} tok/s ({s.get('vs_Naive-Evict', 0):.2f}x)"
        if s else f"{n}: none within" for n, s in res["selected"].items()))


def select(res: Dict, ref_c: int) -> None:
    """SLA = 1.05 x Naive-Evict's p95 at its frontier; C_sel = a variant's highest-throughput
    level within it."""
    waves = res["waves"]
    done = {c: w for c, w in waves["Naive-Evict"].items() if w["p95_latency_s"] is not None}
    if not done:
        res["selected"] = None              # no Naive-Evict wave completed: no SLA
        return
    ref = done.get(ref_c) or done[min(done)]
    res["sla_s"] = sla = 1.05 * ref["p95_latency_s"]
    res["reference"] = f"Naive-Evict at C={ref['c']}"
    res["selected"] = {}
    for name, ws in waves.items():
        ok = [w for w in ws.values() if w["p95_latency_s"] is not None
              and w["p95_latency_s"] <= sla]
        best = max(ok, key=lambda w: w["tok_s"], default=None)
        res["selected"][name] = {"C_sel": best["c"], "tok_s": best["tok_s"]} if best else None
    base = res["selected"].get("Naive-Evict")
    for sel in res["selected"].values():
        if sel and base:
            sel["vs_Naive-Evict"] = sel["tok_s"] / base["tok_s"]


# ---- fp8 KV cache ---------------------------------------------------------------------------
FP8_KV = "fp8_e4m3"


def part_fp8(args, out: Dict) -> None:
    """Native and vToken decode over an fp8 KV cache against the model's dtype, batch by batch
    (the first batch's ratios saved before the next batch runs)."""
    run = argparse.Namespace(**{**vars(args), "prompt_len": args.fp8_context})
    b = max(args.fp8_batches)
    blocks = max(args.blocks, b * -(-(args.fp8_context + decode_tokens(run, b)) // 16))
    engines = {kv: build_engine(args, "vtoken", kv, blocks).llm_engine
               for kv in ("auto", FP8_KV)}
    res = out["fp8"] = {"kv_cache_dtype": FP8_KV, "context": args.fp8_context, "blocks": blocks,
                        "kv_bytes_per_token": {kv: e.block_bytes() // e.cache_config.block_size
                                               for kv, e in engines.items()},
                        "batches": {}}
    for b in args.fp8_batches:
        r = res["batches"][str(b)] = {kv: {} for kv in engines}
        for name in ("Native", "vToken"):
            for kv, eng in engines.items():
                r[kv][name] = engine_decode(eng, VARIANTS[name][1], b, run, f"fp8-{kv}-{name}-{b}")
                args.save()
            r.setdefault("ratios", {})[f"{name} fp8 / auto"] = \
                r[FP8_KV][name]["tok_s"] / r["auto"][name]["tok_s"]
            args.save()
    del engines
    release()
    print(f"fp8 KV ({FP8_KV}) vs auto, {args.fp8_context}-token prompts, KV bytes per token "
          f"{res['kv_bytes_per_token']['auto']} -> {res['kv_bytes_per_token'][FP8_KV]}")
    for b, r in res["batches"].items():
        print(f"  batch {b:>3}: " + ", ".join(
            f"{n} {r['auto'][n]['tok_s']:.1f} -> {r[FP8_KV][n]['tok_s']:.1f} tok/s "
            f"({r['ratios'][f'{n} fp8 / auto']:.2f}x)" for n in ("Native", "vToken")))


# ---- main -----------------------------------------------------------------------------------
PARTS = {"decode": part_decode, "capacity": part_capacity, "sla": part_sla, "fp8": part_fp8}
DEFAULT_PARTS = ["decode", "capacity", "sla"]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--quick", action="store_true", help="toy config, short runs (CPU smoke)")
    p.add_argument("--parts", nargs="+", default=DEFAULT_PARTS, choices=list(PARTS))
    p.add_argument("--batches", type=int, nargs="+", default=None)
    p.add_argument("--prompt-len", type=int, default=None, help="decode part (default 256)")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps (default 32)")
    p.add_argument("--warmup", type=int, default=3, help="decode steps before timing")
    p.add_argument("--rounds", type=int, default=2, help="indirection: runs per side")
    p.add_argument("--capacity-scale", type=float, default=None,
                   help="of the paper's 4,032 + 12,288 tokens and 5,427 blocks (default 1/4)")
    p.add_argument("--capacity-variants", nargs="+", default=list(CAPACITY_VARIANTS),
                   choices=CAPACITY_VARIANTS, help="capacity part: the frontiers to search (run "
                   "in the order Native, vToken, Naive-Evict whatever the order given)")
    p.add_argument("--sla-levels", type=int, nargs="+", default=None)
    p.add_argument("--fp8-batches", type=int, nargs="+", default=None,
                   help="fp8 part (default 16 64)")
    p.add_argument("--fp8-context", type=int, default=None,
                   help="fp8 part: prompt tokens (default 1024)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers generate")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/"
                                               "gpu_decode_<device>.json); parts merge into it")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    shape = TOY if args.quick else LLAMA_8B
    args.vocab = shape["vocab_size"]
    args.batches = args.batches or ([1, 4] if args.quick else [1, 16, 64])
    args.prompt_len = args.prompt_len or (16 if args.quick else 256)
    args.steps = args.steps or (4 if args.quick else 32)
    args.fp8_batches = args.fp8_batches or ([1, 4] if args.quick else [16, 64])
    args.fp8_context = args.fp8_context or (32 if args.quick else 1024)
    scale = args.capacity_scale or (1 / 64 if args.quick else 0.25)
    args.cap_prompt_len, args.output_len = round(4032 * scale), round(12288 * scale)
    args.blocks = round(5427 * scale)
    decode_len = args.prompt_len + max(decode_tokens(args, b) for b in args.batches)
    fp8_run = argparse.Namespace(**{**vars(args), "prompt_len": args.fp8_context})
    fp8_len = args.fp8_context + max(decode_tokens(fp8_run, b) for b in args.fp8_batches)
    args.max_num_seqs = max(args.batches + args.fp8_batches + [32])
    args.max_model_len = max(decode_len, fp8_len, args.cap_prompt_len + args.output_len) + 16
    need = max(args.batches) * -(-decode_len // 16)
    assert need <= args.blocks, f"decode at batch {max(args.batches)} needs {need} blocks"
    args.out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                        f"gpu_decode_{args.device}.json")
    return args, shape


def main(argv=None) -> Dict:
    args, shape = parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU (use --device cpu --quick)")
    args.model_dir = write_config(shape)
    out = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            out = json.load(f)
    out.update({"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                "dtype": args.dtype, "model": "toy" if args.quick else "Llama-3.1-8B shape",
                "graphs": not args.enforce_eager, "torch": torch.__version__})
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def save():                         # after every wave: a killed run keeps what it measured
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=float)
    args.save = save
    for part in args.parts:
        t0 = time.perf_counter()
        print(f"== {part}", flush=True)
        PARTS[part](args, out)
        out.setdefault("seconds", {})[part] = time.perf_counter() - t0
        save()
    print(f"wrote {args.out}")
    if FAILED:
        raise SystemExit(f"failed measurements (errors in {args.out}): {', '.join(FAILED)}")
    return out


if __name__ == "__main__":
    main()
