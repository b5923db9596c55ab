"""SLA-constrained serving throughput: a concurrency scan against the OpenAI server.

For each variant (Native, Naive-Evict, vToken; same policy and KV block budget) this starts
`python -m vllm.entrypoints.openai.api_server ... --port P`, then for each concurrency C sends
streaming /v1/completions requests (greedy, EOS ignored) with at most C in flight: a closed loop,
`vllm bench serve --max-concurrency C`'s client and metrics (vllm/benchmarks/serve.py). With
--request-rate R [R ...] the points are open-loop instead: Poisson arrivals at R requests/s
(`vllm bench serve --request-rate R`), --num-prompts requests each. SLA = 1.05 x Naive-Evict's
p95 request latency at the reference point (C = --c-ref, or rate --rate-ref); a variant's
selected point is its highest-throughput point whose p95 meets the SLA. --policy A B ... scans
each policy in turn on the same servers (every request names its own), one result per policy.

The default scan is a CPU's counterpart of the paper's (H100, C_ref = 8): the reference
concurrency sits where a larger batch still decodes more tokens per second, which on a CPU of
a few cores holds over the first few requests only, so C_ref = 2 and the scan goes to 4
(--quick) or 8; the KV pool holds about 5/8 of C_ref mean requests without eviction. A prompt
token's prefill costs a CPU more than half a decode token's at batch 4, so outputs are 128
tokens long (the step times behind these choices: benchmarks/HISTORY.md, 2026-12-07).

Peer mode (--llamacpp DIR): our server (default model, no eviction) and llama.cpp's
`llama-server` on the same GGUF file (--weights: f32, the default, is our float32 path against
an F32 GGUF of the same values; q4_1 / q4_0 / q8_0 run that file's blocks on both) run side by
side; for each client level C (default 1, 8, 32) both get the same closed-loop waves from the
peer scripts' load_client.py: C concurrent
requests of --prompt-len token ids, --output-len new tokens each (greedy, EOS ignored), all awaited,
repeated --waves times; aggregate tok/s = generated tokens / wave time, median over waves. The
servers take turns wave by wave (pairs in ABBA order), each with the other one idle, so a drift of
the shared host moves both alike; paired_ratio is the median of the per-pair ratios.

    python benchmarks/benchmark_serving.py --quick
    python benchmarks/benchmark_serving.py --quick --policy random h2o scissorhands
    python benchmarks/benchmark_serving.py --url http://127.0.0.1:8000   # scan a running server
    python benchmarks/benchmark_serving.py --quick --request-rate 0.5 1 2   # open-loop points
    python benchmarks/benchmark_serving.py --threads 2 --llamacpp DIR   # vs llama-server
    python benchmarks/benchmark_serving.py --threads 2 --llamacpp DIR --weights q4_1
"""
import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import common
from vllm.benchmarks import serve
from vllm.benchmarks.datasets import SampleRequest
from vllm.benchmarks.lib.endpoint_request_func import ASYNC_REQUEST_FUNCS
from vllm.benchmarks.metrics import calculate_metrics


