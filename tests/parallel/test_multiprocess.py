"""Three local processes on JAX's distributed runtime (gloo collectives), one device each.

Process 0 schedules and broadcasts every step; processes 1 and 2 run the same compiled steps on
their third of the mesh (tests/parallel/multiprocess_child.py). Greedy tokens must equal one
process's, nothing compiles while serving, each process holds a third of the KV pool, process
0's exit stops the others cleanly, and a killed process makes the others stop with a clear
error instead of hanging.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.parallel.workload import tiny_model

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 420  # three processes compile on shared cores


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_dir(default_model, tmp_path_factory) -> Path:
    """The tiny model as a jserve checkpoint directory, which each process loads by path."""
    from jserve.loaders.checkpoint_dir import save_checkpoint

    tiny = tiny_model(default_model)
    path = tmp_path_factory.mktemp("tiny") / "tiny-random"
    return save_checkpoint(path, tiny.config, tiny.params, tiny.tokenizer)


def _spawn(argv_of: Callable[[int], list[str]]) -> list[subprocess.Popen]:
    """Three processes, `python argv_of(i)` for process i, one CPU device each."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("XLA_FLAGS", None)
    pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return [
        subprocess.Popen([sys.executable, *argv_of(i)], **pipes, text=True, env=env, cwd=ROOT)
        for i in range(3)
    ]


def _start(mode: str, model: Path) -> list[subprocess.Popen]:
    port = _free_port()
    child = ["-m", "tests.parallel.multiprocess_child"]
    return _spawn(lambda i: [*child, str(i), str(port), mode, str(model)])


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    deadline = time.monotonic() + timeout
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("a process of the run hung") from None
        results.append((p.returncode, out))
    return results


@pytest.fixture(scope="module")
def run(tiny_dir) -> list[tuple[int, str]]:
    return _finish(_start("ok", tiny_dir), TIMEOUT)


@pytest.fixture(scope="module")
def report(run) -> dict:
    code, out = run[0]
    assert code == 0, out[-3000:]
    return json.loads(out.split("REPORT")[1].splitlines()[0])


def test_greedy_tokens_equal_one_process(report, three_devices):
    """One device's run of the same workload on the same tiny model is the 3-device process's
    (tests/parallel/conftest.py): its `tiny/1`."""
    one = three_devices["tiny/1"]
    assert report["tokens"] == one["tokens"]
    assert report["preemptions"] == one["preemptions"] > 0
    assert report["prefix_cache_hits"] == one["prefix_cache_hits"] > 0


def test_no_compiles_while_serving_and_a_third_of_the_pool_each(report):
    assert report["serving_compilations"] == 0
    assert report["pool_shard_bytes"] == [report["pool_bytes"] // 3]  # process 0's one device
    assert report["steps_sent"] > 0


def test_process_zero_exiting_stops_the_others_cleanly(run):
    for code, out in run[1:]:
        assert code == 0, out[-3000:]
        assert "process 0 stopped the run after" in out


@pytest.mark.slow
def test_a_killed_process_stops_the_others_with_a_clear_error(tiny_dir):
    """A second 3-process start, so slow. By default the run's 3-process start covers a clean
    stop (test_process_zero_exiting_stops_the_others_cleanly); a killed follower only here."""
    procs = _start("die", tiny_dir)
    leader = procs[0]
    for line in leader.stdout:  # READY: every process has built its engine and follows
        if line.startswith("READY"):
            break
    else:
        raise AssertionError("process 0 never became ready: " + str(_finish(procs, 30)))
    procs[2].send_signal(signal.SIGKILL)
    procs[2].wait(30)
    started = time.monotonic()
    leader.stdin.write("go\n")
    leader.stdin.flush()
    (code0, out0), (code1, out1), _ = _finish(procs, 60)  # no hang: well inside JAX's
    assert time.monotonic() - started < 60  # 100 s heartbeat timeout
    assert code0 == 1, out0[-3000:]
    error = json.loads(out0.split("ERROR ")[1].splitlines()[0])
    assert error.startswith("ProcessGroupError") and "3 processes" in error, error
    assert code1 == 1, out1[-3000:]
    assert "process 1 stops after 0 steps: a broadcast to the run's 3 processes failed" in out1


@pytest.mark.slow
def test_jserve_serve_over_three_processes_answers_and_drains_on_sigterm(tiny_dir):
    """Three `jserve serve` processes, so slow. By default the 3-process engine's serving
    path is covered by test_greedy_tokens_equal_one_process, and `jserve serve`'s drain on
    SIGTERM by tests/server/test_real_model_server.py; the two together only here."""
    import urllib.request

    from jserve.config.engine_args import EngineArgs
    from jserve.engine.llm_engine import LLMEngine
    from jserve.sampling_params import SamplingParams

    coordinator, http = _free_port(), _free_port()
    sizes = ["--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--max-model-len", "128"]
    sizes += ["--num-kv-blocks", "40", "--model", str(tiny_dir), "--port", str(http)]
    run = ["--tensor-parallel-size", "3", "--coordinator-address", f"127.0.0.1:{coordinator}"]
    run += ["--num-processes", "3"]
    procs = _spawn(
        lambda i: ["-m", "jserve.server.cli", "serve", *sizes, *run, "--process-id", str(i)]
    )
    url = f"http://127.0.0.1:{http}"
    deadline = time.monotonic() + TIMEOUT
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        assert time.monotonic() < deadline and procs[0].poll() is None, _finish(procs, 10)
        time.sleep(1)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    body = json.dumps({"prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
    request = urllib.request.Request(
        url + "/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as r:
        text = json.loads(r.read())["choices"][0]["text"]
    procs[0].send_signal(signal.SIGTERM)
    results = _finish(procs, 60)
    assert [code for code, _ in results] == [0, 0, 0], [out[-2000:] for _, out in results]
    assert all("process 0 stopped the run" in out for _, out in results[1:])

    one = LLMEngine(EngineArgs(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                               num_kv_blocks=40, model=str(tiny_dir)))  # fmt: skip
    one.add_request("x", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8))
    while one.has_unfinished_requests():
        final = one.step()
    assert text == final[0].outputs[0].text
