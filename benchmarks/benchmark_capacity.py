"""Capacity frontier: under a fixed KV memory, the largest concurrency C whose C requests are all
resident at once and run every step, stall-free, to completion without preemption. Native vs
Naive-Evict vs vToken (H2O, ratio 0.5, default --kv-frag-threshold) vs vToken + fp8 KV (the same
bytes hold more blocks), against the packed ideal floor(blocks / ceil(live / block_size)): what
perfect packing of each request's live tokens would hold.

A trial fails at the first stalled row-step: a running request the step left out for lack of
blocks (it waits for repacking to free some), a waiting request held back while the step had
token budget and a sequence slot for it, or a preemption. Counting such waits as resident (the
earlier test) let requests take turns in the pool and passed C above the packed ideal.

    python benchmarks/benchmark_capacity.py --quick               # real engine, 120 blocks
    python benchmarks/benchmark_capacity.py --simulate --quick    # paper setup at 1/8 scale
    python benchmarks/benchmark_capacity.py --simulate --scale 1  # paper scale (hours on 2 cores)

--simulate runs the paper's experiment (Llama-3.1-8B shape, block 16, 5,427 and 11,519 usable
bf16 blocks, 4,032-token prompts, output_len 12,288) through the real scheduler, block manager,
token tables, policy and planner, with synthetic attention statistics (--load-format simulate).
--scale s multiplies prompt, output and budgets by s, so blocks per request and the pool shrink
together and the frontier stays comparable with the paper's. --shape qwen2.5-14b runs its
larger-model check instead (48 layers, 8 KV heads x 128; output_len 8,192, 3,261 usable blocks;
Native 3 -> vToken 6). The paper gives no prompt length there: Native feasible through C=3 and
failing at C=4 in 3,261 blocks needs 816-1,087 blocks a request in full, 13,041-17,392 tokens, so
a LongBench-length prompt of 8,192 (1,024 blocks full, 512 packed, as the Llama setup's 1,020 /
512).

    python benchmarks/benchmark_capacity.py --simulate --shape qwen2.5-14b --quick

fp8 sizing. The real engine gets --kv-cache-memory = the baseline pool's bytes (blocks of the
KV dtype --kv-cache-dtype auto gives the model: bf16 for the default GGUF model, float32 for a
float32 checkpoint) with --kv-cache-dtype fp8 and sizes the pool itself (2x or 4x the blocks).
The simulated executor cannot store its synthetic statistics in fp8 (a RuntimeError on the
first write), so there the variant is vToken with the block count the same bytes hold at fp8
instead of bf16 (2x), computed from the bytes per block of each dtype; its eviction decisions
are the bf16 run's.
"""
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

import common

BLOCK = 16
RATIO = 0.5


# ---- sizing ------------------------------------------------------------------------------------
def block_bytes(hf_config, elem_bytes: int, block_size: int = BLOCK) -> int:
    """K + V of one block, every layer and KV head."""
    head_dim = getattr(hf_config, "head_dim", None) or \
        hf_config.hidden_size // hf_config.num_attention_heads
    return (2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim
            * elem_bytes * block_size)


def blocks_in_bytes(blocks: int, from_elem: int, to_elem: int) -> int:
    """Blocks of `to_elem`-byte elements in the memory of `blocks` blocks of `from_elem`."""
    return blocks * from_elem // to_elem