def run_point(url, model, work, num_requests, concurrency=None, rate=math.inf, seed=0,
              body=None):
    """num_requests requests cycling through work, through `vllm bench serve`'s client: at most
    `concurrency` in flight (closed loop at rate inf) or Poisson arrivals at `rate` req/s.
    body: request-body fields every request carries (e.g. its kv_eviction_policy)."""
    requests = [SampleRequest(p, len(p), n) for p, n in
                (work[i % len(work)] for i in range(num_requests))]
    outputs, duration = asyncio.run(serve.benchmark(
        ASYNC_REQUEST_FUNCS["openai"], f"{url}/v1/completions", model, None, requests,
        request_rate=rate, max_concurrency=concurrency, ignore_eos=True,
        extra_body={"temperature": 0, **(body or {})}, seed=seed))
    failed = [o.error for o in outputs if not o.success]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(outputs)} requests failed: {failed[0]}")
    m, _ = calculate_metrics(outputs, duration, [50, 95])
    return {"requests": m.completed, "tok_s": m.output_throughput,
            "p50_s": m.percentile_ms("e2el", 50) / 1e3, "p95_s": m.percentile_ms("e2el", 95) / 1e3,
            "ttft_p95_s": m.percentile_ms("ttft", 95) / 1e3}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The api_server in a child process, stopped by its pid when the block exits."""

    def __init__(self, flags, threads):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vtoken-server-", suffix=".log",
                                               delete=False)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
               "--port", str(self.port), "--uvicorn-log-level", "warning", *flags]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=common.die_with_parent)

    def ready(self, httpx) -> bool:
        if httpx.get(f"{self.url}/health", timeout=2).status_code != 200:
            return False
        self.model = httpx.get(f"{self.url}/v1/models").json()["data"][0]["id"]
        return True

    def __enter__(self):
        import httpx
        try:
            deadline = time.time() + 600
            while time.time() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited; see {self.log.name}")
                try:
                    if self.ready(httpx):
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(1)
            raise TimeoutError(f"server did not come up; see {self.log.name}")
        except BaseException:
            self.__exit__()                         # no half-started server is left behind
            raise

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class LlamaServer(Server):
    """llama.cpp's llama-server in a child process: -np slots of per_slot context each."""

    def __init__(self, llamacpp_dir, gguf, threads, slots, per_slot):
        self.binary = common.llamacpp_binary(llamacpp_dir, "llama-server")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log",
                                               delete=False)
        self.cmd = [self.binary, "-m", gguf, "-t", str(threads), "-c", str(slots * per_slot),
                    "-np", str(slots), "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     preexec_fn=common.die_with_parent)

    def ready(self, httpx) -> bool:                 # /health answers 503 while loading
        self.model = "llama-server"
        return httpx.get(f"{self.url}/health", timeout=2).status_code == 200


def idle_cpu(pid: int, seconds: float = 2.0) -> float:
    """Fraction of one core a process uses over `seconds` (to check an idle server is idle)."""
    def ticks():
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])        # utime + stime
    try:
        t0 = ticks()
        time.sleep(seconds)
        return (ticks() - t0) / os.sysconf("SC_CLK_TCK") / seconds
    except (OSError, ValueError):
        return float("nan")


def load_waves(kind, port, conc, waves, prompts_file, new, peer_scripts):
    """load_client.py (the peer scripts' stdlib client) against one server -> its JSON result."""
    script = os.path.join(peer_scripts, "load_client.py")
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, script, kind, str(port), str(conc), str(waves),
                        "--prompts", prompts_file, "--new", str(new), "--out", out.name],
                       check=True, stdout=subprocess.DEVNULL, timeout=3600,
                       preexec_fn=common.die_with_parent)
        return json.load(open(out.name))


def wave_order(waves: int):
    """Which server runs each wave: common.abba_order of ours and llama-server."""
    return common.abba_order(waves, "ours", "llamacpp")


def measure_level(servers, c, waves, prompts_file, olen, peer_scripts):
    """One client level: `waves` single waves per server, interleaved (wave_order). ratio =
    median ours / median llama-server; paired_ratio = median of the per-pair ratios."""
    got = {"ours": [], "llamacpp": []}
    for name in wave_order(waves):
        kind, srv = servers[name]
        got[name] += load_waves(kind, srv.port, c, 1, prompts_file, olen, peer_scripts)["waves"]
    row = {"C": c, "waves": waves}
    for name, ws in got.items():
        row[f"{name}_tok_s"] = statistics.median(w["agg_tok_s"] for w in ws)
        row[f"{name}_lat_s"] = statistics.median(w["lat_median_s"] for w in ws)
        row[f"{name}_waves"] = ws
        each = " ".join(f"{w['agg_tok_s']:.1f}" for w in ws)
        print(f"    C={c} {name}: {row[name + '_tok_s']:.1f} tok/s (waves {each})", flush=True)
    row["ratio"] = row["ours_tok_s"] / row["llamacpp_tok_s"]
    row["paired_ratio"] = statistics.median(
        a["agg_tok_s"] / b["agg_tok_s"] for a, b in zip(got["ours"], got["llamacpp"]))
    return row


