"""vLLM's serve command line (jserve.server.vllm_flags): every flag of the table either sets
its jserve setting with vLLM's meaning or, refused, stops with one line naming what to use;
the model may be positional. Parsing only: no model, no server."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from jserve.config.engine_args import EngineArgs
from jserve.config.settings import flag_name, from_namespace
from jserve.server.cli import build_parser
from jserve.server.settings import ServerSettings
from jserve.server.vllm_flags import VLLM_SERVE_FLAGS, Outcome, take_model_tag

_BY_OUTCOME = {
    outcome: [entry for entry in VLLM_SERVE_FLAGS if entry.outcome is outcome]
    for outcome in Outcome
}


def _serve(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def _serve_parser() -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["serve"]


def test_the_table_names_each_of_at_least_40_vllm_flags_once():
    flags = [entry.flag for entry in VLLM_SERVE_FLAGS]
    assert len(flags) >= 40 and len(set(flags)) == len(flags)
    registered = {s for a in _serve_parser()._actions for s in a.option_strings}
    # Registered as they are, not reached through argparse's prefix matching.
    assert set(flags) <= registered


@pytest.mark.parametrize("entry", _BY_OUTCOME[Outcome.ACCEPTED], ids=lambda e: e.flag)
def test_an_accepted_flag_sets_its_setting_with_vllms_meaning(entry):
    ns = _serve(entry.flag, *entry.example)
    value = getattr(ns, entry.setting)
    expected = entry.example[0] if entry.example else not entry.flag.startswith("--no-")
    assert (str(value) if entry.example else value) == expected
    settings = EngineArgs if entry.setting in EngineArgs.field_names() else ServerSettings
    built = from_namespace(settings, ns)  # the setting takes it as the constructor checks it
    assert getattr(built, entry.setting) == value


@pytest.mark.parametrize("entry", _BY_OUTCOME[Outcome.NO_EFFECT], ids=lambda e: e.flag)
def test_a_no_effect_flag_parses_with_a_one_line_note(entry, capsys):
    ns = _serve(entry.flag, *entry.example, "model.gguf")
    assert ns.model_tag == "model.gguf"  # the flag took no more than its own values
    assert capsys.readouterr().err == f"jserve: note: {entry.note}\n"
    assert vars(_serve("model.gguf")) == vars(ns)  # and changed nothing


@pytest.mark.parametrize("entry", _BY_OUTCOME[Outcome.REFUSED], ids=lambda e: e.flag)
def test_a_refused_flag_stops_with_one_line_naming_what_to_use(entry, capsys):
    with pytest.raises(SystemExit) as exited:
        _serve("model.gguf", entry.flag, *entry.example)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err == f"jserve serve: error: {entry.flag} is vLLM's; {entry.note}\n"


def test_every_vllm_flag_a_setting_declares_is_in_the_table_as_accepted():
    accepted = {entry.flag: entry.setting for entry in _BY_OUTCOME[Outcome.ACCEPTED]}
    for settings in (EngineArgs, ServerSettings):
        for f in dataclasses.fields(settings):
            vllm = f.metadata["vllm"]
            if vllm and vllm.startswith("--") and " " not in vllm:
                assert accepted.get(vllm) == f.name, (vllm, f.name)


def test_the_model_may_be_positional_as_in_vllm_serve():
    for argv, model in [
        (["m.gguf"], "m.gguf"),
        (["--model", "m.gguf"], "m.gguf"),
        (["m.gguf", "--model", "m.gguf"], "m.gguf"),
        (["--port", "9000", "m.gguf", "--max-num-seqs", "4"], "m.gguf"),
        ([], None),
    ]:
        ns = _serve(*argv)
        take_model_tag(ns)
        assert ns.model == model, argv
    ns = _serve("a.gguf", "--model", "b.gguf")
    with pytest.raises(ValueError, match=r"given twice, as MODEL 'a\.gguf' and --model 'b\.gguf'"):
        take_model_tag(ns)


def test_an_unknown_tool_call_parser_is_refused_naming_the_accepted_ones(capsys):
    with pytest.raises(SystemExit) as exited:
        _serve("--tool-call-parser", "llama3_json")
    assert exited.value.code == 2
    last_line = capsys.readouterr().err.splitlines()[-1]
    assert "--tool-call-parser: invalid choice: 'llama3_json' (choose from " in last_line
    assert last_line.endswith("hermes')") or last_line.endswith("hermes)")


def flags_table() -> str:
    """VLLM_SERVE_FLAGS as a Markdown table, as docs/vllm.md holds it."""
    rows = ["| vLLM flag | outcome | in jserve |", "| --- | --- | --- |"]
    for entry in VLLM_SERVE_FLAGS:
        if entry.outcome is not Outcome.ACCEPTED:
            what = entry.note
        elif entry.flag.replace("--no-", "--") == flag_name(entry.setting):
            what = "the same flag"
        else:
            what = f"another name of `{flag_name(entry.setting)}`"
        rows.append(f"| `{entry.flag}` | {entry.outcome} | {what} |")
    return "\n".join(rows)


def test_the_docs_flag_table_is_the_declaration():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "vllm.md").read_text()
    found = re.search(r"<!-- vllm-flags:.*?-->\n(.*?)\n<!-- /vllm-flags -->", doc, re.S)
    assert found is not None and found[1] == flags_table()


def test_compile_refuses_gpu_memory_utilization_naming_its_own_pool_flags(capsys):
    from jserve.server.cli import main

    assert main(["compile", "--target", "cpu", "--gpu-memory-utilization", "0.5"]) == 2
    assert capsys.readouterr().err.endswith(
        "jserve: error: jserve compile sizes the KV pool with --kv-cache-fraction (of each "
        "chip's memory) or --kv-cache-memory; drop --gpu-memory-utilization\n"
    )