def packed_blocks(total: int, ratio: float = RATIO, block_size: int = BLOCK) -> int:
    """Blocks the live tokens of a finished request fill when packed: the ideal's divisor."""
    return -(-int((1 - ratio) * total) // block_size)


def tail_packed_blocks(total: int, ratio: float = RATIO, block_size: int = BLOCK) -> int:
    """Blocks a request needs at its peak when every block but the tail is packed full. The
    tail (still filling, never repacked) holds the newest t tokens, all live under H2O's recent
    window; the other live tokens fill ceil((live - t) / block_size) blocks. The step writing
    token n holds the floor((1 - ratio) * (n - 1)) kept before it, plus that token.
        total 255, block 16: n = 254 -> live 127, t = 14 -> ceil(113 / 16) + 1 = 9 (packed: 8)
    """
    need = 0
    for n in range(max(1, total - 4 * block_size), total):
        live, t = int((1 - ratio) * (n - 1)) + 1, (n - 1) % block_size + 1
        need = max(need, -(-(live - t) // block_size) + 1)
    return need


# ---- one trial ---------------------------------------------------------------------------------
def held_rows(running: List, before: Dict, waiting: List, max_tokens: int, max_seqs: int,
              num_running_after: int) -> int:
    """Row-steps the last step held back for lack of blocks.

    `running` is the running list before the step (the order the scheduler serves it), `before`
    every unfinished request's num_computed_tokens then. The scheduler serves running rows in
    order until the token budget is spent, then admits waiting ones while budget and a sequence
    slot remain. So a running row left out while budget remained is held for blocks: all of
    them if the running rows did not spend the budget, else those before the last served row.
        running [a b c d], served [1 0 1 0], budget spent by c -> b held, d out of budget: 1
    Waiting requests count when the step ended with budget and a slot to spare.
    """
    took = [max(s.num_computed_tokens - before[s], 0) for s in running]
    spent = sum(took) >= max_tokens
    served = [n > 0 for n in took]
    last = max((i for i, x in enumerate(served) if x), default=-1)
    held = sum(1 for i, (s, x) in enumerate(zip(running, served))
               if not x and not s.is_finished and (not spent or i < last))
    total = sum(max(s.num_computed_tokens - n, 0) for s, n in before.items())
    if waiting and total < max_tokens and num_running_after < max_seqs:
        held += len(waiting)
    return held


def trial(model: Optional[str], engine_kw: Dict, work: List[Tuple[List[int], int]], c: int,
          stop_early: bool = True, token_bytes: Optional[int] = None) -> Dict:
    """C requests at once. passed: all resident together at some point, every step stall-free,
    none preempted, each finishing with its full output. stop_early ends the run at the first
    sign of failure (then the stall count is a lower bound). token_bytes: bytes one relocated
    token copies (None: the engine's own bytes_moved)."""
    from vllm import LLM, SamplingParams
    llm = LLM(model, max_num_seqs=c, seed=0, kv_min_tokens=0, **engine_kw)
    eng = llm.llm_engine
    sched, cfg = eng.scheduler, eng.scheduler_config
    for i, (prompt, out_len) in enumerate(work[:c]):
        eng.add_request(str(i), {"prompt_token_ids": prompt},
                        SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    resident, held, steps, done, t0 = 0, 0, 0, [], time.perf_counter()
    while eng.has_unfinished_requests():
        running = list(sched.running)
        before = {s: s.num_computed_tokens for s in running + list(sched.waiting)}
        outs = eng.step()
        steps += 1
        held += held_rows(running, before, list(sched.waiting), cfg.max_num_batched_tokens,
                          cfg.max_num_seqs, len(sched.running))
        resident = max(resident, len(sched.running))
        done += [o for o in outs if o.finished]
        if stop_early and (sched.num_preemptions or held or (done and resident < c)):
            break
    secs = time.perf_counter() - t0
    stats = llm.get_kv_stats()
    preempted = sched.num_preemptions
    eng.abort_request([str(i) for i in range(c)])
    complete = len(done) == c and all(len(o.outputs[0].token_ids) == n for o, (_, n) in zip(
        sorted(done, key=lambda o: int(o.request_id)), work))
    passed = complete and resident == c and not preempted and not held
    moved = stats["relocated_tokens"]
    copied = moved * token_bytes if token_bytes is not None else stats.get("bytes_moved", 0)
    tokens = sum(n for _, n in work[:c])
    return {"c": c, "passed": bool(passed), "stalled_row_steps": held, "preemptions": preempted,
            "max_resident": resident, "steps": steps, "pool_blocks": eng.kv.num_blocks,
            "pool_peak": eng.kv.bm.peak_used,
            "request_peak_blocks": float(np.mean([o.kv_stats["peak_blocks"] for o in done]))
            if done else None,
            "live_tokens": float(np.mean([o.kv_stats["live_tokens"] for o in done]))
            if done else None,
            "relocation_events": stats["relocation_events"],
            "pressure_relocations": stats["pressure_relocations"],
            "relocated_tokens": moved, "bytes_copied": copied,
            "bytes_per_request": copied / c, "tok_per_step": tokens / steps if passed else None,
            "seconds": secs}


# ---- the search --------------------------------------------------------------------------------
def frontier(run: Callable[[int], Dict], guess: int, limit: int, log: Callable[[str], None],
             label: str) -> Tuple[int, Dict[int, Dict]]:
    """Largest C in [0, limit] whose trial passes, taking pass/fail as monotone in C: start at
    the guess, jump to what a passing trial's pool peak predicts (pool blocks / peak per
    request), else gallop; below a failure step down (5% of the guess, doubling) until one
    passes; bisect between the largest pass and the smallest failure.
    -> (C_max, trials by C)."""
    tried: Dict[int, Dict] = {}
    lo, hi, step, down = 0, limit + 1, 1, max(1, guess // 20)
    c = max(1, min(guess, limit))
    while hi - lo > 1:
        t = tried[c] = run(c)
        verdict = "passes" if t["passed"] else (
            f"{t['stalled_row_steps']} stalled row-steps" if t["stalled_row_steps"] else
            f"{t['preemptions']} preemptions" if t["preemptions"] else
            f"fails (resident {t['max_resident']})")
        log(f"  {label} C={c}: {verdict} (pool peak {t['pool_peak']}/{t['pool_blocks']}, "
            f"{t['seconds']:.0f}s)")
        if t["passed"]:
            lo = c
            pred = int(c * t["pool_blocks"] / max(t["pool_peak"], 1))
            if pred <= lo + 1:          # the peak says little more: gallop
                pred, step = lo + step, 2 * step
            c = min(pred, hi - 1)
        elif lo:
            hi, c = c, (lo + c) // 2
        else:                           # no pass yet: step down 5% of the guess, doubling
            hi, c, down = c, max(1, c - down), 2 * down
        if hi - lo > 1 and c in tried:
            c = (lo + hi) // 2
    return lo, tried


# ---- setups ------------------------------------------------------------------------------------
def eviction(reclamation: str) -> Dict:
    return dict(kv_eviction_policy="h2o", kv_eviction_ratio=RATIO, kv_reclamation=reclamation)


def variants(budget: int, fp8_pool: Dict, fp8_blocks: int,
             extra_thresholds: List[float]) -> List[Tuple[str, Dict, int]]:
    """(name, engine keywords, pool blocks) per variant; fp8_pool sizes the fp8 variant."""
    base = dict(num_gpu_blocks_override=budget)
    out = [("Native", dict(base, kv_eviction_policy="none"), budget),
           ("Naive-Evict", dict(base, **eviction("none")), budget),
           ("vToken", dict(base, **eviction("vtoken")), budget)]
    out += [(f"vToken (frag {t:g})", dict(base, **eviction("vtoken"), kv_frag_threshold=t),
             budget) for t in extra_thresholds]
    out.append(("vToken + fp8", dict(fp8_pool, **eviction("vtoken")), fp8_blocks))
    return out


# the paper's setups (Sec. 5.4) per common.SIM_SHAPES shape: prompt, output, usable KV blocks
PAPER_SETUPS = {"llama-3.1-8b": (4032, 12288, (5427, 11519)),
                "qwen2.5-14b": (8192, 8192, (3261,))}
SHAPE_NAMES = {"llama-3.1-8b": "Llama-3.1-8B", "qwen2.5-14b": "Qwen2.5-14B"}


def simulated_setup(args) -> Dict:
    import transformers
    scale = args.scale or (0.125 if args.quick else 0.25)
    prompt, output, budgets = PAPER_SETUPS[args.shape]
    prompt_len = args.prompt_len or round(prompt * scale)
    output_len = args.output_len or round(output * scale)
    model = common.sim_config_dir(shape=args.shape)     # 32,000-token vocab: cheap logits
    hf = transformers.AutoConfig.from_pretrained(model)
    return {"model": model, "scale": scale, "prompt_len": prompt_len, "output_len": output_len,
            "budgets": args.budgets or [round(b * scale) for b in budgets],
            "label": f"simulated {SHAPE_NAMES[args.shape]} shape, bf16 KV baseline, "
                     f"scale {scale:g}",
            "extra": dict(load_format="simulate", max_model_len=prompt_len + output_len + BLOCK),
            "vocab": 32000, "token_bytes": {"bf16": block_bytes(hf, 2, 1),
                                            "fp8": block_bytes(hf, 1, 1)},
            "fp8_factor": (2, 1)}


def real_setup(args) -> Dict:
    import transformers
    model, label = common.model_for(args)
    tok = common.tokenizer_for(model)
    from vllm.attention import kv_quant
    from vllm.model_executor.gguf_loader import resolve_model, resolve_quantization
    hf = transformers.AutoConfig.from_pretrained(resolve_model(model))
    low_bit = resolve_quantization(model, "auto")[0] == "gguf" or \
        str(getattr(hf, "torch_dtype", None)).endswith("bfloat16")
    kv = kv_quant.resolve("auto", "cpu", "float32", low_bit)       # the baseline's KV dtype
    elem = kv_quant.FLOAT_DTYPES[kv].itemsize
    return {"model": model, "scale": 1.0, "prompt_len": args.prompt_len or 192,
            "output_len": args.output_len or 256, "budgets": args.budgets or (
                [120] if args.quick else [120, 240]),
            "label": f"{label}, {kv} KV baseline", "extra": {}, "tokenizer": tok,
            "base_block_bytes": block_bytes(hf, elem), "token_bytes": None,
            "fp8_factor": (elem, 1)}


def workload(setup: Dict, n: int, args) -> List[Tuple[List[int], int]]:
    p, o = setup["prompt_len"], setup["output_len"]
    if "tokenizer" in setup:
        work = common.workload("longbench", n, setup["tokenizer"], p, o, args, fixed_output=True)
    else:
        work = common.synthetic(n, p, o, setup["vocab"], args.seed, sigma=1e-9)
    return [(w[:p], o) for w, _ in work]


def fp8_sizing(setup: Dict, budget: int) -> Tuple[Dict, int]:
    """Engine keywords and pool blocks of the fp8 variant in the baseline pool's bytes."""
    blocks = blocks_in_bytes(budget, *setup["fp8_factor"])
    if "base_block_bytes" in setup:        # the engine sizes an fp8 pool from bytes itself
        return dict(kv_cache_memory=budget * setup["base_block_bytes"],
                    kv_cache_dtype="fp8"), blocks
    return dict(num_gpu_blocks_override=blocks), blocks


def search_variant(setup: Dict, name: str, kw: Dict, blocks: int, work, log,
                   label: str) -> Tuple[Dict, List[Dict]]:
    """One variant's frontier in a pool of `blocks` blocks -> (row entries, its trials)."""
    total = setup["prompt_len"] + setup["output_len"]
    per_req = -(-total // BLOCK) if name in ("Native", "Naive-Evict") else packed_blocks(total)
    tb = setup["token_bytes"] and setup["token_bytes"]["fp8" if "fp8" in name else "bf16"]
    limit = min(len(work), blocks // packed_blocks(total) + 2)
    c, tried = frontier(lambda c: trial(setup["model"], dict(kw, **setup["extra"]), work, c,
                                        token_bytes=tb),
                        blocks // per_req, limit, log, f"{label} {name}")
    at = tried.get(c, {})
    if at.get("pool_blocks", blocks) != blocks:
        raise AssertionError(f"{name}: the engine made {at['pool_blocks']} blocks, "
                             f"expected {blocks}")
    fail = tried.get(c + 1)
    row = {name: c, f"{name} at cap": c == limit,
           f"{name} blocks/req": at.get("request_peak_blocks"),
           f"{name} bytes/req": at.get("bytes_per_request"),
           f"{name} pressure plans": at.get("pressure_relocations"),
           f"{name} C+1 stalls": fail["stalled_row_steps"] if fail else None}
    return row, [tried[k] for k in sorted(tried)]


def roomy_trial(setup: Dict, budget: int, c: int, work, log) -> Dict:
    """vToken at half its frontier: the pool is never short, so no pressure plan may run and
    every copy is one the --kv-frag-threshold trigger makes."""
    kw = dict(num_gpu_blocks_override=budget, **eviction("vtoken"), **setup["extra"])
    t = trial(setup["model"], kw, work, c, stop_early=False,
              token_bytes=setup["token_bytes"] and setup["token_bytes"]["bf16"])
    log(f"  budget {budget} vToken C={c} (pool not short): pressure plans "
        f"{t['pressure_relocations']}, {t['bytes_per_request'] / 2**20:.2f} MiB copied per "
        f"request")
    return t


def run_budget(setup: Dict, budget: int, work, names, args, log) -> Tuple[Dict, Dict]:
    total = setup["prompt_len"] + setup["output_len"]
    packed, tail = packed_blocks(total), tail_packed_blocks(total)
    fp8_pool, fp8_blocks = fp8_sizing(setup, budget)
    row = {"budget": budget, "ideal": budget // packed, "tail-packed": budget // tail,
           "fp8 blocks": fp8_blocks, "fp8 ideal": fp8_blocks // packed}
    trials = {}
    for name, kw, blocks in variants(budget, fp8_pool, fp8_blocks, args.frag_thresholds):
        if name in names:
            entries, trials[f"{budget}/{name}"] = search_variant(
                setup, name, kw, blocks, work, log, f"budget {budget}")
            row.update(entries)
    if "vToken" in row:
        row["vToken % ideal"] = 100 * row["vToken"] / max(row["ideal"], 1)
        roomy = roomy_trial(setup, budget, max(1, row["vToken"] // 2), work, log)
        row.update({"roomy C": roomy["c"], "roomy bytes/req": roomy["bytes_per_request"],
                    "roomy pressure plans": roomy["pressure_relocations"]})
        trials[f"{budget}/vToken roomy"] = [roomy]
    if "vToken + fp8" in row:
        row["vToken+fp8 % fp8 ideal"] = 100 * row["vToken + fp8"] / max(row["fp8 ideal"], 1)
    for name in ("vToken", "vToken + fp8"):
        if row.get("Native") and name in row:
            row[f"{name} / Native"] = row[name] / row["Native"]
    return row, trials


def tables(rows: List[Dict], names: List[str], title: str) -> str:
    def c(r, n):
        return f"{r[n]}{'+' if r.get(f'{n} at cap') else ''}" if n in r else ""
    front = [{"budget": r["budget"], **{n: c(r, n) for n in names}, "ideal": r["ideal"],
              "tail-packed": r["tail-packed"], "fp8 ideal": r["fp8 ideal"],
              "vToken % ideal": r.get("vToken % ideal"),
              "vT+fp8 % fp8 ideal": r.get("vToken+fp8 % fp8 ideal"),
              "vT+fp8 / Native": r.get("vToken + fp8 / Native")} for r in rows]
    text = common.table(front, list(front[0]), title)
    mib = 2 ** 20
    vt = [n for n in names if "vToken" in n]
    copy = [{"budget": r["budget"],
             **{f"{n} blocks/req": r.get(f"{n} blocks/req") for n in names},
             **{f"{n} MiB/req": (r.get(f"{n} bytes/req") or 0) / mib for n in vt},
             **{f"{n} pressure": r.get(f"{n} pressure plans") for n in vt},
             "roomy C": r.get("roomy C"), "roomy MiB/req": (r.get("roomy bytes/req") or 0) / mib,
             "roomy pressure": r.get("roomy pressure plans")} for r in rows]
    return text + "\n" + common.table(
        copy, list(copy[0]), "At each frontier: peak blocks per request, relocation bytes "
        "copied per admitted request (MiB) and pressure-driven plans; 'roomy': vToken at half "
        "its frontier, the pool never short")


def plot(rows: List[Dict], names: List[str], setup: Dict, simulate: bool):
    pyplot = common.plt()
    fig, ax = pyplot.subplots(figsize=(6.4, 3.4))
    series = names + ["ideal", "fp8 ideal"]
    width = 0.8 / len(series)
    for k, name in enumerate(series):
        bars = ax.bar([i + (k - len(series) / 2 + 0.5) * width for i in range(len(rows))],
                      [r.get(name, 0) for r in rows], width, label=name,
                      hatch="//" if "ideal" in name else None, alpha=0.6 if "ideal" in name else 1)
        ax.bar_label(bars, fontsize=6)
    ax.set_xticks(range(len(rows)), [f"{r['budget']} blocks" + (
        f"\n(paper: {r['budget'] / setup['scale']:,.0f})" if simulate else "") for r in rows])
    ax.set_ylabel("max concurrency, stall-free")
    ax.set_title(f"Capacity frontier, H2O 0.5; {setup['label']}", fontsize=8)
    ax.legend(fontsize=6, ncol=2)
    return fig


def main():
    p = common.base_parser(__doc__)
    p.add_argument("--simulate", action="store_true", help="paper scale via --load-format simulate")
    p.add_argument("--scale", type=float, default=None, help="--simulate: length/budget scale")
    p.add_argument("--shape", default="llama-3.1-8b", choices=list(PAPER_SETUPS),
                   help="--simulate: model shape and its paper setup")
    p.add_argument("--budgets", type=int, nargs="+", default=None)
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--variants", nargs="+", default=None,
                   help="subset of Native, Naive-Evict, vToken, 'vToken + fp8'")
    p.add_argument("--out", default=None, help="result name (default benchmark_capacity[_sim])")
    p.add_argument("--frag-thresholds", type=float, nargs="*", default=[],
                   help="extra vToken variants at these --kv-frag-threshold values")
    args = p.parse_args()
    common.setup(args)
    setup = simulated_setup(args) if args.simulate else real_setup(args)
    names = args.variants or (["Native", "Naive-Evict", "vToken"] +
                              [f"vToken (frag {t:g})" for t in args.frag_thresholds] +
                              ["vToken + fp8"])
    packed = packed_blocks(setup["prompt_len"] + setup["output_len"])
    n_max = max(blocks_in_bytes(b, *setup["fp8_factor"]) for b in setup["budgets"]) // packed + 2
    work = workload(setup, n_max, args)
    setup["prompt_len"] = max(len(p) for p, _ in work)     # a real prompt may be shorter
    total = setup["prompt_len"] + setup["output_len"]
    full, packed, tail = -(-total // BLOCK), packed_blocks(total), tail_packed_blocks(total)
    t0 = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t0:6.0f}s] {msg}", flush=True)

    rows, trials = [], {}
    for budget in setup["budgets"]:
        row, tr = run_budget(setup, budget, work, names, args, log)
        rows.append(row)
        trials.update(tr)
    title = (f"Capacity frontier (max concurrency, all resident, stall-free, no preemption), "
             f"H2O ratio {RATIO}, block {BLOCK}, prompt {setup['prompt_len']} + output "
             f"{setup['output_len']} tokens: {full} blocks/request full, {packed} packed "
             f"(ideal), {tail} packed but the tail (tail-packed); "
             f"fp8: {setup['fp8_factor'][0]}x the blocks in the same bytes; '+' = search cap; "
             f"{setup['label']}; {common.machine()}")
    text = tables(rows, names, title)
    name = args.out or ("benchmark_capacity" if not args.simulate else "benchmark_capacity_sim"
                        if args.shape == "llama-3.1-8b" else f"benchmark_capacity_sim_{args.shape}")
    common.save(name, {"args": vars(args), "model": setup["label"], "rows": rows,
                       "shape": args.shape if args.simulate else None,
                       "setup": {k: setup[k] for k in ("scale", "prompt_len", "output_len",
                                                       "budgets")},
                       "trials": trials, "full_blocks": full, "ideal_blocks": packed,
                       "tail_packed_blocks": tail,
                       "seconds": time.perf_counter() - t0, "table": text},
                plot(rows, names, setup, args.simulate))


if __name__ == "__main__":
    main()