def peer_main(args):
    """Ours vs llama-server, same closed-loop waves, ratio per client level."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))    # run the servers' __exit__
    levels = args.levels or ([1, 8] if args.quick else [1, 8, 32])
    waves = args.waves or (2 if args.quick else 3)
    plen, olen = args.prompt_len, args.output_len
    script = os.path.join(args.peer_scripts, "load_client.py")
    if not os.path.exists(script):
        raise FileNotFoundError(f"{script} not found (set --peer-scripts)")
    gguf = common.weights_gguf(args.weights, args.llamacpp, args.peer_scripts)
    version = common.llamacpp_version(common.llamacpp_binary(args.llamacpp, "llama-server"))
    build = common.llamacpp_build(args.llamacpp)
    tok = common.tokenizer_for(None)
    prompts = common.fixed_length_prompts(tok, max(levels), plen, args.seed)
    slots = max(levels)
    per_slot = max(512, -(-(plen + olen + 16) // 256) * 256)
    ours_flags = ["--max-num-seqs", str(slots), "--kv-eviction-policy", "none",
                  "--no-enable-prefix-caching"]
    ours_flags += (["--quantization", "none"] if args.weights == "f32" else
                   ["--model", gguf, "--quantization", "gguf"])     # llama-server's own file
    info = common.cpu_info()
    print(f"{common.machine()}\nllama.cpp {version}", flush=True)
    with contextlib.ExitStack() as stack:
        pfile = stack.enter_context(tempfile.NamedTemporaryFile("w", suffix=".json"))
        json.dump(prompts, pfile)
        pfile.flush()
        print("  starting our server, then llama-server", flush=True)
        ours = Server(ours_flags, args.threads)
        stack.callback(ours.__exit__)               # stopped on exit, error or SIGTERM
        ours.__enter__()        # up first: its kernel plan times at load, on an otherwise idle host
        peer = LlamaServer(args.llamacpp, gguf, args.threads, slots, per_slot)
        stack.callback(peer.__exit__)
        peer.__enter__()
        servers = {"ours": ("oai", ours), "llamacpp": ("llamacpp", peer)}
        for kind, srv in servers.values():          # warm-up: one short request each
            load_waves(kind, srv.port, 1, 1, pfile.name, 8, args.peer_scripts)
        idle = {name: idle_cpu(srv.proc.pid) for name, (_, srv) in servers.items()}
        print(f"  idle CPU (cores): ours {idle['ours']:.2f}, llama-server {idle['llamacpp']:.2f}",
              flush=True)
        rows = [measure_level(servers, c, waves, pfile.name, olen, args.peer_scripts)
                for c in levels]
        with open(peer.log.name, errors="replace") as f:   # own offset: the server writes on
            system_info = common.llamacpp_system_info(f.read())
    title = (f"Serving vs llama-server: closed-loop waves of C clients, {plen}-token prompts + "
             f"{olen} new tokens, aggregate generated tok/s (median of {waves} waves, the "
             f"servers taking turns), ratio = ours / llama-server, paired = median per-pair "
             f"ratio; default model, {args.weights.upper()} weights (both: "
             f"{os.path.basename(gguf)}), "
             f"{args.threads} threads each\nCPU: {info['cores']}-core {info['cpu']}, "
             f"ISA of our C kernels {info['isa']}; llama.cpp {build}"
             + (f"; llama.cpp system_info: {system_info}" if system_info else ""))
    text = common.table(rows, ["C", "ours_tok_s", "llamacpp_tok_s", "ratio", "paired_ratio",
                               "ours_lat_s", "llamacpp_lat_s"], title)
    pyplot = common.plt()
    fig, ax = pyplot.subplots(figsize=(5, 3.2))
    x = list(range(len(rows)))
    ax.bar([i - 0.2 for i in x], [r["ours_tok_s"] for r in rows], 0.4, label="vllm (this fork)")
    ax.bar([i + 0.2 for i in x], [r["llamacpp_tok_s"] for r in rows], 0.4, label="llama-server")
    for i, r in zip(x, rows):
        ax.annotate(f"{r['ratio']:.2f}x", (i, max(r["ours_tok_s"], r["llamacpp_tok_s"])),
                    ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, [f"C={r['C']}" for r in rows])
    ax.set_ylabel("aggregate generated tokens/s")
    ax.set_title(f"Closed-loop waves, {plen} + {olen} tokens, {args.threads} threads; "
                 f"{info['isa']}", fontsize=8)
    ax.set_ylim(0, 1.3 * max(max(r["ours_tok_s"], r["llamacpp_tok_s"]) for r in rows))
    ax.legend(fontsize=8, loc="upper left")
    common.save("benchmark_serving_llamacpp" + ("" if args.weights == "f32" else
                                                 f"_{args.weights}"), {
        "args": vars(args), "model": "SmolLM2-135M-Instruct (default)", "rows": rows,
        "table": text, "idle_cpu_cores": idle, "ours_flags": ours_flags,
        "llamacpp": {"version": version, "gguf": gguf, "command": peer.cmd,
                     "build": build, "system_info": system_info},
        "client": "load_client.py (closed-loop waves)"}, fig)


def scan(url, model, work, points, args, log, body=None):
    """One row per point: {"C": c} runs max(4, --per-client x c) requests closed-loop,
    {"rate": r} runs --num-prompts requests at Poisson rate r; body: run_point's."""
    rows = []
    for point in points:
        if "C" in point:
            r = run_point(url, model, work, max(4, args.per_client * point["C"]),
                          concurrency=point["C"], seed=args.seed, body=body)
        else:
            r = run_point(url, model, work, args.num_prompts, rate=point["rate"], seed=args.seed,
                          body=body)
        (key, value), = point.items()
        log(f"    {key}={value}: {r['tok_s']:.1f} tok/s, p95 {r['p95_s']:.2f}s")
        rows.append({**point, **r})
    return rows


