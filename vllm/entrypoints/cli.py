"""The `vllm` console script: `vllm serve [MODEL] [engine and server flags]`, `vllm --version`."""
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


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm", description="vLLM fork with vToken")
    parser.add_argument("-v", "--version", action="version", version=vllm.__version__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _serve_parser(sub)
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
