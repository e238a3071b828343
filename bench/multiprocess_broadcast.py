"""What process 0's per-step broadcast costs in a multi-process run (jserve.runtime.multihost).

    python -m bench.multiprocess_broadcast                  # SmolLM2, 3 local processes
    python -m bench.multiprocess_broadcast --processes 2 --requests 8

Starts N processes of one run on this machine (gloo collectives over localhost), tensor
parallel over their N devices, and has process 0 run a fixed greedy batch offline: each
request's prompt is prefilled in chunks, then decoded one token per step. It prints the steps,
the mean wall time of a step as process 0 sees it (schedule to sampled tokens), and the part of
it spent broadcasting the step's inputs (the one collective per step that single-process
serving does not have), mean and p50/p90 of its share. The broadcast waits for every
process to enter it, so its time includes any lag of the slowest process.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, num_kv_blocks=257)


def _child(process_id: int, port: int, processes: int, requests: int, output_len: int) -> int:
    import numpy as np

    from jserve.config.engine_args import EngineArgs
    from jserve.sampling_params import SamplingParams

    args = EngineArgs(
        **ENGINE, tensor_parallel_size=processes, coordinator_address=f"127.0.0.1:{port}",
        num_processes=processes, process_id=process_id,
    )  # fmt: skip
    if process_id > 0:
        from jserve.engine.follower import run_follower

        return run_follower(args)
    from jserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(args)
    channel = engine.runner.channel
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(requests):
        ids = rng.integers(100, 40000, int(rng.integers(16, 200))).tolist()
        engine.add_request(f"b{i}", {"prompt_token_ids": ids}, params)
    step_seconds, send_seconds = [], []
    while engine.has_unfinished_requests():
        sent_before = channel.step_send_seconds
        start = time.perf_counter()
        engine.step()
        step_seconds.append(time.perf_counter() - start)
        send_seconds.append(channel.step_send_seconds - sent_before)
    step, send = np.asarray(step_seconds), np.asarray(send_seconds)
    share = send / step
    print(
        "RESULT"
        + json.dumps(
            {
                "processes": processes,
                "steps": len(step),
                "step_ms_mean": 1e3 * step.mean(),
                "broadcast_ms_mean": 1e3 * send.mean(),
                "broadcast_ms_p50": 1e3 * float(np.percentile(send, 50)),
                "broadcast_ms_p90": 1e3 * float(np.percentile(send, 90)),
                "broadcast_share_mean": float(share.mean()),
                "message_int32s": channel.message_len,
                "serving_compilations": engine.stats().serving_compilations,
            }
        ),
        flush=True,
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.child is not None:
        return _child(a.child, a.port, a.processes, a.requests, a.output_len)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    env.pop("XLA_FLAGS", None)
    common = ["--processes", str(a.processes), "--requests", str(a.requests)]
    common += ["--output-len", str(a.output_len), "--port", str(port)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "bench.multiprocess_broadcast", "--child", str(i), *common],
            stdout=subprocess.PIPE if i == 0 else subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=ROOT,
        )
        for i in range(a.processes)
    ]
    out, _ = procs[0].communicate(timeout=600)
    codes = [procs[0].returncode] + [p.wait(timeout=60) for p in procs[1:]]
    if any(codes) or "RESULT" not in out:
        print(f"a process failed: exit codes {codes}", file=sys.stderr)
        return 1
    result = json.loads(out.split("RESULT")[1].splitlines()[0])
    print(f"load (1 min) now: {os.getloadavg()[0]:.2f}")
    for key, value in result.items():
        print(f"{key:22s} {value:.3f}" if isinstance(value, float) else f"{key:22s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
