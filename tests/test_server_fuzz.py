"""Property-based run: schemathesis draws request bodies from the server's own OpenAPI schema
(valid ones and schema-violating ones) for /v1/completions and /v1/chat/completions. No answer
may be a 5xx, none may hang, every 4xx is in OpenAI's error shape, and the engine ends clean.

The server runs with --max-model-len 32 so that every valid request is short.
VLLM_FUZZ_EXAMPLES raises the number of examples per operation and mode (default 25).
"""
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

schemathesis = pytest.importorskip("schemathesis")

from tests.server_utils import chat_model_dir, serve, wait_until_clean  # noqa: E402

EXAMPLES = int(os.environ.get("VLLM_FUZZ_EXAMPLES", "25"))
OPERATIONS = [("/v1/completions", "POST"), ("/v1/chat/completions", "POST")]


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama, tmp_path_factory):
    model = chat_model_dir(tiny_llama, str(tmp_path_factory.mktemp("fuzz") / "llama"))
    engine, srv = serve(model, max_model_len=32, num_gpu_blocks_override=128, max_num_seqs=64)
    with srv:
        srv.engine = engine
        srv.schema = schemathesis.openapi.from_dict(httpx.get(srv.url + "/openapi.json").json())
        yield srv


def _check(srv, case) -> None:
    response = case.call(base_url=srv.url, timeout=60)
    assert response.status_code < 500, (case.body, response.text[:500])
    if response.status_code >= 400:
        err = response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err


def _servable(case):
    """Nudge a schema-valid body towards one the server runs (rather than rejects), so the
    generation paths meet random combinations of n, logprobs, stop, echo, stream, seed, ..."""
    body = case.body
    if isinstance(body, dict):
        for key in ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                    "best_of", "suffix", "tools", "response_format", "top_logprobs"):
            body.pop(key, None)
        body["model"] = "tiny"
        body["max_tokens"] = 1 + (body.get("max_tokens") or 0) % 8
        body.pop("max_completion_tokens", None)
        body["min_tokens"] = min(body.get("min_tokens") or 0, body["max_tokens"])
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            body["prompt"] = [[3 + abs(t) % 500 for t in p] if isinstance(p, list) else
                              3 + abs(p) % 500 if isinstance(p, int) else p for p in prompt]
    return case


@pytest.mark.parametrize("mode", ["positive", "servable", "negative"])
@pytest.mark.parametrize("path,method", OPERATIONS)
def test_no_server_error_no_hang(fuzz_server, path, method, mode):
    op = fuzz_server.schema[path][method]
    strategy = op.as_strategy(generation_mode=schemathesis.GenerationMode(
        "positive" if mode == "servable" else mode))
    if mode == "servable":
        strategy = strategy.map(_servable)

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case):
        _check(fuzz_server, case)

    run()
    wait_until_clean(fuzz_server.engine)
    assert fuzz_server.engine.is_running
