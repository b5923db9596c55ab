"""SLA-constrained serving throughput: closed-loop concurrency scan against the OpenAI server.

For each variant (Native, Naive-Evict, vToken; same policy and KV block budget) this starts
`python -m vllm.entrypoints.openai.api_server ... --port P`, then for each concurrency C runs C
clients that each send streaming /v1/completions requests back to back (our own async client
over HTTP). SLA = 1.05 x Naive-Evict's p95 request latency at the reference concurrency; C_sel
is a variant's highest-throughput point whose p95 meets the SLA.

    python benchmarks/benchmark_serving.py --quick
    python benchmarks/benchmark_serving.py --url http://127.0.0.1:8000   # scan a running server
"""
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

import common


async def one_request(client, url, model, prompt, max_tokens):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, chunks, usage = None, 0, None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"].get("completion_tokens")
            if chunk.get("choices"):
                chunks += 1
                ttft = ttft or time.perf_counter() - t0
    return {"latency": time.perf_counter() - t0, "ttft": ttft, "tokens": usage or chunks}


async def closed_loop(url, model, work, concurrency, num_requests):
    import httpx
    queue = list(range(num_requests))
    results = []

    async def worker(client):
        while queue:
            i = queue.pop(0)
            prompt, n = work[i % len(work)]
            results.append(await one_request(client, url, model, prompt, n))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    lat = np.array([r["latency"] for r in results])
    return {"C": concurrency, "requests": len(results),
            "tok_s": sum(r["tokens"] for r in results) / wall,
            "p50_s": float(np.percentile(lat, 50)), "p95_s": float(np.percentile(lat, 95)),
            "ttft_p95_s": float(np.percentile([r["ttft"] or 0 for r in results], 95))}


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
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def __enter__(self):
        import httpx
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited; see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.model = httpx.get(f"{self.url}/v1/models").json()["data"][0]["id"]
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"server did not come up; see {self.log.name}")

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def scan(url, model, work, levels, per_client, log):
    rows = []
    for c in levels:
        r = asyncio.run(closed_loop(url, model, work, c, max(4, per_client * c)))
        log(f"    C={c}: {r['tok_s']:.1f} tok/s, p95 {r['p95_s']:.2f}s")
        rows.append(r)
    return rows


def main():
    p = common.base_parser(__doc__)
    p.add_argument("--url", default=None, help="scan this running server only (no variants)")
    p.add_argument("--policy", default="random")
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--blocks", type=int, default=None, help="KV block budget of every variant")
    p.add_argument("--levels", type=int, nargs="+", default=None)
    p.add_argument("--c-ref", type=int, default=None)
    p.add_argument("--per-client", type=int, default=2, help="requests per client per level")
    args = p.parse_args()
    common.setup(args)
    model, label = common.model_for(args)
    tok = common.tokenizer_for(model)
    levels = args.levels or ([2, 4, 8] if args.quick else [1, 2, 4, 8, 12, 16])
    c_ref = args.c_ref or (4 if args.quick else 8)
    plen, olen = (192, 64) if args.quick else (384, 128)
    work = common.workload("longbench", 16, tok, plen, olen, args, fixed_output=True)
    if args.url:
        import httpx
        name = httpx.get(f"{args.url}/v1/models").json()["data"][0]["id"]
        rows = scan(args.url, name, work, levels, args.per_client, print)
        common.table(rows, ["C", "requests", "tok_s", "p50_s", "p95_s", "ttft_p95_s"], args.url)
        return
    full = -(-(plen + 40 + olen) // 16)
    blocks = args.blocks or full * c_ref * 5 // 8     # Native fits ~5/8 of C_ref requests
    base = ["--num-gpu-blocks-override", str(blocks), "--max-num-seqs", str(max(levels))]
    if model:
        base = ["--model", model] + base
    evict = ["--kv-eviction-policy", args.policy, "--kv-eviction-ratio", str(args.ratio),
             "--kv-min-tokens", "0"]
    variants = {"Naive-Evict": evict + ["--kv-reclamation", "none"],
                "vToken": evict + ["--kv-reclamation", "vtoken"],
                "Native": ["--kv-eviction-policy", "none"]}
    scans = {}
    for name, flags in variants.items():
        print(f"  {name}: starting server", flush=True)
        with Server(base + flags, args.threads) as srv:
            scans[name] = scan(srv.url, srv.model, work, levels, args.per_client, print)
    ref = next(r for r in scans["Naive-Evict"] if r["C"] == c_ref)
    sla = 1.05 * ref["p95_s"]
    rows, summary = [], []
    for name, rs in scans.items():
        for r in rs:
            r["variant"], r["meets_sla"] = name, r["p95_s"] <= sla
            rows.append(r)
        ok = [r for r in rs if r["meets_sla"]]
        sel = max(ok, key=lambda r: r["tok_s"]) if ok else None
        summary.append({"variant": name, "C_sel": sel and sel["C"], "tok_s": sel and sel["tok_s"],
                        "p95_s": sel and sel["p95_s"]})
    naive = next(s for s in summary if s["variant"] == "Naive-Evict")
    for s in summary:
        s["vs_naive"] = s["tok_s"] / naive["tok_s"] if s["tok_s"] and naive["tok_s"] else None
    title = (f"Serving scan, {args.policy} ratio {args.ratio}, {blocks} KV blocks, LongBench-style "
             f"{plen}-token prompts + {olen} tokens; SLA = 1.05 x Naive-Evict p95 at C={c_ref} = "
             f"{sla:.2f}s; {label}; {common.machine()}")
    text = common.table(rows, ["variant", "C", "tok_s", "p50_s", "p95_s", "meets_sla"], title)
    text += "\n" + common.table(summary, ["variant", "C_sel", "tok_s", "p95_s", "vs_naive"],
                                "Selected feasible point C_sel (highest throughput within SLA)")
    pyplot = common.plt()
    fig, ax = pyplot.subplots(figsize=(5.5, 3.4))
    for name, rs in scans.items():
        ax.plot([r["p95_s"] for r in rs], [r["tok_s"] for r in rs], "o-", label=name)
        for r in rs:
            ax.annotate(f"C={r['C']}", (r["p95_s"], r["tok_s"]), fontsize=6)
    ax.axvline(sla, color="gray", ls="--", lw=0.8, label="SLA")
    ax.set_xlabel("p95 request latency (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Closed-loop scan, {args.policy} 0.5, {blocks} blocks; {label}", fontsize=8)
    ax.legend(fontsize=7)
    common.save("benchmark_serving", {"args": vars(args), "model": label, "sla_s": sla,
                                      "rows": rows, "summary": summary, "table": text}, fig)


if __name__ == "__main__":
    main()
