"""Tensor parallelism (--tensor-parallel-size, the mp executor) on this CPU, in three parts.

1. throughput  TP1 (one process, every core's threads), TP1 per-op (the same engine with the
               fused C decode layer off: the path a TP rank runs, since its row-parallel layers
               need an all-reduce between them) and TP2 (rank 0 in this process, one spawned
               rank, one thread each on 2 cores), greedy decode, fixed prompt length,
               ignore_eos, batch 1/16/32, taking turns. Model: the default model's shape with 8
               heads / 4 KV heads (SmolLM2-135M has 9 / 3: TP=2 cannot split it), hidden 512,
               head_dim 64, 30 layers, intermediate 1536, its tokenizer, random weights
               (--load-format dummy). Per configuration: output tok/s, decode-step time, and the
               share of a decode step rank 0 spends in collectives (TPGroup.comm_seconds, which
               includes waiting for the slower rank), split by collective; and how many cores
               other processes used meanwhile (a shared host).
2. transport   Moving one step's StepInput from rank 0 to rank 1: TPGroup.broadcast_object
               (pickle + two gloo broadcasts, what the engine does) vs a shared-memory buffer
               written by rank 0 and read by rank 1, woken by a POSIX semaphore or by spinning
               on a sequence number, vs multiprocessing Pipe and Queue. The StepInputs are
               captured from a real batch-32 run (the 2,048-token prefill step and a plain
               decode step), plus that decode step with 8 of its 32 views re-sent whole (an
               eviction step). One-way time from the send call until rank 1 holds the unpickled
               object (both clocks are CLOCK_MONOTONIC), median of many; rank 1 is pinned to its
               core like a TP rank and is already waiting (a gap before every send). Then the
               decode step's collectives back to back: gloo's all-reduce and gather, TPGroup's
               all-reduce (shared memory where the build has it) and a shared-memory gather
               sketched here.
3. capacity    The capacity frontier with the simulated model at the Llama-3.1-8B shape for the
               KV pool of TP=1/2/4/8 GPUs: each GPU keeps --gpu-gib x --gpu-util minus its 1/N
               of the weights (--weights-gb) for KV and holds 1/N of the KV heads, so the pool
               has N x (per-GPU KV) / (full-model block bytes) blocks. The simulated engine runs
               at TP=1 with num_gpu_blocks_override = that pool (x --scale, with prompt and output
               lengths: the frontier stays comparable). Native vs Naive-Evict vs vToken, H2O at
               ratio 0.5. Trial and search are benchmark_capacity.py's (one implementation): C
               requests all resident together, every step stall-free (no request left out of a
               step for lack of blocks, none held in the queue while the step had room for it),
               none preempted; searched from a guess, refined by each passing trial's pool
               peak, then bisected.

    python benchmarks/benchmark_tp.py            # all parts (~6 min on a quiet 2-core host)
    python benchmarks/benchmark_tp.py --quick    # batch 1 and 32, 1 round, fewer iterations,
                                                 # capacity at TP 1/2/4 (~2 min)
    python benchmarks/benchmark_tp.py --parts throughput --rounds 5   # rerun one part
"""
import json
import os
import pickle
import shutil
import statistics
import struct
import tempfile
import time
from typing import Dict, List, Optional

import numpy as np
import torch

import common

DATE = "2026-12-03"


