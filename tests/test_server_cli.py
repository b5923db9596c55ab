"""`vllm serve` and `python -m vllm.entrypoints.openai.api_server`: flags, and one real start."""
import dataclasses
import shlex
import subprocess

import httpx
import pytest

from tests.server_utils import free_port, interrupt, openai_client, vllm_command, wait_healthy
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.cli import make_parser
from vllm.entrypoints.openai.api_server import make_arg_parser, served_names
from vllm.model_executor.gguf_loader import DEFAULT_MODEL_NAME

# the flags of `make serve` (Makefile)
MAKE_SERVE = "--host 127.0.0.1 --port 8000 --kv-eviction-policy h2o --kv-eviction-ratio 0.5 " \
             "--kv-reclamation vtoken"


def _serve_args(argv: str):
    args = make_parser().parse_args(["serve", *shlex.split(argv)])
    args.model = args.model_tag or args.model
    return args


def test_make_serve_command_line():
    args = _serve_args(MAKE_SERVE)
    ea = EngineArgs.from_cli_args(args)
    assert (ea.model, ea.kv_eviction_policy, ea.kv_eviction_ratio, ea.kv_reclamation) == \
        (None, "h2o", 0.5, "vtoken")
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, None)
    assert served_names(args) == [DEFAULT_MODEL_NAME]


def test_every_engine_flag_and_default_reaches_engine_args():
    for parse in (lambda: _serve_args("some/model"),
                  lambda: make_arg_parser().parse_args(["--model", "some/model"])):
        ea = EngineArgs.from_cli_args(parse())
        assert ea == EngineArgs(model="some/model")
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    args = vars(_serve_args("m"))
    assert names <= set(args), names - set(args)
    args = _serve_args("m --served-model-name a b --api-key k --port 9 --kv-budget-tokens 64 "
                       "--no-enable-chunked-prefill --kv-check-invariants")
    ea = EngineArgs.from_cli_args(args)
    assert (ea.kv_budget_tokens, ea.enable_chunked_prefill, ea.kv_check_invariants) == \
        (64, False, True)
    assert served_names(args) == ["a", "b"] and args.api_key == "k" and args.port == 9


def test_cli_usage():
    with pytest.raises(SystemExit) as e:
        make_parser().parse_args(["--version"])
    assert e.value.code == 0
    with pytest.raises(SystemExit):
        make_parser().parse_args(["serve", "--kv-eviction-policy", "bogus"])


def test_vllm_serve_starts_and_answers(tiny_llama):
    """The console script with the eviction flags, for real, then a clean SIGINT shutdown."""
    port = free_port()
    cmd = vllm_command() + ["serve", tiny_llama, *shlex.split(MAKE_SERVE.replace("8000", str(port))),
            "--num-gpu-blocks-override", "128", "--served-model-name", "tiny",
            "--api-key", "k3y", "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, lambda path: httpx.get(url + path, timeout=1))
        client = openai_client(url, api_key="k3y")
        out = client.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=20,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 20
        metrics = httpx.get(url + "/metrics").text
        assert 'vllm:kv_evicted_tokens_total{engine="0",model_name="tiny"}' in metrics
        assert httpx.get(url + "/v1/models").status_code == 401
    finally:
        code = interrupt(proc)
    assert code == 0, proc.stdout.read()
