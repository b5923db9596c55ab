"""The OpenAI server at --tensor-parallel-size > 1, live: a TP=2 server answers what a TP=1
server answers; a killed worker fails the requests in flight (500 / an error event), /health
turns 500 and the server exits with code 1, leaving no process; SIGTERM stops a healthy server
and its workers; the default model at TP=3 (9 heads, 3 KV heads) chats as at TP=1.

`vllm serve` runs in a subprocess (tests.server_utils.ServerProcess) where its exit code and
process tree matter; the rank-1 worker is found among the server's descendants (/proc) as
multiprocessing's spawn_main. A TP server takes ~10-20 s to start on 2 cores (the default-model test ~1 min).
"""
import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.server_utils import ServerProcess, make_engine, serve, wait_gone
from vllm.engine.async_llm_engine import EngineDeadError

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process tree "
                                                                   "from /proc (Linux)")

PROMPTS = ["w10 w20 w30 w40", "w7 w8 w9 w100 w200 w300 w400 w5", "w450 w3"]
RUNNING = 'vllm:num_requests_running{engine="0",model_name="tiny"}'


def completion(url: str, prompt, max_tokens: int = 16, **extra) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def sse_data(lines):
    """The `data:` payloads of an SSE stream as they come, [DONE] as the string."""
    return (line[len("data: "):] for line in lines if line.startswith("data: "))


def assert_openai_500(body: dict, match: str) -> None:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert err["code"] == 500 and err["type"] == "internal_server_error", body
    assert match in err["message"], body


