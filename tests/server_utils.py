"""Helpers for the server tests: a uvicorn server in a thread, `vllm serve` in a process (with
its process tree), a chat-capable tiny model, and probes of the engine's state (run on the
engine thread, between steps)."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import List, Optional

import httpx
import openai
import uvicorn

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.async_llm_engine import AsyncLLMEngine
from vllm.entrypoints.openai.api_server import build_app

# Renders to in-vocabulary words of the tiny word-level tokenizer: w3 <content> w4 ... w5
CHAT_TEMPLATE = ("{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}"
                 "{% if add_generation_prompt %}w5{% endif %}")


def chat_model_dir(src: str, dst: str) -> str:
    """A copy of a tiny model whose tokenizer carries CHAT_TEMPLATE."""
    from transformers import AutoTokenizer
    if not os.path.exists(dst):
        shutil.copytree(src, dst)
        tok = AutoTokenizer.from_pretrained(dst)
        tok.chat_template = CHAT_TEMPLATE
        tok.save_pretrained(dst)
    return dst


def make_engine(model: str, **kwargs) -> AsyncLLMEngine:
    kwargs.setdefault("num_gpu_blocks_override", 512)
    return AsyncLLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1 (an OS-chosen port) in a background thread."""

    def __init__(self, app):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=3,
                                timeout_keep_alive=5)
        self.server = uvicorn.Server(config)
        if hasattr(app, "state"):
            app.state.server = self.server   # the app stops it if its engine dies
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


def serve(model: str, served_name: str = "tiny", api_key=None, options=None, **engine_kwargs):
    """options: the app's ServerOptions (server flags)."""
    engine = make_engine(model, **engine_kwargs)
    return engine, ServerThread(build_app(engine, [served_name], api_key=api_key,
                                          options=options))


def served(model_dir: str, **engine_kwargs):
    """For module fixtures (`yield from served(...)`): a server thread on its own engine
    (srv.engine), left with every block back in the pool."""
    engine, srv = serve(model_dir, **engine_kwargs)
    with srv:
        srv.engine = engine
        yield srv
        wait_until_clean(engine)


def openai_client(url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=60)


def engine_state(engine: AsyncLLMEngine) -> dict:
    """Checks accounting and reports what the engine still holds."""
    def probe(e):
        e.check_invariants()
        bm = e.kv.bm
        return {"unfinished": e.get_num_unfinished_requests(), "free": bm.num_free_blocks,
                "total": bm.num_blocks, "tables": len(bm.token_table),
                "running": len(e.scheduler.running), "waiting": len(e.scheduler.waiting)}
    state = engine.call(probe).result(timeout=30)
    state["streams"] = engine.num_streams()
    return state


def wait_until_clean(engine: AsyncLLMEngine, timeout: float = 20.0) -> dict:
    """Every block back in the pool, no token table, no request or stream left."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine_state(engine)
        if s["unfinished"] == 0 and s["free"] == s["total"] and s["tables"] == 0 \
                and s["streams"] == 0:
            return s
        assert time.monotonic() < deadline, f"engine state did not drain: {s}"
        time.sleep(0.05)


# ---- `vllm serve` in a process ----------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_command() -> List[str]:
    """The `vllm` console script of this environment (the module where it is not installed)."""
    exe = os.path.join(os.path.dirname(sys.executable), "vllm")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "vllm.entrypoints.cli"]


def wait_healthy(proc: subprocess.Popen, get, timeout: float = 90.0) -> None:
    """Until get("/health") answers 200; the server's output if it exits first."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.2)


def interrupt(proc: subprocess.Popen, timeout: float = 20.0) -> int:
    """SIGINT (Ctrl-C) and its exit code; killed, and an error, if it does not exit."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def _stat(pid: int) -> Optional[List[str]]:
    """/proc/<pid>/stat's fields after the command name (state, ppid, ...); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def pid_alive(pid: int) -> bool:
    """Running (a zombie, exited but not reaped, counts as gone)."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def descendants(pid: int) -> List[int]:
    """Every living process below `pid` (children, theirs, ...), from /proc."""
    children = {}
    for name in os.listdir("/proc"):
        st = _stat(int(name)) if name.isdigit() else None
        if st is not None and st[0] not in ("Z", "X"):
            children.setdefault(int(st[1]), []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def wait_gone(pids: List[int], timeout: float) -> List[int]:
    """-> the pids still alive after `timeout` seconds ([] when every one has exited)."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if pid_alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


class ServerProcess:
    """`vllm serve MODEL FLAGS` on 127.0.0.1 (a free port) in a subprocess, its output in a
    file. The context waits for /health 200; on exit it stops the server (SIGTERM, then
    SIGKILL) and kills anything of it left."""

    def __init__(self, model: Optional[str], *flags: str, served_name: str = "tiny",
                 startup_timeout: float = 180.0):
        self.port = free_port()
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.cli", "serve",
                    *([model] if model else []), "--host", "127.0.0.1", "--port", str(self.port),
                    "--served-model-name", served_name, "--uvicorn-log-level", "warning",
                    *flags]
        self.startup_timeout = startup_timeout
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm-serve-", suffix=".log")
        self.proc: Optional[subprocess.Popen] = None
        self.tree: List[int] = []       # every process of it seen so far

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def processes(self) -> List[int]:
        """The server and its living descendants (also remembered for the final check)."""
        now = ([self.pid] if pid_alive(self.pid) else []) + descendants(self.pid)
        self.tree.extend(p for p in now if p not in self.tree)
        return now

    def workers(self) -> List[int]:
        """The spawned tensor-parallel ranks (multiprocessing's spawn_main), in start order."""
        return sorted(p for p in descendants(self.pid) if "spawn_main" in cmdline(p))

    def __enter__(self) -> "ServerProcess":
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        deadline = time.monotonic() + self.startup_timeout
        while True:
            assert self.proc.poll() is None, f"server exited at start:\n{self.output()}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"server did not come up:\n{self.output()}"
            time.sleep(0.2)
        self.processes()
        return self

    def wait(self, timeout: float) -> Optional[int]:
        """The exit code, or None if it is still running after `timeout` seconds."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.processes()
            self.proc.send_signal(signal.SIGTERM)
            if self.wait(30) is None:
                self.proc.kill()
                self.proc.wait()
        for pid in wait_gone(self.tree, 10):     # never leave a worker behind a failed test
            if "multiprocessing" in cmdline(pid) or "vllm" in cmdline(pid):   # not a reused pid
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        self.log.close()
