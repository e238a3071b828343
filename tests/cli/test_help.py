"""`jserve serve --help` explains every flag, from the same text as the settings' docstrings,
and a flag out of its declared range fails as the constructor does."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys

import pytest

from jserve.config.engine_args import EngineArgs
from jserve.config.scheduler import SchedulerConfig
from jserve.config.settings import InvalidSetting, flag_name
from jserve.server import __main__ as python_m_server
from jserve.server.cli import build_parser, main
from jserve.server.settings import ServerSettings


def _serve_parser() -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["serve"]


def test_every_serve_flag_has_help():
    flags = [a for a in _serve_parser()._actions if a.option_strings and a.dest != "help"]
    assert len(flags) > len(dataclasses.fields(EngineArgs))  # engine and server flags
    for action in flags:
        assert action.help and action.help.strip(), action.option_strings


@pytest.mark.parametrize("settings", [EngineArgs, ServerSettings])
def test_flags_and_docstrings_come_from_one_text(settings):
    actions = {a.dest: a for a in _serve_parser()._actions}
    for f in dataclasses.fields(settings):
        action = actions[f.name]  # every setting has a flag, named after it
        assert flag_name(f.name) in action.option_strings
        what = f.metadata["help"]
        assert action.help.startswith(what.replace("%", "%%")), f.name
        assert "(default: " in action.help and "vLLM" in action.help, f.name
        assert f"    {f.name}: {what} (default: " in settings.__doc__, f.name


def test_shared_scheduler_settings_have_one_text():
    # max_model_len differs: the engine resolves it from the model.
    for f in dataclasses.fields(SchedulerConfig):
        if f.name in EngineArgs.field_names() - {"max_model_len"}:
            engine_field = {g.name: g for g in dataclasses.fields(EngineArgs)}[f.name]
            assert dict(f.metadata) == dict(engine_field.metadata), f.name


@pytest.mark.parametrize(
    ("flag", "value", "must_be"),
    [
        ("--port", "70000", "an integer in [0, 65535], got 70000"),
        ("--shutdown-timeout", "-1", "a finite number in [0, 86400], got -1.0"),
        ("--header-timeout", "0", "a finite number in (0, 86400], got 0.0"),
        ("--body-timeout", "nan", "a finite number in (0, 86400], got nan"),
        ("--stream-idle-timeout", "1e400", "a finite number in [0, 86400], got inf"),
        ("--max-body-bytes", "0", "an integer in [1, 2**31-1], got 0"),
        ("--max-half-open-connections", "0", "an integer in [1, 1000000], got 0"),
        ("--max-tenant-labels", "-1", "an integer in [0, 100000], got -1"),
    ],
)
def test_a_setting_out_of_range_fails_alike_as_a_flag_and_in_python(flag, value, must_be, capsys):
    name = flag.removeprefix("--").replace("-", "_")
    message = f"{name} must be {must_be}"
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", flag, value])
    assert exited.value.code == 2
    assert f"argument {flag}: {message}" in capsys.readouterr().err
    kind = type(getattr(ServerSettings, name))
    with pytest.raises(InvalidSetting) as error:
        ServerSettings(**{name: kind(value)})
    assert (str(error.value), error.value.name) == (message, name)


def test_python_m_jserve_server_is_the_jserve_program_and_keeps_its_mock(capsys):
    help_texts = []
    for program in (python_m_server.main, main):
        with pytest.raises(SystemExit) as exited:
            program(["serve", "--help"])
        assert exited.value.code == 0
        help_texts.append(capsys.readouterr().out)
    assert help_texts[0] == help_texts[1] and "--max-num-seqs" in help_texts[0]
    with pytest.raises(SystemExit) as exited:
        python_m_server.main(["--mock", "--help"])
    mock_help = capsys.readouterr().out
    assert exited.value.code == 0 and "--mock-token-delay" in mock_help
    assert "--shutdown-timeout" in mock_help and "--max-num-seqs" not in mock_help


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
