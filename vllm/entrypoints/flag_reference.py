"""The docs' reference pages, generated from their one definition each:
docs/flags.md from `vllm serve`'s parser (EngineArgs' fields and the server's options) and
docs/environment.md from vllm/envs.py.

    python -m vllm.entrypoints.flag_reference          # rewrite both pages
    python -m vllm.entrypoints.flag_reference --check  # exit 1 if either is out of date
"""
import argparse
import sys
from pathlib import Path
from typing import Dict

from vllm import envs

DOCS = Path(__file__).resolve().parents[2] / "docs"


def serve_parser() -> argparse.ArgumentParser:
    from vllm.entrypoints.cli import make_parser
    sub = next(a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _default(action: argparse.Action) -> str:
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        return "off" if not action.default else "on"
    return "none" if action.default is None else f"`{action.default}`"


def flags_page() -> str:
    rows = ["# Engine and server flags", "",
            "`vllm serve [MODEL] [flags]`; `python -m vllm.entrypoints.openai.api_server` takes "
            "the same flags with `--model`. Every engine flag is also a keyword of `LLM(...)` and "
            "`EngineArgs(...)` (the flag's name with underscores); the flags marked *per request* "
            "are also fields of an OpenAI request body and of `KVEvictionParams`. Generated from "
            "the parser by `python -m vllm.entrypoints.flag_reference`.", "",
            "| Flag | Default | Values | Meaning |", "|---|---|---|---|"]
    from vllm.engine.arg_utils import request_flags
    per_request = {f.name for f in request_flags()}
    for action in serve_parser()._actions:
        if action.help == argparse.SUPPRESS or not action.option_strings \
                or isinstance(action, argparse._HelpAction):
            continue
        names = ", ".join(f"`{s}`" for s in action.option_strings)
        values = " \\| ".join(f"`{c}`" for c in action.choices) if action.choices else ""
        meaning = action.help or ""
        if action.dest in per_request:
            meaning += " *(per request)*"
        rows.append(f"| {names} | {_cell(_default(action))} | {values} | {_cell(meaning)} |")
    return "\n".join(rows) + "\n"


def environment_page() -> str:
    return ("# Environment variables\n\nEvery `VLLM_*` variable the engine reads, defined in "
            "`vllm/envs.py`; each is read when it is used.\n\n" + envs.reference())


def pages() -> Dict[Path, str]:
    return {DOCS / "flags.md": flags_page(), DOCS / "environment.md": environment_page()}


def main(argv=None) -> int:
    check = "--check" in (argv if argv is not None else sys.argv[1:])
    stale = []
    for path, text in pages().items():
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.write_text(text)
    if stale:
        print("out of date (run python -m vllm.entrypoints.flag_reference): " + ", ".join(stale))
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
