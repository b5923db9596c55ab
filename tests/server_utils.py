"""Helpers for the server tests: a uvicorn server in a thread, a chat-capable tiny model, and
probes of the engine's state (run on the engine thread, between steps)."""
import os
import shutil
import socket
import threading
import time

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