def select(scans, key, ref):
    """SLA = 1.05 x Naive-Evict's p95 at the reference point; each variant's highest-throughput
    point within it. -> (sla_s, rows with variant / meets_sla, summary rows)."""
    sla = 1.05 * next(r for r in scans["Naive-Evict"] if r[key] == ref)["p95_s"]
    rows, summary = [], []
    for name, rs in scans.items():
        for r in rs:
            r["variant"], r["meets_sla"] = name, r["p95_s"] <= sla
            rows.append(r)
        ok = [r for r in rs if r["meets_sla"]]
        sel = max(ok, key=lambda r: r["tok_s"]) if ok else None
        summary.append({"variant": name, f"{key}_sel": sel and sel[key],
                        "tok_s": sel and sel["tok_s"], "p95_s": sel and sel["p95_s"]})
    naive = next(s for s in summary if s["variant"] == "Naive-Evict")
    for s in summary:
        s["vs_naive"] = s["tok_s"] / naive["tok_s"] if s["tok_s"] and naive["tok_s"] else None
    return sla, rows, summary


VARIANTS = ("Naive-Evict", "vToken", "Native")


def variant_scans(args, model, work, points, blocks, max_seqs):
    """-> {policy: one {variant: rows} per --repeats}. Every variant's server is started once
    and they run side by side, each idle while another is scanned; each first serves a warm-up
    round per policy (Native one: its requests name none), as many requests at once as the
    scan's largest C, 16 tokens each, discarded. The policies (--policy) are scanned one after
    another on the same servers, each request naming its own (the kv_eviction_policy body
    field). Per policy, each repeat runs the points in order, every variant's point right after
    the others' (the variants' order rotated from one point and one repeat to the next), so a
    drift of the host moves the variants alike at every point. Prefix caching is off (the
    default): a repeat finds nothing of the last one's."""
    base = ["--num-gpu-blocks-override", str(blocks), "--max-num-seqs", str(max_seqs)]
    if model:
        base = ["--model", model] + base
    evict = ["--kv-eviction-policy", args.policy[0], "--kv-eviction-ratio", str(args.ratio),
             "--kv-min-tokens", "0"]
    flags = {"Naive-Evict": evict + ["--kv-reclamation", "none"],
             "vToken": evict + ["--kv-reclamation", "vtoken"],
             "Native": ["--kv-eviction-policy", "none"]}
    names = [name for name in VARIANTS if name in args.variants]

    def body(name, policy):
        return {} if name == "Native" else {"kv_eviction_policy": policy}

    out = {}
    with contextlib.ExitStack() as stack:
        servers = {}
        for name in names:
            print(f"  {name}: starting server", flush=True)
            servers[name] = stack.enter_context(Server(base + flags[name], args.threads))
        warm = max(point.get("C", 4) for point in points)   # every batch size the scan reaches
        for name in names:
            srv = servers[name]
            for policy in args.policy[:1] if name == "Native" else args.policy:
                run_point(srv.url, srv.model, [(p, 16) for p, _ in work], warm,
                          concurrency=warm, seed=args.seed, body=body(name, policy))
        for policy in args.policy:
            runs = out[policy] = []
            for k in range(args.repeats):
                print(f"  {policy}: scan {k + 1} of {args.repeats}", flush=True)
                scans = {name: [] for name in names}
                for j, point in enumerate(points):
                    turn = (k + j) % len(names)
                    for name in names[turn:] + names[:turn]:
                        srv = servers[name]
                        scans[name] += scan(srv.url, srv.model, work, [point], args,
                                            lambda line: print(f"  {name}: {line.strip()}"),
                                            body(name, policy))
                runs.append(scans)
    return out