def metric(url: str, key: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(key + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(key)


@pytest.fixture(scope="module")
def tp2_server(tiny_llama):
    with ServerProcess(tiny_llama, "--tensor-parallel-size", "2",
                       "--num-gpu-blocks-override", "256") as srv:
        yield srv


# ---- (a) TP=2 answers as TP=1 ------------------------------------------------------------------
def test_tp2_server_answers_as_tp1(tp2_server, tiny_llama):
    assert len(tp2_server.workers()) == 1                  # rank 1: one spawned process
    engine, srv = serve(tiny_llama, num_gpu_blocks_override=256)
    with srv:
        ref = [completion(srv.url, p).json()["choices"][0]["text"] for p in PROMPTS]
    got = []
    for p in PROMPTS:
        r = completion(tp2_server.url, p)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        got.append(r.json()["choices"][0]["text"])
    assert got == ref and all(ref)
    r = completion(tp2_server.url, PROMPTS[1], stream=True)   # streamed: the same text
    events = list(sse_data(r.text.splitlines()))
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == ref[1]


# ---- (c) SIGTERM: a clean stop, no process left --------------------------------------------------
def test_sigterm_stops_server_and_workers(tp2_server):
    tree = tp2_server.processes()
    assert len(tree) >= 2 and tp2_server.workers()        # the server and its rank-1 worker
    tp2_server.proc.send_signal(signal.SIGTERM)
    code = tp2_server.wait(30)
    assert code in (0, -signal.SIGTERM), (code, tp2_server.output()[-3000:])
    assert wait_gone(tree, 10) == [], "a process of the server outlived it"
    out = tp2_server.output()
    assert "Traceback" not in out and "WorkerFailed" not in out, out[-3000:]


# ---- (b) a killed worker: errors, /health 500, exit 1, nothing left ----------------------------
def test_killed_worker_fails_requests_and_the_server_exits(tiny_llama):
    with ServerProcess(tiny_llama, "--tensor-parallel-size", "2",
                       "--num-gpu-blocks-override", "256") as srv:
        (worker,) = srv.workers()
        tree = srv.processes()
        # a whole (non-streamed) request in flight too: it must get a 500 in OpenAI's shape
        whole = {}
        t = threading.Thread(target=lambda: whole.update(r=completion(srv.url, "w5 w6 w7",
                                                                      1000)))
        t.start()
        events = []
        killed_at = None
        body = {"model": "tiny", "prompt": "w8 w9", "max_tokens": 1000, "ignore_eos": True,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as resp:
            assert resp.status_code == 200
            for data in sse_data(resp.iter_lines()):
                events.append(data)
                if killed_at is None and len(events) >= 3:
                    deadline = time.monotonic() + 30
                    while metric(srv.url, RUNNING) < 2:    # both requests admitted
                        assert time.monotonic() < deadline, "the whole request never ran"
                        time.sleep(0.05)
                    os.kill(worker, signal.SIGKILL)
                    killed_at = time.monotonic()
        assert killed_at is not None, events
        # the stream ends with an error event, then [DONE]; it did not run to 1000 tokens
        assert events[-1] == "[DONE]" and len(events) < 900, events[-3:]
        error = json.loads(events[-2])
        assert_openai_500(error, "tensor-parallel worker rank 1 failed")
        t.join(30)
        assert not t.is_alive()
        assert whole["r"].status_code == 500, whole["r"].text
        assert_openai_500(whole["r"].json(), "tensor-parallel worker rank 1 failed")
        # unhealthy from now on, and new requests (whole or streamed) are refused with a 500
        health = httpx.get(srv.url + "/health", timeout=10)
        assert health.status_code == 500
        assert_openai_500(health.json(), "rank 1 failed")
        for stream in (False, True):
            r = completion(srv.url, "w5", 4, stream=stream)
            assert r.status_code == 500 and "rank 1 failed" in r.json()["error"]["message"]
        code = srv.wait(30)
        assert code is not None, "the server did not exit after its engine died"
        assert code == 1, (code, srv.output()[-3000:])
        assert time.monotonic() - killed_at < 30
        assert wait_gone(tree, 10) == [], "a process of the server outlived it"
        assert "WorkerFailed: tensor-parallel worker rank 1 failed (exit code -9)" in srv.output()


# ---- the same rules without a second process: an engine whose health check fails ---------------
def _broken(engine, step_error: bool = True) -> list:
    """From now on the engine is unhealthy (as after WorkerFailed) and, if step_error, every
    step raises; -> the list LLMEngine.shutdown() calls are recorded in."""
    released = []
    llm_engine = engine.engine

    def check_health():      # also run by the idle loop: whichever comes first kills it
        raise RuntimeError("tensor-parallel worker rank 1 failed (exit code -9)")

    def step():
        raise RuntimeError("tensor-parallel worker rank 1 failed (exit code -9)")
    llm_engine.check_health = check_health
    if step_error:
        llm_engine.step = step
    llm_engine.shutdown = lambda: released.append(True)
    return released


def test_unhealthy_engine_after_a_step_error_dies_and_the_server_stops(tiny_llama):
    """A step error that leaves the engine unhealthy kills the loop (a healthy one only fails
    the requests in flight: tests/test_server.py); the in-thread server answers 500 and
    stops by itself (app.state.server), the engine released once."""
    engine, srv = serve(tiny_llama, num_gpu_blocks_override=64)
    with srv:
        assert completion(srv.url, "w5 w6", 4).status_code == 200
        released = _broken(engine)
        r = completion(srv.url, "w5 w6", 4)
        assert r.status_code == 500
        assert_openai_500(r.json(), "rank 1 failed")
        assert engine.died and engine.errored and not engine.is_running
        health = httpx.get(srv.url + "/health", timeout=10)
        assert health.status_code == 500
        assert_openai_500(health.json(), "the engine loop died")
        srv.thread.join(15)
        assert not srv.thread.is_alive(), "the server did not stop after its engine died"
    assert released == [True]


def test_worker_death_while_idle_is_noticed(tiny_llama):
    engine = make_engine(tiny_llama, num_gpu_blocks_override=64)
    engine.start()
    released = _broken(engine, step_error=False)
    deadline = time.monotonic() + 10
    while not engine.died:
        assert time.monotonic() < deadline, "the idle loop did not check the engine's health"
        time.sleep(0.05)
    assert released == [True]
    engine.shutdown()
    assert released == [True]


@pytest.mark.parametrize("started", [True, False])
def test_async_engine_shutdown_shuts_the_llm_engine_down(tiny_llama, started):
    engine = make_engine(tiny_llama, num_gpu_blocks_override=64)
    if started:
        engine.start()
    released = []
    engine.engine.shutdown = lambda: released.append(True)
    engine.shutdown()
    assert released == [True]
    with pytest.raises(EngineDeadError, match="shut down"):   # its workers are gone
        engine.start()


# ---- (d) the default model at TP=3 ---------------------------------------------------------------
@pytest.mark.default_model
def test_default_model_tp3_chat_equals_tp1():
    """SmolLM2-135M: 9 heads and 3 KV heads, so 3 ranks (one KV head each; 2 cores shared)."""
    body = {"model": "smol", "temperature": 0, "max_tokens": 16,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    texts = {}
    for tp in (1, 3):
        # float32 at both sizes (GGUF blocks run at TP 1 only): the same math either way
        engine, srv = serve(None, served_name="smol", tensor_parallel_size=tp,
                            quantization="none")
        with srv:
            r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
            texts[tp] = r.json()["choices"][0]["message"]["content"]
        assert engine.errored and not engine.is_running         # the lifespan shut it down
        if tp == 3:
            assert not engine.engine.model_executor.procs[0].is_alive()
    assert texts[3] == texts[1]
    assert "Paris" in texts[1]
