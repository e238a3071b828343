"""`jserve serve --help` explains every flag, from the same text as the settings' docstrings."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys

from jserve.config.engine_args import EngineArgs
from jserve.config.scheduler import SchedulerConfig
from jserve.config.settings import flag_name
from jserve.server.cli import build_parser


def _serve_parser() -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["serve"]


def test_every_serve_flag_has_help():
    flags = [a for a in _serve_parser()._actions if a.option_strings and a.dest != "help"]
    assert len(flags) > len(dataclasses.fields(EngineArgs))  # engine and server flags
    for action in flags:
        assert action.help and action.help.strip(), action.option_strings


def test_engine_flags_and_docstrings_come_from_one_text():
    actions = {a.dest: a for a in _serve_parser()._actions}
    for f in dataclasses.fields(EngineArgs):
        action = actions[f.name]  # every setting has a flag, named after it
        assert flag_name(f.name) in action.option_strings
        what = f.metadata["help"]
        assert action.help.startswith(what.replace("%", "%%")), f.name
        assert "(default: " in action.help and "vLLM" in action.help, f.name
        assert f"    {f.name}: {what} (default: " in EngineArgs.__doc__, f.name
    # Shared settings have one text for both (max_model_len differs: the engine resolves it).
    for f in dataclasses.fields(SchedulerConfig):
        if f.name in EngineArgs.field_names() - {"max_model_len"}:
            engine_field = {g.name: g for g in dataclasses.fields(EngineArgs)}[f.name]
            assert dict(f.metadata) == dict(engine_field.metadata), f.name


def test_help_shows_each_subcommands_own_defaults():
    result = subprocess.run(
        [sys.executable, "-m", "jserve.server.cli", "generate", "--help"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "1000"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    shown = "requests running at once (default: 1; in [1, 2**31-1]; adjustable at run time; "
    assert shown + "vLLM: --max-num-seqs)" in text
    assert "tokens per KV-cache block (default: 16; in [1, 2**31-1]; vLLM: --block-size)" in text
