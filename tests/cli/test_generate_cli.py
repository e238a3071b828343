"""`jserve generate` as a user runs it: text on stdout, logs on stderr, clear errors."""

from __future__ import annotations

import subprocess
import sys


def _jserve(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jserve.server.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def test_chat_answer_is_sensible(default_model):  # the fixture fills the conversion cache
    out = _jserve("generate", "--chat", "What is the capital of France?", "--max-tokens", "32")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "INFO" not in out.stdout and "ready" in out.stderr  # logs never mix into the text


def test_raw_prompt_greedy_is_deterministic(default_model):
    args = ("generate", "The capital of France is", "--max-tokens", "8", "--temperature", "0")
    first, second = _jserve(*args), _jserve(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout and first.stdout.strip()


def test_missing_model_is_a_clear_error(tmp_path):
    out = _jserve("generate", "hi", "--model", str(tmp_path / "missing.gguf"))
    assert out.returncode == 2
    assert "missing.gguf" in out.stderr and "Traceback" not in out.stderr


def test_bad_max_tokens_is_a_clear_error():
    out = _jserve("generate", "hi", "--max-tokens", "0")
    assert out.returncode == 2
    assert "max_tokens must be an integer in [1, 2147483647], got 0" in out.stderr