def report(args, policy, runs, key, ref, blocks, label, plen, olen):
    """Table, PNG and JSON (results/<--out>_<policy>) of one policy. runs: one set of variant
    scans per --repeats; each run selects its own points against its own SLA, and vs_naive is
    the median over runs with its spread (min, max)."""
    selected = [select(scans, key, ref) for scans in runs]
    sla, rows, summary = selected[0]
    for s in summary:
        ratios = [next(t for t in other if t["variant"] == s["variant"])["vs_naive"]
                  for _, _, other in selected]
        ratios = [r for r in ratios if r is not None]
        s["vs_naive_runs"] = ratios
        s["vs_naive"] = statistics.median(ratios) if ratios else None
        s["spread"] = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else None
    scans = runs[0]
    loop = "Closed-loop" if key == "C" else "Open-loop (Poisson)"
    work = {"longbench": "LongBench-style", "sharegpt": "ShareGPT"}[args.dataset_name]
    title = (f"{loop} serving scan, {policy} ratio {args.ratio}, {blocks} KV blocks, "
             f"{work} prompts up to {plen} tokens + {olen} tokens; SLA = 1.05 x Naive-Evict "
             f"p95 at {key}={ref} = {sla:.2f}s (first run); {label}; {common.machine()}")
    text = common.table(rows, ["variant", key, "tok_s", "p50_s", "p95_s", "meets_sla"], title)
    text += "\n" + common.table(
        summary, ["variant", f"{key}_sel", "tok_s", "p95_s", "vs_naive", "spread"],
        f"Selected feasible point {key}_sel (highest throughput within SLA), first run; vs_naive: "
        f"median over {len(runs)} run(s), spread min-max")
    pyplot = common.plt()
    fig, ax = pyplot.subplots(figsize=(5.5, 3.4))
    for name, rs in scans.items():
        ax.plot([r["p95_s"] for r in rs], [r["tok_s"] for r in rs], "o-", label=name)
        for r in rs:
            ax.annotate(f"{key}={r[key]}", (r["p95_s"], r["tok_s"]), fontsize=6)
    ax.axvline(sla, color="gray", ls="--", lw=0.8, label="SLA")
    ax.set_xlabel("p95 request latency (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{loop} scan, {policy} {args.ratio}, {work}, {blocks} blocks; {label}",
                 fontsize=8)
    ax.legend(fontsize=7)
    name = (args.out or "benchmark_serving" + ("" if key == "C" else "_rate")) + f"_{policy}"
    common.save(name, {"args": {**vars(args), "policy": policy}, "model": label,
                       "dataset": args.dataset_name, "sla_s": sla, "rows": rows,
                       "summary": summary, "table": text,
                       "runs": [{"sla_s": r[0], "summary": r[2]} for r in selected]}, fig)


