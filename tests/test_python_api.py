"""Upstream vLLM's Python serving API on our engine: AsyncEngineArgs -> AsyncLLMEngine, generate()
as an async iterator of RequestOutputs (cumulative / DELTA / FINAL_ONLY), abort, check_health,
shutdown; and guidellm's `vllm_python` backend (PyPI guidellm==0.8.1), which uses exactly that
surface, running against it."""
import asyncio
import os
import sys
import threading

import pytest

from vllm import (AsyncEngineArgs, AsyncLLMEngine, CompletionOutput, EngineArgs, LLM, LLMEngine,
                  RequestOutput, SamplingParams, TextPrompt, TokensPrompt)
from vllm.engine.async_llm_engine import EngineDeadError
from vllm.sampling_params import RequestOutputKind

from tests.server_utils import chat_model_dir, wait_until_clean

PROMPT = "w5 w6 w7 w8 w9"
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def make(model: str, **kwargs) -> AsyncLLMEngine:
    return AsyncLLMEngine.from_engine_args(
        AsyncEngineArgs(model=model, num_gpu_blocks_override=64, **kwargs))


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = make(tiny_llama)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """LLM.generate's greedy tokens for PROMPT."""
    return LLM(tiny_llama, num_gpu_blocks_override=64).generate(
        PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


async def collect(eng: AsyncLLMEngine, prompt, params, request_id: str):
    return [out async for out in eng.generate(prompt, params, request_id)]


def test_upstream_names_and_args(tiny_llama):
    assert issubclass(AsyncEngineArgs, EngineArgs)
    assert AsyncEngineArgs(model="m").enable_log_requests is False
    assert AsyncEngineArgs(model="m", disable_log_requests=False).enable_log_requests is True
    assert AsyncEngineArgs(model="m", disable_log_stats=True).disable_log_stats is True
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, num_gpu_blocks_override=8))
    assert isinstance(engine, LLMEngine) and engine.kv.num_blocks == 8
    assert {"index", "text", "token_ids", "cumulative_logprob", "logprobs", "finish_reason",
            "stop_reason"} <= set(CompletionOutput.__dataclass_fields__)
    assert {"request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "finished",
            "metrics"} <= set(RequestOutput.__dataclass_fields__)


def test_generate_streams_cumulative_outputs_like_llm_generate(engine, reference):
    assert not engine.is_running          # the first request starts the loop: no start() needed
    outs = asyncio.run(collect(engine, PROMPT, GREEDY, "cumulative"))
    assert engine.is_running
    assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, 7))
    assert [o.finished for o in outs] == [False] * 5 + [True]
    last = outs[-1]
    assert last.request_id == "cumulative" and last.prompt == PROMPT
    assert last.prompt_token_ids == [5, 6, 7, 8, 9]
    assert last.outputs[0].token_ids == reference and last.outputs[0].finish_reason == "length"
    assert last.outputs[0].text == " ".join(f"w{t}" for t in reference)


@pytest.mark.parametrize("prompt", [TextPrompt(prompt=PROMPT),
                                    TokensPrompt(prompt_token_ids=[5, 6, 7, 8, 9])])
def test_prompt_dicts(engine, reference, prompt):
    last = asyncio.run(collect(engine, prompt, GREEDY, "dict"))[-1]
    assert last.prompt_token_ids == [5, 6, 7, 8, 9] and last.outputs[0].token_ids == reference


def test_output_kinds_delta_and_final_only(engine, reference):
    delta = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                           output_kind=RequestOutputKind.DELTA)
    outs = asyncio.run(collect(engine, PROMPT, delta, "delta"))
    assert [len(o.outputs[0].token_ids) for o in outs] == [1] * 6
    assert [t for o in outs for t in o.outputs[0].token_ids] == reference
    assert "".join(o.outputs[0].text for o in outs) == " ".join(f"w{t}" for t in reference)
    final = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                           output_kind=RequestOutputKind.FINAL_ONLY)
    outs = asyncio.run(collect(engine, PROMPT, final, "final"))
    assert len(outs) == 1 and outs[0].finished and outs[0].outputs[0].token_ids == reference


def test_abort_ends_the_stream_with_finish_reason_abort(engine):
    long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)

    async def run():
        outs = []
        async for out in engine.generate(PROMPT, long, "to-abort"):
            outs.append(out)
            if len(outs) == 2:
                await engine.abort("to-abort")
        await engine.abort(["no-such-request"])     # unknown ids are ignored
        return outs

    outs = asyncio.run(run())
    assert 3 <= len(outs) < 500 and outs[-1].finished
    assert outs[-1].outputs[0].finish_reason == "abort"
    wait_until_clean(engine)


def test_leaving_generate_early_aborts_the_request(engine):
    async def run():
        gen = engine.generate(PROMPT, SamplingParams(max_tokens=500, ignore_eos=True), "leave")
        async for _ in gen:
            break
        await gen.aclose()

    asyncio.run(run())
    wait_until_clean(engine)


def test_tokenizer_model_config_and_unsupported_options(engine):
    async def run():
        assert (await engine.get_tokenizer()) is engine.tokenizer
        assert (await engine.get_model_config()).max_model_len == engine.max_model_len
        await engine.check_health()
        for kw in ({"lora_request": object()}, {"priority": 1}):   # upstream's keywords
            with pytest.raises(ValueError, match=next(iter(kw))):
                [o async for o in engine.generate(PROMPT, GREEDY, "opts", **kw)]

    asyncio.run(run())
    assert engine.tokenizer.encode("w5 w6", add_special_tokens=False) == [5, 6]


