"""Executables that travel: `jserve compile --compilation-cache-dir DIR` writes every
executable an engine with the same flags runs, and an engine started on a copy of DIR at
another path in a fresh process (as on the serving machine) loads each of them and compiles
nothing.

Both sides run as their own processes: JAX fixes a process's cache directory at its first
compile through the cache, and a server is a process of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.parallel.workload import tiny_model

ROOT = Path(__file__).resolve().parents[2]
ENGINE_FLAGS = ["--max-num-seqs", "1", "--max-num-batched-tokens", "2", "--max-model-len", "64",
                "--num-kv-blocks", "16"]  # fmt: skip
# The engine, built from the same flags as `jserve serve` parses them; prints its compile counts.
ENGINE = """
import argparse, json, sys
from jserve.config.engine_args import add_engine_arguments, engine_args_from_namespace
from jserve.engine.llm_engine import LLMEngine
from jserve.runtime.compilation import cache_hit_count, compilation_count
parser = argparse.ArgumentParser()
add_engine_arguments(parser)
LLMEngine(engine_args_from_namespace(parser.parse_args(sys.argv[1:])))
print(json.dumps({"compilations": compilation_count(), "loaded": cache_hit_count()}))
"""


@pytest.fixture(scope="module")
def tiny_dir(default_model, tmp_path_factory) -> Path:
    """A 2-layer random model as a checkpoint directory: both processes load it by path."""
    from jserve.loaders.checkpoint_dir import save_checkpoint

    tiny = tiny_model(default_model)
    path = tmp_path_factory.mktemp("tiny") / "tiny-random"
    return save_checkpoint(path, tiny.config, tiny.params, tiny.tokenizer)


def _run(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_an_engine_loads_every_executable_jserve_compile_wrote(tiny_dir, tmp_path):
    cache = tmp_path / "xla"
    flags = ["--model", str(tiny_dir), *ENGINE_FLAGS, "--compilation-cache-dir", str(cache)]
    report_path = tmp_path / "report.json"
    _run("-m", "jserve.server.cli", "compile", "--target", "cpu", *flags,
         "--host-iterations", "0", "--report", str(report_path))  # fmt: skip
    report = json.loads(report_path.read_text())
    assert report["compilation_cache_dir"] == str(cache.resolve())
    rows = report["executables"]
    names = [r["name"] for r in rows]
    assert names[0] == "weight layout" and "kv pool init" in names and "sample" in names
    assert {r["cache"] for r in rows} == {"wrote"}
    entries = {r["cache_entry"] for r in rows}
    assert entries == {p.name for p in cache.iterdir()} and len(entries) == len(rows)
    assert "--max-model-len 64 --block-size 16 --num-kv-blocks 16" in report["serve_flags"]

    # The serving machine holds the directory elsewhere (another mount, another user's home).
    served = shutil.copytree(cache, tmp_path / "elsewhere" / "xla")
    flags[flags.index(str(cache))] = str(served)
    counts = json.loads(_run("-c", ENGINE, *flags).stdout.splitlines()[-1])
    # Every compilation of the engine's start-up was a load of one of those entries.
    assert counts == {"compilations": len(rows), "loaded": len(rows)}
    assert {p.name for p in served.iterdir()} == entries  # and it wrote nothing new
