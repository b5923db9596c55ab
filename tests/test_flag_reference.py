"""Each flag has one definition (EngineArgs' fields, the server's options, vllm/envs.py) and the
docs' reference pages are generated from it: they are current, and every flag `vllm serve
--help` prints is on the page with its real default."""
import argparse
import dataclasses
import os
import re
import subprocess
import sys

import pytest

from vllm import KVEvictionParams
from vllm.engine.arg_utils import EngineArgs, request_flags
from vllm.entrypoints import flag_reference
from vllm.entrypoints.openai.protocol import CompletionRequest, ChatCompletionRequest


def test_reference_pages_are_current():
    assert flag_reference.main(["--check"]) == 0


def test_every_serve_flag_is_documented_with_its_default():
    help_text = subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli", "serve", "--help"],
                               capture_output=True, text=True, check=True,
                               env={**os.environ, "COLUMNS": "10000"}).stdout   # no wrapping
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", help_text)) - {"--help"}
    assert "--kv-eviction-policy" in flags and "--api-key" in flags
    page = (flag_reference.DOCS / "flags.md").read_text()
    rows = {m.group(1): line for line in page.splitlines()
            for m in [re.match(r"\| `(--[a-z0-9-]+)`", line)] if m}
    negated = {f for f in flags if f.startswith("--no-") and f"--{f[5:]}" in flags}
    assert flags - negated <= set(rows), sorted(flags - negated - set(rows))
    for action in flag_reference.serve_parser()._actions:
        if action.option_strings and action.option_strings[0] in rows:
            row = rows[action.option_strings[0]]
            default = row.split(" | ")[1]
            if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
                assert default == ("on" if action.default else "off"), row
            else:
                assert default == ("none" if action.default is None
                                   else f"`{action.default}`"), row


def test_engine_args_fields_are_the_flags():
    """Every EngineArgs field is a flag whose default is the field's, so `LLM(**kwargs)` and
    the CLI cannot disagree."""
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    defaults = vars(parser.parse_args([]))
    for field in dataclasses.fields(EngineArgs):
        assert defaults[field.name] == field.default, field.name


def test_per_request_fields_come_from_the_flags():
    names = [f.name for f in request_flags()]
    assert names[0] == "kv_eviction_policy" and "kv_min_tokens" in names
    params = [f.name for f in dataclasses.fields(KVEvictionParams)]
    assert [KVEvictionParams.body_field(p) for p in params] == names
    for request in (CompletionRequest, ChatCompletionRequest):
        for name in names:
            assert name in request.model_fields, (request.__name__, name)
            assert request.model_fields[name].default is None


def test_policy_names_come_from_the_registry():
    """The CLI's choices, and the check of LLM(...) keywords and request fields."""
    from vllm.core.eviction import POLICY_CLASSES, policy_names
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    action = next(a for a in parser._actions if a.dest == "kv_eviction_policy")
    assert tuple(action.choices) == policy_names() == ("none", *POLICY_CLASSES)
    with pytest.raises(ValueError, match="--kv-eviction-policy: must be one of"):
        EngineArgs(kv_eviction_policy="bogus").eviction_config()
    with pytest.raises(ValueError, match="kv_eviction_policy: must be one of"):
        KVEvictionParams(policy="bogus")