# ---- part 1: throughput ---------------------------------------------------------------------
def tp_model_dir(heads: int = 8, kv_heads: int = 4, hidden: int = 512) -> str:
    """The default model's config.json with heads that split over 2 (and 4) ranks, and its
    tokenizer, in a temp dir; weights come from --load-format dummy."""
    from vllm.model_executor.gguf_loader import resolve_model
    src = resolve_model(None)
    path = os.path.join(tempfile.gettempdir(), f"vtoken-tp-{hidden}-{heads}h{kv_heads}kv")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("_model_name_or_path", None)
    cfg.update(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
               head_dim=hidden // heads)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(path, name))
    return path


def model_params(path: str) -> int:
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    e, d, layers = c["hidden_size"], c["head_dim"], c["num_hidden_layers"]
    q, kv, inter = c["num_attention_heads"] * d, c["num_key_value_heads"] * d, \
        c["intermediate_size"]
    per_layer = e * (q + 2 * kv) + q * e + 3 * e * inter + 2 * e
    head = 0 if c.get("tie_word_embeddings") else c["vocab_size"] * e
    return layers * per_layer + c["vocab_size"] * e + head + e


def rank0_group(llm):
    """Rank 0's TPGroup (a world-size-1 one at TP=1)."""
    from vllm.distributed.tp_group import TPGroup
    ex = llm.llm_engine.model_executor
    tp = getattr(ex, "tp", None) or getattr(getattr(ex, "driver_worker", None), "tp", None)
    return tp or TPGroup()


class CommProbe:
    """Rank 0's wait time (TPGroup.comm_seconds) split by collective, and calls, by wrapping
    the group's methods on the instance (the model and the executor share rank 0's group)."""
    OPS = ("broadcast_object", "all_reduce", "gather_vocab")

    def __init__(self, tp):
        self.tp = tp
        self.sec = dict.fromkeys(self.OPS, 0.0)
        self.calls = dict.fromkeys(self.OPS, 0)
        self.bcast_wall = 0.0          # broadcast_object incl. pickling
        if tp.world_size > 1:
            for name in self.OPS:
                setattr(tp, name, self._wrap(name, getattr(tp, name)))

    def _wrap(self, name, fn):
        def wrapped(*a, **k):
            c0, t0 = self.tp.comm_seconds, time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.sec[name] += self.tp.comm_seconds - c0
                self.calls[name] += 1
                if name == "broadcast_object":
                    self.bcast_wall += time.perf_counter() - t0
        return wrapped

    def snap(self):
        return (self.tp.comm_seconds, dict(self.sec), dict(self.calls), self.bcast_wall)


_REQ = iter(range(10 ** 9))


class HostLoad:
    """Mean cores the rest of the host used (other processes, and steal) while we ran: host
    busy time from /proc/stat minus this process's and our ranks' CPU time, over the wall
    time. A figure much above 0 means the row shared the 2 cores with something else."""

    def __init__(self, pids: List[int]):
        self.pids = pids
        self.start = self._sample()

    def _sample(self):
        tick = os.sysconf("SC_CLK_TCK")
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:9]]
            ours = 0
            for pid in self.pids:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                ours += int(fields[11]) + int(fields[12])       # utime, stime
        except (OSError, ValueError):
            return None
        own = os.times()
        busy = (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / tick
        return busy, own.user + own.system + ours / tick, time.monotonic()

    def cores(self) -> Optional[float]:
        end = self._sample()
        if self.start is None or end is None:
            return None
        (b0, o0, t0), (b1, o1, t1) = self.start, end
        return max(0.0, (b1 - b0) - (o1 - o0)) / max(t1 - t0, 1e-9)


def rank_pids(llm) -> List[int]:
    return [p.pid for p in getattr(llm.llm_engine.model_executor, "procs", [])]


def run_batch(llm, probe: CommProbe, prompts: List[List[int]], out_len: int,
              capture: Optional[list] = None) -> Dict:
    """Greedy, ignore_eos, every prompt at once, stepped here: tok/s and, per decode step (no
    prompt in it), wall time and rank 0's collective waits."""
    from vllm import SamplingParams
    eng = llm.llm_engine
    ids = []
    for p in prompts:
        ids.append(f"tp{next(_REQ)}")
        eng.add_request(ids[-1], {"prompt_token_ids": p},
                        SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    done, dec_wall, dec_comm, ops_sec, ops_calls, bcast = {}, [], [], {}, {}, 0.0
    ex = eng.model_executor
    if capture is not None:                 # record the StepInputs the executor receives
        orig = ex.execute_model
        ex.execute_model = lambda step: (capture.append(step), orig(step))[1]
    c_start, t_start = probe.snap()[0], time.perf_counter()
    host = HostLoad(rank_pids(llm))
    try:
        while eng.has_unfinished_requests():
            decode = not eng.scheduler.waiting and all(
                s.num_computed_tokens >= s.num_tokens - 1 for s in eng.scheduler.running)
            c0, sec0, calls0, b0 = probe.snap()
            t0 = time.perf_counter()
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
            t1 = time.perf_counter()
            if decode:
                c1, sec1, calls1, b1 = probe.snap()
                dec_wall.append(t1 - t0)
                dec_comm.append(c1 - c0)
                for k in sec1:
                    ops_sec[k] = ops_sec.get(k, 0.0) + sec1[k] - sec0[k]
                    ops_calls[k] = ops_calls.get(k, 0) + calls1[k] - calls0[k]
                bcast += b1 - b0
    finally:
        if capture is not None:
            del ex.execute_model
    total = time.perf_counter() - t_start
    comm_total = probe.snap()[0] - c_start
    n = max(len(dec_wall), 1)
    wall = float(sum(dec_wall)) or 1e-12
    row = {"tok_s": len(prompts) * out_len / total, "seconds": total,
           "decode_steps": len(dec_wall),
           "step_ms": 1e3 * float(np.median(dec_wall)) if dec_wall else None,
           "comm_ms_step": 1e3 * float(sum(dec_comm)) / n,
           "comm_share_decode": float(sum(dec_comm)) / wall,
           "comm_share_generate": comm_total / total,
           "bcast_wall_ms_step": 1e3 * bcast / n, "others_cores": host.cores(),
           "tokens": [tuple(done[i].outputs[0].token_ids) for i in ids]}
    for k in ops_sec:
        row[f"{k}_ms_step"] = 1e3 * ops_sec[k] / n
        row[f"{k}_calls_step"] = ops_calls[k] / n
    return row


CONFIGS = ("TP1", "TP1 per-op", "TP2")   # the middle one: TP=1 with the fused C layer off


def part_throughput(args, log) -> Dict:
    """TP1 (the kernel plan's choice: the whole decode stack in one C call where it wins), TP1
    per-op (the same engine with the fused decode layer switched off: the path every TP=2 rank
    runs, whose row-parallel layers need an all-reduce between them) and TP2, taking turns."""
    from vllm import LLM
    model = tp_model_dir()
    cores = len(os.sched_getaffinity(0))
    batches = args.batch_sizes or ([1, 32] if args.quick else [1, 16, 32])
    rounds = args.rounds or (1 if args.quick else 3)
    tok = common.tokenizer_for(model)
    prompts = common.fixed_length_prompts(tok, max(batches), args.prompt_len, args.seed)
    kw = dict(load_format="dummy", max_num_seqs=max(batches), seed=args.seed,
              max_model_len=args.prompt_len + args.output_len + 64)
    engines, threads, probes = {}, {}, {}
    for tp in (1, 2):              # TP=1 first: the TP=2 executor sets this process's threads
        torch.set_num_threads(cores if tp == 1 else torch.get_num_threads())
        t0 = time.perf_counter()
        engines[tp] = LLM(model, tensor_parallel_size=tp, **kw)
        threads[tp] = torch.get_num_threads()
        probes[tp] = CommProbe(rank0_group(engines[tp]))
        log(f"TP={tp}: engine up in {time.perf_counter() - t0:.1f}s, rank 0 threads "
            f"{threads[tp]}")
    m1 = engines[1].llm_engine.worker.model
    plan = getattr(m1, "plan", None)
    fused_layer = plan is not None and m1.layers[0].fused is not None
    configs = [c for c in CONFIGS if c != "TP1 per-op" or (fused_layer and args.per_op)]
    captured: list = []

    def run(config, b, capture=None, out_len=None):
        tp = 2 if config == "TP2" else 1
        torch.set_num_threads(threads[tp])
        saved = list(plan.decode_layer) if plan is not None else None
        if config == "TP1 per-op":
            plan.decode_layer = [False] * len(saved)
        try:
            return run_batch(engines[tp], probes[tp], prompts[:b], out_len or args.output_len,
                             capture)
        finally:
            if saved is not None:
                plan.decode_layer = saved

    for config in configs:         # warm-up: every batch size, a few tokens; TP=1's batch-32
        for b in batches:          # StepInputs are kept for part 2
            run(config, b, captured if config == "TP1" and b == 32 else None, out_len=12)
    rows = []
    for b in batches:
        per = {c: [] for c in configs}
        for k in range(rounds):    # turns: TP1, TP2, per-op / per-op, TP2, TP1 / ...
            for config in (configs if k % 2 == 0 else configs[::-1]):
                per[config].append(run(config, b))
                r = per[config][-1]
                log(f"  batch {b} {config}: {r['tok_s']:.1f} tok/s, decode step "
                    f"{r['step_ms']:.1f} ms, comm {r['comm_ms_step']:.2f} ms/step "
                    f"({100 * r['comm_share_decode']:.1f}%), others used "
                    f"{r['others_cores'] or 0:.2f} cores")
        for config in configs:
            runs = per[config]
            med = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]   # median run
            tp = 2 if config == "TP2" else 1
            rows.append({"config": config, "tp": tp, "batch": b, "threads_per_rank": threads[tp],
                         **{k: v for k, v in med.items() if k != "tokens"},
                         "tok_s_rounds": [r["tok_s"] for r in runs],
                         "step_ms_rounds": [r["step_ms"] for r in runs],
                         "comm_share_rounds": [r["comm_share_decode"] for r in runs],
                         "others_cores_rounds": [r["others_cores"] for r in runs]})
        by = {r["config"]: r for r in rows if r["batch"] == b}
        t1, t2 = by["TP1"], by["TP2"]
        pairs = [y["tok_s"] / x["tok_s"] for x, y in zip(per["TP1"], per["TP2"])]
        t2["tp2_vs_tp1"] = t2["tok_s"] / t1["tok_s"]
        t2["tp2_vs_tp1_pairs"] = pairs
        t2["tp2_vs_tp1_pair_median"] = statistics.median(pairs)
        t2["step_ratio"] = t2["step_ms"] / t1["step_ms"]
        t2["identical_outputs"] = float(np.mean([a == c for a, c in zip(
            per["TP1"][0]["tokens"], per["TP2"][0]["tokens"])]))
        if "TP1 per-op" in by:
            t2["tp2_vs_tp1_per_op"] = t2["tok_s"] / by["TP1 per-op"]["tok_s"]
    for e in engines.values():
        e.llm_engine.shutdown()
    torch.set_num_threads(cores)
    big = [r for r in rows if r["tp"] == 2 and r["batch"] == max(batches)][0]
    return {"model_dir": model, "params": model_params(model), "batches": batches,
            "rounds": rounds, "configs": configs, "rows": rows, "captured": captured,
            "kernel_plan_source": getattr(plan, "source", None),
            "target": {"batch": big["batch"], "comm_share": big["comm_share_decode"],
                       "met": big["comm_share_decode"] <= 0.10}}


def throughput_tables(res: Dict, args) -> str:
    rows = res["rows"]
    out = []
    for r in rows:
        if r["tp"] == 2:
            by = {x["config"]: x for x in rows if x["batch"] == r["batch"]}
            one, per_op = by["TP1"], by.get("TP1 per-op")
            row = {"batch": r["batch"], "TP1 tok/s": one["tok_s"]}
            if per_op:
                row["TP1 per-op tok/s"] = per_op["tok_s"]
            row.update({"TP2 tok/s": r["tok_s"], "TP2/TP1": r["tp2_vs_tp1"],
                        "pair med": r["tp2_vs_tp1_pair_median"]})
            if per_op:
                row["TP2/per-op"] = r["tp2_vs_tp1_per_op"]
            row.update({"TP1 step ms": one["step_ms"], "TP2 step ms": r["step_ms"],
                        "comm ms/step": r["comm_ms_step"],
                        "comm %": 100 * r["comm_share_decode"],
                        "comm % gen": 100 * r["comm_share_generate"],
                        "same tokens": r["identical_outputs"],
                        "others max": max(x or 0 for c in by.values()
                                          for x in c["others_cores_rounds"])})
            out.append(row)
    two = [r for r in rows if r["tp"] == 2][0]
    title = (f"Tensor parallelism, greedy decode, {args.prompt_len}-token prompts + "
             f"{args.output_len} tokens (ignore_eos), {res['rounds']} round(s) taking turns, "
             f"median run; model: default shape with 8 heads / 4 KV heads "
             f"({res['params'] / 1e6:.0f}M params, dummy weights, fp32); TP1 = 1 process x "
             f"{rows[0]['threads_per_rank']} threads (kernel plan: {res['kernel_plan_source']}), "
             f"TP1 per-op = same, fused C decode layer off (the path TP=2 ranks run), TP2 = 2 "
             f"ranks x {two['threads_per_rank']} thread; pair med = median of per-round TP2/TP1; "
             f"comm = rank 0 waiting in collectives (incl. for the slower rank) per decode step, "
             f"'comm % gen' over the whole generate; others max = the most cores other processes "
             f"used during any run of the row (0 = a quiet host)")
    text = common.table(out, list(out[0]), title)
    split = []
    for r in rows:
        if r["tp"] == 2:
            split.append({"batch": r["batch"], "decode step ms": r["step_ms"],
                          **{f"{k} ms (calls)": f"{r.get(f'{k}_ms_step', 0):.2f} "
                                                f"({r.get(f'{k}_calls_step', 0):.0f})"
                             for k in CommProbe.OPS},
                          "bcast incl. pickle ms": r["bcast_wall_ms_step"]})
    text += "\n" + common.table(split, list(split[0]),
                                "TP=2: rank 0's collective waits per decode step, by collective")
    t = res["target"]
    text += (f"\nTarget (comm <= 10% of a TP=2 decode step at batch {t['batch']}): "
             f"{100 * t['comm_share']:.1f}% -> {'met' if t['met'] else 'NOT met'}")
    print(text.splitlines()[-1])
    return text


# ---- part 2: step-input transport ------------------------------------------------------------
TRANSPORTS = ("gloo broadcast_object", "shm + semaphore", "shm + spin", "mp.Pipe", "mp.Queue")
HDR = struct.Struct("<qq")          # sequence number, payload length
SEQ = struct.Struct("<q")


def resend_views(step, rows: int, view_len: int):
    """The decode step with `rows` of its views re-sent whole (keep 0, view_len new slots),
    as after an eviction or relocation rewrote those tables."""
    import copy
    s = copy.deepcopy(step)
    keep, lens = s.view_keep.copy(), s.view_new_lens.copy()
    keep[:rows], lens[:rows] = 0, view_len
    starts = np.concatenate(([0], np.cumsum(s.view_new_lens)))
    parts = []
    for i in range(len(lens)):
        parts.append(np.arange(100000 * i, 100000 * i + view_len, dtype=np.int64) if i < rows
                     else s.view_new_slots[starts[i]:starts[i + 1]])
    s.view_keep, s.view_new_lens, s.view_new_slots = keep, lens, np.concatenate(parts)
    return s


def capture_steps(args, log) -> list:
    """StepInputs of a batch-32 run (prefill + decode) on the TP=1 engine."""
    from vllm import LLM
    model = tp_model_dir()
    tok = common.tokenizer_for(model)
    prompts = common.fixed_length_prompts(tok, 32, args.prompt_len, args.seed)
    llm = LLM(model, load_format="dummy", max_num_seqs=32, seed=args.seed,
              max_model_len=args.prompt_len + args.output_len + 64)
    cap: list = []
    run_batch(llm, CommProbe(rank0_group(llm)), prompts, 16, cap)
    llm.llm_engine.shutdown()
    return cap


def messages(captured: list) -> Dict[str, object]:
    prefill = max(captured, key=lambda s: s.num_tokens)
    decodes = [s for s in captured if s.num_decodes == s.num_rows == 32]
    decode = decodes[min(8, len(decodes) - 1)]
    return {f"prefill ({prefill.num_tokens} tokens)": prefill,
            f"decode ({decode.num_rows} rows)": decode,
            f"decode, 8/{decode.num_rows} views re-sent (1,024 slots)":
                resend_views(decode, 8, 1024)}


COLLECTIVES = [("gloo all_reduce", 1), ("gloo all_reduce", 32), ("shm all_reduce", 1),
               ("shm all_reduce", 32), ("gloo gather_vocab", 1), ("gloo gather_vocab", 32),
               ("shm gather sketch", 1), ("shm gather sketch", 32)]
MAX_ROWS = 32


def collective_tensor(op: str, rows: int, hidden: int, vocab: int) -> torch.Tensor:
    """A decode step's operand: the hidden state [rows, hidden] (all-reduce) or this rank's
    logits [rows, vocab / 2] (gather)."""
    return torch.ones(rows, vocab // 2 if "gather" in op else hidden)


def shm_group_kwargs(hidden: int) -> Dict:
    """TPGroup's shared-memory all-reduce (vllm/distributed/shm_all_reduce.py), where this
    build has it, sized for MAX_ROWS hidden states."""
    import inspect
    from vllm.distributed.tp_group import TPGroup
    ok = "shm_floats" in inspect.signature(TPGroup.__init__).parameters
    return {"shm_floats": MAX_ROWS * hidden} if ok else {}


class ShmGatherSketch:
    """A sketch for comparison, not the engine's: rank 1's logits to rank 0 through shared
    memory. Call k: rank 1 waits until rank 0 has read call k - 2 (same parity slot), copies
    its shard into slot k % 2 and publishes k; rank 0 spins until it sees k, joins the shard
    to its own and publishes k as read."""

    def __init__(self, buf, offset: int, rank: int, vocab: int):
        self.rank, self.k, self.width = rank, 0, vocab // 2
        self.counters = np.frombuffer(buf, np.int64, 16, offset)     # [0] and [8]: a line each
        self.slots = np.frombuffer(buf, np.float32, 2 * MAX_ROWS * self.width, offset + 128)

    @staticmethod
    def nbytes(vocab: int) -> int:
        return 128 + 4 * 2 * MAX_ROWS * (vocab // 2)

    def __call__(self, local: torch.Tensor) -> Optional[torch.Tensor]:
        self.k += 1
        n = local.numel()
        slot = self.slots[(self.k % 2) * MAX_ROWS * self.width:][:n]
        if self.rank == 1:
            while self.counters[0] < self.k - 2:
                pass
            slot[:] = local.numpy().reshape(-1)
            self.counters[8] = self.k
            return None
        while self.counters[8] < self.k:
            pass
        out = torch.cat((local, torch.from_numpy(slot).view(local.shape)), dim=1)
        self.counters[0] = self.k                    # read: the slot may be reused
        return out


def run_collectives(tp, collectives: List, hidden: int, vocab: int, gather) -> Dict:
    """Every (op, rows, count) back to back on both ranks -> seconds per call (this rank)."""
    import torch.distributed as dist
    out = {}
    for op, rows, count in collectives:
        if op == "shm all_reduce" and getattr(tp, "shm", None) is None:
            continue                                  # a build without it
        t = collective_tensor(op, rows, hidden, vocab)
        ts = []
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        for _ in range(count):
            t0 = time.perf_counter()
            if op == "gloo all_reduce":
                tp.pg.allreduce([t], opts).wait()
            elif op == "shm all_reduce":
                tp.all_reduce(t)                      # TPGroup's path: shared memory
            elif op == "gloo gather_vocab":
                r = tp.gather_vocab(t, vocab)
            else:
                r = gather(t)
            ts.append(time.perf_counter() - t0)
            if "all_reduce" in op:
                assert float(t[0, 0]) == 2.0, f"{op}: wrong sum"
                t.fill_(1.0)
            elif tp.rank == 0:
                assert r.shape == (rows, vocab) and float(r.sum()) == rows * vocab, op
        out[(op, rows)] = ts
    return out


def transport_child(port: int, cores: List[int], shm_name: str, sem, pipe_rx, queue, ack,
                    plan: List, collectives: List, hidden: int, vocab: int,
                    sketch_offset: int) -> None:
    """Rank 1: receive every message of the plan by its transport, report when it held it;
    then join the collectives."""
    from multiprocessing import shared_memory
    from vllm.distributed.tp_group import TPGroup
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    tp = TPGroup(1, 2, port=port, **shm_group_kwargs(hidden))
    shm = shared_memory.SharedMemory(name=shm_name)   # rank 0's tracker: rank 0 unlinks it
    buf = shm.buf
    seen = 0
    for transport, count in plan:
        for _ in range(count):
            if transport == "gloo broadcast_object":
                obj = tp.broadcast_object()
            elif transport == "shm + semaphore":
                sem.acquire()
                seq, n = HDR.unpack_from(buf, 0)
                obj = pickle.loads(buf[HDR.size:HDR.size + n])
            elif transport == "shm + spin":
                while HDR.unpack_from(buf, 0)[0] == seen:
                    pass
                seq, n = HDR.unpack_from(buf, 0)
                obj = pickle.loads(buf[HDR.size:HDR.size + n])
            elif transport == "mp.Pipe":
                obj = pipe_rx.recv()
            else:
                obj = queue.get()
            t = time.perf_counter()
            if transport.startswith("shm"):
                seen = seq
            assert obj.num_rows > 0
            del obj
            ack.send(t)
    gather = ShmGatherSketch(buf, sketch_offset, 1, vocab)
    run_collectives(tp, collectives, hidden, vocab, gather)
    del gather, buf
    shm.close()
    tp.shutdown()


def part_transport(args, captured: list, log) -> Dict:
    import multiprocessing
    from multiprocessing import shared_memory
    from vllm.distributed.tp_group import TPGroup
    from vllm.executor.multiproc_executor import rank_cores
    msgs = messages(captured)
    iters = args.transport_iters or (300 if args.quick else 1500)
    chunks = 5                                   # transports take turns, chunk by chunk
    per_chunk = max(1, iters // chunks)
    plan = [(t, per_chunk) for _ in msgs for _ in range(chunks) for t in TRANSPORTS]
    # one plan entry per (message, chunk, transport), messages in order
    order = [(m, t) for m in msgs for _ in range(chunks) for t in TRANSPORTS]
    sizes = {m: len(pickle.dumps(s, protocol=pickle.HIGHEST_PROTOCOL)) for m, s in msgs.items()}
    ctx = multiprocessing.get_context("spawn")
    cores = sorted(os.sched_getaffinity(0))
    with open(os.path.join(tp_model_dir(), "config.json")) as f:
        cfg = json.load(f)
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    tp = TPGroup(0, 2, connect=False, **shm_group_kwargs(hidden))
    sketch_offset = (HDR.size + 2 * max(sizes.values()) + 4096) // 64 * 64
    shm = shared_memory.SharedMemory(create=True,
                                     size=sketch_offset + ShmGatherSketch.nbytes(vocab))
    sem = ctx.Semaphore(0)
    pipe_rx, pipe_tx = ctx.Pipe(duplex=False)
    queue = ctx.Queue()
    ack_rx, ack_tx = ctx.Pipe(duplex=False)
    coll = [(op, rows, max(50, iters // 3)) for op, rows in COLLECTIVES]
    child = ctx.Process(target=transport_child, daemon=True,
                        args=(tp.port, rank_cores(1, 2, cores), shm.name, sem, pipe_rx, queue,
                              ack_tx, plan, coll, hidden, vocab, sketch_offset))
    child.start()
    host = HostLoad([child.pid])
    tp.connect()
    buf, seq = shm.buf, 0
    lat = {(m, t): [] for m in msgs for t in TRANSPORTS}
    send = {(m, t): [] for m in msgs for t in TRANSPORTS}
    try:
        for (m, transport), (_, count) in zip(order, plan):
            obj = msgs[m]
            for _ in range(count):
                time.sleep(args.gap_ms / 1e3)          # rank 1 waits, as between steps
                t0 = time.perf_counter()
                if transport == "gloo broadcast_object":
                    tp.broadcast_object(obj)
                elif transport.startswith("shm"):
                    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
                    seq += 1
                    buf[HDR.size:HDR.size + len(data)] = data
                    SEQ.pack_into(buf, 8, len(data))
                    SEQ.pack_into(buf, 0, seq)           # the sequence number last
                    if transport == "shm + semaphore":
                        sem.release()
                elif transport == "mp.Pipe":
                    pipe_tx.send(obj)
                else:
                    queue.put(obj)
                t1 = time.perf_counter()
                t_held = ack_rx.recv()
                lat[(m, transport)].append(t_held - t0)
                send[(m, transport)].append(t1 - t0)
        others = host.cores()
        gather = ShmGatherSketch(buf, sketch_offset, 0, vocab)
        coll_times = run_collectives(tp, coll, hidden, vocab, gather)
        del gather
        child.join(30)
    finally:
        if child.is_alive():
            child.kill()
        del buf
        shm.close()
        shm.unlink()
        tp.shutdown()
    local = {}
    for m, s in msgs.items():          # the floor: pickle + unpickle in one process
        ts = []
        for _ in range(min(iters, 500)):
            t0 = time.perf_counter()
            pickle.loads(pickle.dumps(s, protocol=pickle.HIGHEST_PROTOCOL))
            ts.append(time.perf_counter() - t0)
        local[m] = 1e6 * float(np.median(ts))
    rows = []
    for m in msgs:
        row = {"message": m, "bytes": sizes[m], "pickle round trip us": local[m]}
        for t in TRANSPORTS:
            row[f"{t} us"] = 1e6 * float(np.median(lat[(m, t)]))
            row[f"{t} p90 us"] = 1e6 * float(np.percentile(lat[(m, t)], 90))
            row[f"{t} send us"] = 1e6 * float(np.median(send[(m, t)]))
        rows.append(row)
    coll_rows = [{"collective": op, "rows": r,
                  "shape": list(collective_tensor(op, r, hidden, vocab).shape),
                  "median us": 1e6 * float(np.median(coll_times[(op, r)])),
                  "p90 us": 1e6 * float(np.percentile(coll_times[(op, r)], 90)),
                  "calls": len(coll_times[(op, r)])} for op, r in COLLECTIVES
                 if (op, r) in coll_times]
    return {"iterations": per_chunk * chunks, "gap_ms": args.gap_ms, "rows": rows,
            "others_cores": others,
            "collectives": coll_rows,
            "messages": {m: {"num_tokens": s.num_tokens, "num_rows": s.num_rows,
                             "view_new_slots": len(s.view_new_slots)} for m, s in msgs.items()}}


def transport_tables(res: Dict) -> str:
    short = {"gloo broadcast_object": "gloo bcast", "shm + semaphore": "shm+sem",
             "shm + spin": "shm+spin", "mp.Pipe": "Pipe", "mp.Queue": "Queue"}
    med = [{"message": r["message"], "bytes": r["bytes"],
            **{short[t]: f"{r[f'{t} us']:.0f}" for t in TRANSPORTS},
            "pickle+unpickle": f"{r['pickle round trip us']:.0f}"} for r in res["rows"]]
    text = common.table(med, list(med[0]),
                        f"Step-input transport rank 0 -> rank 1: median us from the send call "
                        f"until rank 1 holds the unpickled StepInput ({res['iterations']} per "
                        f"cell, {res['gap_ms']:g} ms gap before each send, rank 1 pinned to its "
                        f"core); last column: pickle + unpickle in one process; other "
                        f"processes used {res.get('others_cores') or 0:.2f} cores meanwhile")
    p90 = [{"message": r["message"],
            **{short[t]: f"{r[f'{t} p90 us']:.0f} / {r[f'{t} send us']:.0f}"
               for t in TRANSPORTS}} for r in res["rows"]]
    text += "\n" + common.table(p90, list(p90[0]),
                                "p90 one-way us / median us rank 0 is blocked in the send call")
    names = {"shm all_reduce": "shm all_reduce (TPGroup)",
             "shm gather sketch": "shm gather (sketch)"}
    coll = [{"collective": names.get(c["collective"], c["collective"]),
             "shape (fp32)": "x".join(map(str, c["shape"])),
             "median us": c["median us"], "p90 us": c["p90 us"]} for c in res["collectives"]]
    text += "\n" + common.table(coll, list(coll[0]),
                                f"Collectives on the same pair, back to back: gloo (the process "
                                f"group), TPGroup.all_reduce (shared memory where the build has "
                                f"it), and a shared-memory gather sketched here; rank 0's time "
                                f"per call, {res['collectives'][0]['calls']} calls, both ranks "
                                f"ready (no waiting for a slower rank)")
    return text


# ---- part 3: capacity frontier by TP size (simulated) ----------------------------------------
def pool_blocks(n: int, args, block: int = 16) -> Dict:
    """KV blocks of a TP=n pool at the Llama-3.1-8B shape (32 layers, 8 KV heads, head_dim 128,
    bf16): each GPU keeps gpu_gib * util - weights / n for KV and holds 8/n of the KV heads."""
    full_block = 2 * 32 * 8 * 128 * 2 * block            # K+V, all layers and heads: 2 MiB
    per_gpu = args.gpu_gib * 2 ** 30 * args.gpu_util - args.weights_gb * 1e9 / n
    rank_block = full_block // n                          # this rank's heads of one block
    return {"tp": n, "per_gpu_kv_gib": per_gpu / 2 ** 30, "pool_gib": n * per_gpu / 2 ** 30,
            "blocks": int(per_gpu // rank_block)}


def part_capacity(args, log) -> Dict:
    """benchmark_capacity's trial and frontier search (all resident, stall-free, no
    preemption) on each TP size's pool."""
    import benchmark_capacity as cap
    s = args.scale or 1 / 64
    prompt_len, output_len = round(4032 * s), round(12288 * s)
    total = prompt_len + output_len
    full_blocks = -(-total // cap.BLOCK)
    ideal_blocks = -(-int((1 - cap.RATIO) * total) // cap.BLOCK)
    model = common.sim_config_dir()
    extra = dict(load_format="simulate", max_model_len=total + cap.BLOCK)
    variants = [("Native", dict(kv_eviction_policy="none"), full_blocks),
                ("Naive-Evict", cap.eviction("none"), full_blocks),
                ("vToken", cap.eviction("vtoken"), ideal_blocks)]
    rows, trials = [], {}
    for n in args.tp_sizes or ([1, 2, 4] if args.quick else [1, 2, 4, 8]):
        pool = pool_blocks(n, args)
        budget = max(1, round(pool["blocks"] * s))
        limit = budget // ideal_blocks + 2
        work = common.synthetic(limit, prompt_len, output_len, 32000, args.seed, sigma=1e-9)
        work = [(w[:prompt_len], output_len) for w, _ in work]
        row = {**pool, "budget": budget, "ideal": budget // ideal_blocks,
               "tail-packed": budget // cap.tail_packed_blocks(total)}
        for name, kw, per_req in variants:
            t0 = time.perf_counter()
            engine_kw = dict(kw, num_gpu_blocks_override=budget, **extra)
            c, tr = cap.frontier(lambda c: cap.trial(model, engine_kw, work, c),
                                 budget // per_req, limit, log, f"TP={n} {name}")
            row[name] = c
            at = tr.get(c)
            row[f"{name} blocks/req"] = at["request_peak_blocks"] if at else None
            row[f"{name} tok/step"] = at["tok_per_step"] if at else None
            row[f"{name} at cap"] = c == limit
            row[f"{name} search s"] = time.perf_counter() - t0
            trials[f"{n}/{name}"] = [tr[k] for k in sorted(tr)]
        row["vToken/Native"] = row["vToken"] / max(row["Native"], 1)
        row["Naive/Native"] = row["Naive-Evict"] / max(row["Native"], 1)
        row["vToken/Native tok/step"] = (row["vToken tok/step"] or 0) / \
            max(row["Native tok/step"] or 1e-9, 1e-9)
        rows.append(row)
    base = rows[0]["vToken/Native"]
    for r in rows:
        r["gain vs TP1 gain"] = r["vToken/Native"] / base
    return {"scale": s, "prompt_len": prompt_len, "output_len": output_len,
            "full_blocks": full_blocks, "ideal_blocks": ideal_blocks, "rows": rows,
            "trials": trials, "gpu_gib": args.gpu_gib, "gpu_util": args.gpu_util,
            "weights_gb": args.weights_gb}


def per_block_gain(r: Dict, full_blocks: int) -> float:
    """vToken's requests per block over Native's exact 1 / full_blocks: the integer ratio
    without Native's rounding (each pool holds x.5 full requests at every TP size here)."""
    return r["vToken"] * full_blocks / r["budget"]


def capacity_tables(res: Dict) -> str:
    def c(r, name):
        return f"{r[name]}{'+' if r.get(f'{name} at cap') else ''}"
    base = per_block_gain(res["rows"][0], res["full_blocks"])
    rows = [{"TP": r["tp"], "KV/GPU GiB": r["per_gpu_kv_gib"], "pool GiB": r["pool_gib"],
             "pool blocks": r["blocks"], "sim budget": r["budget"], "Native": c(r, "Native"),
             "Naive-Evict": c(r, "Naive-Evict"), "vToken": c(r, "vToken"),
             "tail-packed": r.get("tail-packed", ""), "ideal": r["ideal"],
             "vToken/Native": r["vToken/Native"], "vs TP1": r["gain vs TP1 gain"],
             "per block": per_block_gain(r, res["full_blocks"]),
             "per block vs TP1": per_block_gain(r, res["full_blocks"]) / base,
             "tok/step vT/N": r["vToken/Native tok/step"],
             "blocks/req N/NE/vT": f"{r['Native blocks/req'] or 0:.0f}/"
                                   f"{r['Naive-Evict blocks/req'] or 0:.0f}/"
                                   f"{r['vToken blocks/req'] or 0:.1f}"} for r in res["rows"]]
    title = (f"Capacity frontier by TP size (benchmark_capacity's trial and search): max "
             f"concurrent requests all resident at once, every step stall-free, none preempted, "
             f"simulated Llama-3.1-8B shape, H2O 0.5, block 16, default --kv-frag-threshold; "
             f"per GPU {res['gpu_gib']:g} GiB x {res['gpu_util']:g} minus {res['weights_gb']:g} "
             f"GB weights / N for KV (bf16 KV, 2 MiB per 16-token block of the whole model); "
             f"run at scale {scale_text(res['scale'])}: {res['prompt_len']} + "
             f"{res['output_len']} tokens ({res['full_blocks']} blocks full, "
             f"{res['ideal_blocks']} packed = ideal; tail-packed: every block but the still "
             f"filling tail packed, what vToken can hold when all requests peak together), "
             f"budget = pool blocks x scale; per block = vToken's frontier x "
             f"{res['full_blocks']} / budget (vs Native's exact {res['full_blocks']} blocks a "
             f"request, without its integer rounding); tok/step = output tokens per engine step "
             f"at the frontier (throughput proxy); '+' = the search's cap")
    return common.table(rows, list(rows[0]), title)


# ---- main -----------------------------------------------------------------------------------
def scale_text(s: float) -> str:
    return f"1/{round(1 / s)}" if s < 1 and abs(1 / s - round(1 / s)) < 1e-9 else f"{s:g}"


def matplotlib_ticker():
    import matplotlib.ticker
    return matplotlib.ticker


def plot(result: Dict):
    pyplot = common.plt()
    parts = [p for p in ("throughput", "transport", "capacity") if p in result]
    fig, axes = pyplot.subplots(1, len(parts), figsize=(5.2 * len(parts), 3.6), squeeze=False)
    for ax, part in zip(axes[0], parts):
        res = result[part]
        if part == "throughput":
            rows = res["rows"]
            bs = res["batches"]
            x = np.arange(len(bs))
            configs = res["configs"]
            w = 0.8 / len(configs)
            for k, config in enumerate(configs):
                vals = [[r for r in rows if r["config"] == config and r["batch"] == b][0]
                        for b in bs]
                off = (k - (len(configs) - 1) / 2) * w
                ax.bar(x + off, [v["tok_s"] for v in vals], w, label=config)
                if config == "TP2":
                    for i, v in enumerate(vals):
                        ax.text(x[i] + off, v["tok_s"],
                                f"comm\n{100 * v['comm_share_decode']:.0f}%",
                                ha="center", va="bottom", fontsize=7)
            ax.set_xticks(x, [f"batch {b}" for b in bs])
            ax.set_ylabel("output tokens/s")
            ax.set_title("TP=1 (2 threads) vs TP=2 (1 thread/rank)", fontsize=9)
            ax.legend(fontsize=8)
            ax.set_ylim(0, 1.3 * max(r["tok_s"] for r in rows))
        elif part == "transport":
            rows = res["rows"]
            x = np.arange(len(rows))
            w = 0.8 / len(TRANSPORTS)
            for k, t in enumerate(TRANSPORTS):
                ax.bar(x + (k - len(TRANSPORTS) / 2 + 0.5) * w, [r[f"{t} us"] for r in rows], w,
                       label=t)
            ax.set_xticks(x, [r["message"].replace(", ", ",\n") for r in rows], fontsize=7)
            ax.set_yscale("log")
            top = max(r[f"{t} us"] for r in rows for t in TRANSPORTS)
            bottom = min(r[f"{t} us"] for r in rows for t in TRANSPORTS)
            ax.set_ylim(bottom / 1.5, 6 * top)         # room for the legend
            ticks = [t for t in (20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
                     if bottom / 1.5 <= t <= 6 * top]
            ax.set_yticks(ticks, [str(t) for t in ticks])
            ax.yaxis.set_minor_formatter(matplotlib_ticker().NullFormatter())
            ax.set_ylabel("one-way us (median)")
            ax.set_title("StepInput rank 0 -> rank 1", fontsize=9)
            ax.legend(fontsize=7, ncol=2, loc="upper left")
        else:
            rows = res["rows"]
            tps = [r["tp"] for r in rows]
            for name, m in (("Native", "-o"), ("Naive-Evict", "-x"), ("vToken", "-s"),
                            ("tail-packed", ":"), ("ideal", "--")):
                if all(name in r for r in rows):
                    ax.plot(tps, [r[name] for r in rows], m, label=name)
            for r in rows:
                ax.annotate(f"{r['vToken/Native']:.2f}x", (r["tp"], r["vToken"]), fontsize=7,
                            textcoords="offset points", xytext=(-8, 6))
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(tps, [str(t) for t in tps])
            ax.set_xlabel("TP size (GPUs)")
            ax.set_ylabel("max concurrent requests")
            lo, hi = min(r["Native"] for r in rows) / 2, 2 * max(r["ideal"] for r in rows)
            ticks = [t for t in (10, 20, 50, 100, 200, 500, 1000, 2000) if lo <= t <= hi]
            ax.set_yticks(ticks, [str(t) for t in ticks])
            ax.yaxis.set_minor_formatter(matplotlib_ticker().NullFormatter())
            ax.set_title(f"Capacity by TP size, simulated Llama-3.1-8B, scale "
                         f"{scale_text(res['scale'])}", fontsize=9)
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def main():
    p = common.base_parser(__doc__)
    p.add_argument("--parts", nargs="+", default=["throughput", "transport", "capacity"],
                   choices=["throughput", "transport", "capacity"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds of turns per batch size (default 3, quick 1)")
    p.add_argument("--no-per-op", dest="per_op", action="store_false",
                   help="skip the TP1 per-op configuration")
    p.add_argument("--transport-iters", type=int, default=None,
                   help="sends per message and transport (default 1500, quick 300)")
    p.add_argument("--gap-ms", type=float, default=1.0, help="pause before every send")
    p.add_argument("--tp-sizes", type=int, nargs="+", default=None,
                   help="capacity: TP sizes (default 1 2 4 8, quick 1 2 4)")
    p.add_argument("--scale", type=float, default=None,
                   help="capacity: length and pool scale (default 1/64: 63 + 192 tokens, 16 "
                        "blocks full, 8 packed)")
    p.add_argument("--gpu-gib", type=float, default=80.0)
    p.add_argument("--gpu-util", type=float, default=0.9)
    p.add_argument("--weights-gb", type=float, default=16.06,
                   help="Llama-3.1-8B bf16 weights (8.03B params x 2 bytes)")
    p.add_argument("--out", default=None,
                   help="result name (default benchmark_tp, or benchmark_tp_<parts> for a subset)")
    args = p.parse_args()
    if args.threads is None:
        args.threads = len(os.sched_getaffinity(0))   # TP=1 uses every core (see part 1)
    common.setup(args)
    t_start = time.perf_counter()
    print(common.machine(), flush=True)
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)

    def log(msg):
        print(f"[{time.perf_counter() - t_start:6.0f}s] {msg}", flush=True)

    result, texts = {"date": DATE, "load_at_start": load}, []
    captured: list = []
    if "throughput" in args.parts:
        res = part_throughput(args, log)
        captured = res.pop("captured")
        result["throughput"] = res
        texts.append(throughput_tables(res, args))
    if "transport" in args.parts:
        if not captured:
            captured = capture_steps(args, log)
        result["transport"] = part_transport(args, captured, log)
        texts.append(transport_tables(result["transport"]))
    if "capacity" in args.parts:
        result["capacity"] = part_capacity(args, log)
        texts.append(capacity_tables(result["capacity"]))
    result["load_at_end"] = os.getloadavg()
    result["seconds"] = time.perf_counter() - t_start
    text = "\n\n".join(texts)
    print(f"\n{text}\n\nload average at end: {result['load_at_end'][0]:.2f}; "
          f"{result['seconds'] / 60:.1f} min")
    name = args.out or ("benchmark_tp" if len(args.parts) == 3 else
                        "benchmark_tp_" + "_".join(args.parts))
    common.save(name, {"args": vars(args), **result, "table": text}, plot(result))


if __name__ == "__main__":
    main()
