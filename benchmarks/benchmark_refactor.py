"""A model's decode throughput at two revisions of this repository, in one run (default: the
default model; --model a .gguf file or model directory both revisions load).

The model-library refactor (8f13a1b..02aab15: the kernels' new home, the model loader, the
family-agnostic CpuDecodeModel) must not slow the default model: after >= 0.98x before. This
script checks out --before (default 96e5224, the commit before the refactor) as a git worktree
(/tmp/wt-before) and measures it beside --after (default HEAD, checked out as /tmp/wt-after, so
uncommitted work in this checkout stays out; --after . measures this checkout as it is). Each
revision runs in a subprocess of the same Python with PYTHONPATH at its tree (the .venv's
editable install of this checkout switched off there; the worker checks that every vllm module
it imported came from its tree), loaded once as
`LLM()` with its defaults (the default model, quantization auto), warmed up at every batch size,
then driven turn by turn: per batch size, --rounds pairs in ABBA order (before, after, after,
before, ...), the idle worker waiting on its pipe. Both run the same prompts (--prompt-len token
ids cut from ShareGPT by this checkout's tokenizer) through the same harness (common.generate:
greedy, ignore_eos, --new-tokens each); tok/s = generated tokens / wall time incl. prefill.
after_vs_before is the median of the per-pair ratios after / before, with the lowest beside
it. The worktrees are removed at the end (git worktree remove --force). Each load times its
own kernel plan and weight-format crossover (cached only when the host is quiet), so on a busy
host the two revisions may run different choices (each worker's load_log in the JSON says
which); VLLM_CPU_GEMM=c in the environment pins the GEMM path for both.

    python benchmarks/benchmark_refactor.py --threads 2                # batch 1, 16, 32; 3 rounds
    python benchmarks/benchmark_refactor.py --threads 2 --rounds 5 --batches 1 32
    python benchmarks/benchmark_refactor.py --quick                    # batch 1, 32 + 16 tokens
    python benchmarks/benchmark_refactor.py --before 73f9b38 --model gemma-3-270m-q4_k_m.gguf
"""
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEFORE = "96e5224"
REQUIRED = 0.98                   # after / before, from the issue
TAG = "@@ "                       # the worker's protocol lines on its stdout
# settings both workers inherit that change what runs (VLLM_CPU_GEMM=c: the kernel plan's GEMM
# path pinned to C in every band, untimed: a load's plan timing no longer differs between the two)
ENGINE_ENV = ("VLLM_CPU_GEMM", "VLLM_CPU_ISA", "VLLM_KERNEL_BACKEND", "VLLM_CPU_KERNELS",
              "OMP_NUM_THREADS")


# ---- the worker: one revision's engine, driven over stdin / stdout ------------------------
def _kernels_of_tree():
    """The tree's cpu_kernels and cpu_kernel_plan modules (vllm/kernels/ after 8f13a1b,
    vllm/ before)."""
    try:
        from vllm.kernels import cpu_kernel_plan, cpu_kernels
    except ImportError:
        from vllm import cpu_kernel_plan, cpu_kernels
    return cpu_kernels, cpu_kernel_plan


def _say(**msg):
    print(TAG + json.dumps(msg, default=str), flush=True)


def _outside(tree: str) -> list:
    """The vllm modules imported from anywhere but `tree`."""
    root = os.path.realpath(tree) + os.sep
    return sorted(name for name, mod in list(sys.modules.items())
                  if (name == "vllm" or name.startswith("vllm."))
                  and getattr(mod, "__file__", None)
                  and not os.path.realpath(mod.__file__).startswith(root))