def parser():
    p = common.base_parser(__doc__)
    p.add_argument("--url", default=None, help="scan this running server only (no variants)")
    p.add_argument("--policy", nargs="+", default=["random"],
                   help="eviction policies, scanned one after another on the same servers (each "
                        "request names its own); one result per policy")
    p.add_argument("--dataset-name", default="longbench", choices=["longbench", "sharegpt"],
                   help="the scan's workload: LongBench-style long prompts or ShareGPT chats")
    p.add_argument("--repeats", type=int, default=1,
                   help="scan every variant this many times (its server started once, the "
                        "variants taking turns); vs_naive is the median, with its spread")
    p.add_argument("--out", default=None,
                   help="result name, followed by _<policy> (default benchmark_serving[_rate])")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                   help="the servers scanned (the SLA rule needs Naive-Evict; Native shows the "
                        "frontier without eviction)")
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--blocks", type=int, default=None, help="KV block budget of every variant")
    p.add_argument("--levels", type=int, nargs="+", default=None)
    p.add_argument("--c-ref", type=int, default=None,
                   help="the SLA's reference concurrency (default 2)")
    p.add_argument("--per-client", type=int, default=4, help="requests per client per level")
    p.add_argument("--request-rate", type=float, nargs="+", default=None,
                   help="open-loop points instead of --levels: Poisson arrivals at each rate "
                        "(requests/s)")
    p.add_argument("--rate-ref", type=float, default=None,
                   help="the SLA's reference rate (default: the middle --request-rate)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per --request-rate point (default 32, --quick 16)")
    common.add_llamacpp_args(p, "llama-server, peer mode: --levels, --waves, --prompt-len, "
                                "--output-len apply; the variant scan does not run")
    p.add_argument("--waves", type=int, default=None,
                   help="peer mode: waves per level (default 3, --quick 2)")
    p.add_argument("--weights", default="f32", choices=common.WEIGHT_FORMATS,
                   help="peer mode: the default model's weight format, one GGUF file for both "
                        "servers (ours with --quantization gguf; f32: --quantization none)")
    p.add_argument("--prompt-len", type=int, default=128, help="peer mode prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="peer mode new tokens")
    return p


def main():
    p = parser()
    args = p.parse_args()
    if args.llamacpp and (args.url or args.model not in (None, "", "default")):
        p.error("--llamacpp starts both servers on the default model; drop --url / --model")
    common.setup(args)
    if args.llamacpp:
        return peer_main(args)
    model, label = common.model_for(args)
    tok = common.tokenizer_for(model)
    levels = args.levels = args.levels or ([1, 2, 4] if args.quick else [1, 2, 4, 8])
    c_ref = args.c_ref = args.c_ref or 2        # the results' args name what ran
    args.num_prompts = args.num_prompts or (16 if args.quick else 32)
    if args.request_rate:
        key, points = "rate", [{"rate": r} for r in args.request_rate]
        ref = args.rate_ref or sorted(args.request_rate)[len(args.request_rate) // 2]
    else:
        key, points, ref = "C", [{"C": c} for c in levels], c_ref
    if ref not in [point[key] for point in points]:
        p.error(f"the SLA's reference {key}={ref} is not one of the scan's points")
    if not args.url and "Naive-Evict" not in args.variants:
        p.error("--variants: the SLA is Naive-Evict's p95, so Naive-Evict is always scanned")
    plen, olen = (192, 128) if args.quick else (384, 128)
    work = common.workload(args.dataset_name, 16, tok, plen, olen, args, fixed_output=True)
    if args.url:
        import httpx
        name = httpx.get(f"{args.url}/v1/models").json()["data"][0]["id"]
        rows = scan(args.url, name, work, points, args, print)
        common.table(rows, [key, "requests", "tok_s", "p50_s", "p95_s", "ttft_p95_s"], args.url)
        return
    mean_prompt = statistics.mean(len(prompt) for prompt, _ in work)
    full = math.ceil((mean_prompt + olen) / 16)      # a mean request's blocks, never evicting
    longest = math.ceil(max(len(prompt) + olen for prompt, _ in work) / 16)
    # Native fits ~5/8 of C_ref mean requests, and the longest request fits alone
    blocks = args.blocks or max(full * c_ref * 5 // 8, longest + 1)
    for policy, runs in variant_scans(args, model, work, points, blocks, max(levels)).items():
        report(args, policy, runs, key, ref, blocks, label, plen, olen)


if __name__ == "__main__":
    main()
