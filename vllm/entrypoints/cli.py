"""The `vllm` console script: `vllm serve [MODEL] [engine and server flags]`,
`vllm bench serve | throughput | latency [flags]`, `vllm --version`."""
import argparse
import sys
from typing import List, Optional

import vllm
from vllm.engine.arg_utils import EngineArgs


def _serve_parser(sub) -> None:
    from vllm.entrypoints.openai.api_server import add_server_args
    p = sub.add_parser("serve", help="start the OpenAI-compatible server",
                       description="Start the OpenAI-compatible server. Without MODEL it serves "
                                   "the default model (SmolLM2-135M-Instruct).")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="local HF model directory or .gguf file")
    p.add_argument("--model", type=str, default=None, help=argparse.SUPPRESS)
    EngineArgs.add_cli_args(p, model_positional=True)
    add_server_args(p)
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> None:
    from vllm.entrypoints.openai.api_server import run_server
    if args.model_tag and args.model and args.model_tag != args.model:
        sys.exit(f"vllm serve: model given twice ({args.model_tag!r} and --model {args.model!r})")
    args.model = args.model_tag or args.model
    run_server(args)


BENCHMARKS = {   # `vllm bench NAME` -> (module under vllm.benchmarks, help)
    "latency": ("latency", "the latency of one batch of requests, offline"),
    "serve": ("serve", "online serving throughput and latency against a running server"),
    "throughput": ("throughput", "offline throughput of the engine on a batch of requests"),
}


def _bench_parser(sub) -> None:
    import importlib
    p = sub.add_parser("bench", help="benchmark the online server or the offline engine",
                       description="Benchmarks with upstream vLLM's flags and result keys.")
    kinds = p.add_subparsers(dest="bench_type", metavar="BENCH_TYPE", required=True)
    for name, (module_name, help_text) in BENCHMARKS.items():
        module = importlib.import_module(f"vllm.benchmarks.{module_name}")
        q = kinds.add_parser(name, help=help_text, description=module.__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_cli_args(q)
        q.set_defaults(func=module.main)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm", description="vLLM fork with vToken")
    parser.add_argument("-v", "--version", action="version", version=vllm.__version__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _serve_parser(sub)
    _bench_parser(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> None:
    parser = make_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        sys.exit(2)
    args.func(args)


if __name__ == "__main__":
    main()