def worker(tree: str, prompts_file: str, threads: int, new_tokens: int, model: str) -> None:
    # the .venv's editable install of this checkout resolves what a tree lacks (vllm.kernels
    # for the old one) from this checkout: off, so each revision runs only its own modules
    sys.meta_path[:] = [f for f in sys.meta_path
                        if not getattr(f, "__module__", "").startswith("__editable__")]
    sys.path_hooks[:] = [h for h in sys.path_hooks
                         if not getattr(h, "__module__", "").startswith("__editable__")]
    sys.path_importer_cache.clear()
    import torch
    torch.set_num_threads(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import logging
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")    # to its log
    import vllm
    from vllm import LLM
    path = os.path.realpath(vllm.__file__)
    cpu_kernels, cpu_kernel_plan = _kernels_of_tree()
    if _outside(tree):
        raise SystemExit(f"vllm modules imported from outside {tree}: {_outside(tree)}")
    with open(prompts_file) as f:
        prompts = json.load(f)
    t0 = time.perf_counter()
    llm = LLM(model) if model else LLM()
    load_s = time.perf_counter() - t0
    if _outside(tree):
        raise SystemExit(f"vllm modules imported from outside {tree}: {_outside(tree)}")
    plan = cpu_kernel_plan.decisions()
    config = llm.llm_engine.model_config
    batches = sorted({int(b) for b in prompts["batches"]})
    for b in batches:                                           # warm-up, every batch size
        common.generate(llm, [(q, 8) for q in prompts["ids"][:b]])
    isa = cpu_kernels.active_isa() if cpu_kernels.available() else "off (torch path)"
    _say(ready=True, vllm=path, load_s=load_s, isa=isa, cpu=cpu_kernels.cpu_name(),
         threads=torch.get_num_threads(), model=config.model,
         quantization=getattr(config, "quantization", None),
         plan_source=plan.get("source") if plan else None,
         plan=cpu_kernel_plan.summary(plan) if plan else None)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            break
        b = int(cmd)
        outs, secs = common.generate(llm, [(q, new_tokens) for q in prompts["ids"][:b]])
        assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
        _say(batch=b, seconds=secs)


# ---- the parent ---------------------------------------------------------------------------
def git(*args, cwd=REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


def add_worktree(path: str, rev: str) -> str:
    if os.path.exists(path):                # a stale one from an interrupted run
        subprocess.run(["git", "worktree", "remove", "--force", path], cwd=REPO,
                       capture_output=True)
    git("worktree", "prune")
    git("worktree", "add", "--detach", path, rev)
    return path


def remove_worktree(path: str) -> None:
    r = subprocess.run(["git", "worktree", "remove", "--force", path], cwd=REPO,
                       capture_output=True, text=True)
    if r.returncode != 0:
        print(f"git worktree remove --force {path}: {r.stderr.strip()}", file=sys.stderr)


def describe(tree: str) -> dict:
    head = git("rev-parse", "HEAD", cwd=tree)
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "vllm", "csrc", cwd=tree)
    return {"tree": tree, "commit": head, "short": head[:7],
            "subject": git("log", "-1", "--format=%s", cwd=tree)[:120],
            "dirty_files": dirty.splitlines()}


class Worker:
    """One revision's engine in a subprocess (PYTHONPATH = its tree)."""

    def __init__(self, name: str, tree: str, prompts_file: str, args, log_dir: str):
        self.name, self.tree = name, tree
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.log = open(self.log_path, "w")
        env = dict(os.environ, PYTHONPATH=tree, TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", tree, prompts_file,
             str(args.threads), str(args.new_tokens), args.model or ""],
            cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            text=True, bufsize=1, preexec_fn=common.die_with_parent)

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(TAG):
                return json.loads(line[len(TAG):])
        self.log.flush()
        with open(self.log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{self.name} worker exited (rc {self.proc.wait()}):\n{tail}")

    def load_log(self) -> list:
        """Its load's choices, from its log: the kernel plan, the weight format."""
        self.log.flush()
        with open(self.log_path) as f:
            return [ln.strip() for ln in f if any(k in ln for k in (
                "CPU kernel plan", "auto weight format", "kept in"))]

    def run(self, batch: int) -> float:
        self.proc.stdin.write(f"{batch}\n")
        self.proc.stdin.flush()
        msg = self.read()
        assert msg["batch"] == batch
        return msg["seconds"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def summarize(batch: int, new_tokens: int, seconds: dict) -> dict:
    """One batch's row from each revision's per-round seconds (paired in order)."""
    tok = {k: [batch * new_tokens / s for s in v] for k, v in seconds.items()}
    pairs = [a / b for a, b in zip(tok["after"], tok["before"])]
    return {"batch": batch, "before_tok_s": statistics.median(tok["before"]),
            "after_tok_s": statistics.median(tok["after"]),
            "after_vs_before": statistics.median(pairs), "after_vs_before_min": min(pairs),
            "meets_0.98": statistics.median(pairs) >= REQUIRED,
            "pairs": pairs, "before_rounds_tok_s": tok["before"],
            "after_rounds_tok_s": tok["after"]}


def plot(rows, title: str):
    pyplot = common.plt()
    fig, ax = pyplot.subplots(figsize=(5.4, 3.2))
    x = list(range(len(rows)))
    for k, (key, label) in enumerate([("before_tok_s", "before"),
                                      ("after_tok_s", "after")]):
        ax.bar([i + (k - 0.5) * 0.38 for i in x], [r[key] for r in rows], 0.38, label=label)
    for i, r in zip(x, rows):
        ax.annotate(f"{r['after_vs_before']:.3f}x\n(min {r['after_vs_before_min']:.3f})",
                    (i + 0.19, r["after_tok_s"]), ha="center", va="bottom", fontsize=7,
                    xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(x, [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("generated tokens/s")
    ax.set_ylim(0, 1.4 * max(max(r["before_tok_s"], r["after_tok_s"]) for r in rows))
    ax.set_title(title, fontsize=8.5)
    ax.legend(fontsize=8, loc="upper left")
    return fig


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        tree, prompts_file, threads, new_tokens, model = sys.argv[2:7]
        worker(tree, prompts_file, int(threads), int(new_tokens), model)
        return
    p = common.base_parser(__doc__)
    p.add_argument("--before", default=BEFORE, help="revision before (default %(default)s)")
    p.add_argument("--after", default="HEAD",
                   help="revision after, checked out as /tmp/wt-after (default %(default)s; "
                        "'.': this checkout as it is, uncommitted changes included)")
    p.add_argument("--batches", type=int, nargs="+", default=None,
                   help="batch sizes (default 1 16 32; --quick 1)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 128 (--quick 32)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 128 (--quick 16)")
    p.add_argument("--rounds", type=int, default=None,
                   help="ABBA pairs per batch size (default 3, --quick 1)")
    p.add_argument("--worktree", default="/tmp/wt-before", help="where --before is checked out")
    p.add_argument("--out", default=common.RESULTS, help="folder for the JSON and PNG "
                                                         "(default %(default)s)")
    args = p.parse_args()
    args.model, label = common.model_for(args)      # None: the default model, as LLM() loads it
    batches = args.batches or ([1] if args.quick else [1, 16, 32])
    args.prompt_len = args.prompt_len or (32 if args.quick else 128)
    args.new_tokens = args.new_tokens or (16 if args.quick else 128)
    rounds = args.rounds or (1 if args.quick else 3)
    common.setup(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))    # kill: still remove worktrees
    print(common.machine())
    tok = common.tokenizer_for(args.model)
    ids = common.fixed_length_prompts(tok, max(batches), args.prompt_len, args.seed)
    work_dir = tempfile.mkdtemp(prefix="benchmark-refactor-")
    prompts_file = os.path.join(work_dir, "prompts.json")
    with open(prompts_file, "w") as f:
        json.dump({"batches": batches, "ids": ids}, f)
    trees, workers, made = {}, {}, []
    try:
        trees["before"] = add_worktree(args.worktree, args.before)
        made.append(trees["before"])
        if args.after != ".":
            trees["after"] = add_worktree("/tmp/wt-after", args.after)
            made.append(trees["after"])
        else:
            trees["after"] = REPO
        revisions = {k: describe(t) for k, t in trees.items()}
        for k, rev in revisions.items():
            print(f"{k}: {rev['short']} {rev['subject'][:80]} ({rev['tree']})"
                  + (f" + uncommitted {rev['dirty_files']}" if rev["dirty_files"] else ""))
        for k in ("before", "after"):       # one at a time: loads time the kernel plan
            workers[k] = Worker(k, trees[k], prompts_file, args, work_dir)
            revisions[k].update(workers[k].read())
            revisions[k]["load_log"] = workers[k].load_log()
            print(f"{k} ready: vllm {revisions[k]['vllm']}, load {revisions[k]['load_s']:.1f} s, "
                  f"C kernels {revisions[k]['isa']}, plan {revisions[k]['plan_source']}",
                  flush=True)
        rows = []
        for b in batches:
            seconds = {"before": [], "after": []}
            for who in common.abba_order(rounds, "before", "after"):
                seconds[who].append(workers[who].run(b))
                print(f"  batch {b} {who}: {b * args.new_tokens / seconds[who][-1]:.1f} tok/s",
                      flush=True)
            rows.append(summarize(b, args.new_tokens, seconds))
    finally:
        for w in workers.values():
            w.close()
        for path in made:
            remove_worktree(path)
    shutil.rmtree(work_dir, ignore_errors=True)     # kept when a worker failed (its log)
    info = common.cpu_info()
    env = {k: os.environ[k] for k in ENGINE_ENV if k in os.environ}
    title = (f"{label} (LLM() defaults: quantization {revisions['after']['quantization']}),"
             f" {args.prompt_len}-token prompts + {args.new_tokens} new tokens, generated tokens/s"
             f" incl. prefill ({common.machine()})\nbefore {revisions['before']['short']}, after "
             f"{revisions['after']['short']}"
             + (" + uncommitted changes" if revisions["after"]["dirty_files"] else "")
             + "".join(f", {k}={v}" for k, v in env.items())
             + f"; {rounds} ABBA pairs per batch; after_vs_before = median of the per-pair "
               f"ratios, _min the lowest; required >= {REQUIRED}")
    text = common.table(rows, ["batch", "before_tok_s", "after_tok_s", "after_vs_before",
                               "after_vs_before_min", "meets_0.98"], title)
    fig = plot(rows, f"{os.path.basename(label)} before / after ({revisions['before']['short']}"
                     f" / {revisions['after']['short']}), {info['cpu']}, {args.threads} threads, "
                     f"C kernels {info['isa']}")
    results, common.RESULTS = common.RESULTS, args.out     # common.save writes there
    try:
        name = "benchmark_refactor" if args.model is None else "benchmark_revisions_" + \
            os.path.basename(args.model.rstrip("/")).split(".")[0]
        common.save(name,
                    {"args": vars(args), "env": env, "batches": batches, "rounds": rounds,
                     "threads": args.threads, "required": REQUIRED, "revisions": revisions,
                     "rows": rows, "table": text}, fig)
    finally:
        common.RESULTS = results


if __name__ == "__main__":
    main()
