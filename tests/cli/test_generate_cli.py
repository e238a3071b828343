"""`jserve generate` as a user runs it: text on stdout, logs on stderr, clear errors.

The runs that generate take the shared engine's sizes, so they load its compiled steps from
the persistent compilation cache, and their greedy text must be the shared engine's."""

from __future__ import annotations

import subprocess
import sys

from jserve.sampling_params import SamplingParams
from tests.shared_engine import engine_flags, run_to_completion


def _jserve(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jserve.server.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def test_chat_answer_is_sensible(shared_engine):  # built first: it fills both caches
    question = "What is the capital of France?"
    out = _jserve("generate", "--chat", question, "--max-tokens", "32", *engine_flags())
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "INFO" not in out.stdout and "ready" in out.stderr  # logs never mix into the text


def test_raw_prompt_greedy_is_the_engines_greedy_text(engine):
    prompt = "The capital of France is"
    out = _jserve("generate", prompt, "--max-tokens", "8", "--temperature", "0", *engine_flags())
    assert out.returncode == 0, out.stderr
    engine.add_request("cli", prompt, SamplingParams(temperature=0, max_tokens=8))
    expected = run_to_completion(engine)["cli"].outputs[0].text
    assert out.stdout == expected + "\n" and expected.strip()


def test_missing_model_is_a_clear_error(tmp_path):
    out = _jserve("generate", "hi", "--model", str(tmp_path / "missing.gguf"))
    assert out.returncode == 2
    assert "missing.gguf" in out.stderr and "Traceback" not in out.stderr


def test_bad_max_tokens_is_a_clear_error():
    out = _jserve("generate", "hi", "--max-tokens", "0")
    assert out.returncode == 2
    assert "max_tokens must be an integer in [1, 2147483647], got 0" in out.stderr