def test_check_health_fails_once_the_loop_dies(tiny_llama):
    class Fatal(BaseException):      # not an Exception: the loop cannot recover from it
        pass

    eng = make(tiny_llama)

    def step():
        raise Fatal("boom")
    eng.engine.step = step

    async def run():
        await eng.check_health()      # not started yet: healthy
        with pytest.raises(EngineDeadError, match="died"):
            await collect(eng, PROMPT, GREEDY, "dies")
        with pytest.raises(EngineDeadError, match="died"):
            await eng.check_health()
        with pytest.raises(EngineDeadError):        # no new request is taken
            await collect(eng, PROMPT, GREEDY, "after")

    asyncio.run(run())
    assert eng.errored and not eng.is_running
    eng.shutdown()


def test_shutdown_stops_the_thread_and_fails_health(tiny_llama):
    eng = make(tiny_llama)
    thread = eng._thread

    async def run():
        await collect(eng, PROMPT, GREEDY, "before")
        await eng.check_health()
        eng.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            await eng.check_health()
        with pytest.raises(EngineDeadError):
            await collect(eng, PROMPT, GREEDY, "after")

    asyncio.run(run())
    assert not thread.is_alive() and thread not in threading.enumerate()
    idle = make(tiny_llama)           # shut down before it ever ran: its thread ends too
    idle_thread = idle._thread
    idle.shutdown()
    assert not idle_thread.is_alive()


def test_start_engine_loop_false_waits_for_start(tiny_llama):
    eng = AsyncLLMEngine.from_engine_args(
        AsyncEngineArgs(model=tiny_llama, num_gpu_blocks_override=64), start_engine_loop=False)
    try:
        with pytest.raises(EngineDeadError, match="not running"):
            asyncio.run(collect(eng, PROMPT, GREEDY, "x"))
        eng.start()
        assert asyncio.run(collect(eng, PROMPT, GREEDY, "x"))[-1].finished
    finally:
        eng.shutdown()


# ---- guidellm ----------------------------------------------------------------------------------
def _guidellm():
    return pytest.importorskip(
        "guidellm.backends.vllm_python",
        reason="guidellm is not installed (requirements-dev.txt pins guidellm==0.8.1)")


def test_guidellm_vllm_python_backend_runs_requests(tiny_llama, tmp_path):
    """guidellm's own backend class, its calls unchanged: AsyncEngineArgs(**vllm_config),
    from_engine_args, check_health, engine.tokenizer (chat template), generate, shutdown."""
    backends = _guidellm()
    from guidellm.schemas import GenerationRequest, RequestInfo
    from guidellm.schemas.backends import VLLMPythonAsyncBackendArgs
    from guidellm.schemas.base.request import UsageMetrics

    model = chat_model_dir(tiny_llama, str(tmp_path / "chat"))   # template: w3 <msg> w4 w5
    args = VLLMPythonAsyncBackendArgs(model=model, vllm_config={"num_gpu_blocks_override": 64})
    backend = backends.VLLMPythonAsyncBackend(args)

    async def run():
        await backend.process_startup()
        await backend.validate()
        results = []
        for n in (3, 5, 7, 9):
            words = " ".join(f"w{10 + i}" for i in range(n))
            request = GenerationRequest(columns={"text_column": [words]},
                                        output_metrics=UsageMetrics(text_tokens=4 + n % 3))
            async for response, info in backend.resolve(request, RequestInfo()):
                results.append((n, response, info))
        engine = backend._engine
        await backend.process_shutdown()
        return results, engine

    results, engine = asyncio.run(run())
    assert len(results) == 4
    for n, response, info in results:
        assert response.input_metrics.text_tokens == n + 3       # chat template's 3 words
        assert response.output_metrics.text_tokens == 4 + n % 3  # ignore_eos: exactly that many
        assert len(response.text.split()) == 4 + n % 3
        assert info.timings.first_token_iteration <= info.timings.last_token_iteration
    assert engine.errored and not engine.is_running             # process_shutdown's shutdown()


@pytest.mark.slow
def test_benchmark_guidellm_script(tiny_llama_bytes, tmp_path, monkeypatch):
    """benchmarks/benchmark_guidellm.py end to end: guidellm's scheduler spawns a worker that
    builds our AsyncLLMEngine; synchronous profile, a handful of requests."""
    _guidellm()
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import benchmark_guidellm as bench
    monkeypatch.setattr(bench.common, "RESULTS", str(tmp_path))
    rows = bench.main(["--model", tiny_llama_bytes, "--concurrency", "--max-requests", "4",
                       "--warmup", "0", "--prompt-tokens", "12", "--output-tokens", "5",
                       "--vllm-config", '{"num_gpu_blocks_override": 64}', "--threads", "1"])
    assert len(rows) == 1 and rows[0]["profile"] == "synchronous"
    assert rows[0]["requests"] == 4 and rows[0]["errored"] == 0 and rows[0]["measured"] >= 1
    assert rows[0]["out_tok_s"] > 0 and rows[0]["latency_s_p50"] > 0
    assert os.path.exists(tmp_path / "guidellm.json")
    assert os.path.exists(tmp_path / "guidellm_report_synchronous.json")
