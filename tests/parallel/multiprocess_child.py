"""One process of a 3-process run on the tiny model (tests/parallel/test_multiprocess.py).

argv: process_id, coordinator port, mode, model directory (the tiny model, saved by the test).
Process 0 runs the workload and prints a JSON report; mode "die" makes process 0 wait for a
line on stdin first (the test kills a follower in between), then report the error its step
raised.
"""

from __future__ import annotations

import json
import logging
import sys

from jserve.config.engine_args import EngineArgs
from tests.parallel.workload import ENGINE, run_workload


def main() -> int:
    process_id, port, mode, model = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    logging.basicConfig(
        level=logging.INFO, format=f"[p{process_id}] %(name)s: %(message)s", force=True
    )
    args = EngineArgs(
        **ENGINE, model=model, tensor_parallel_size=3, coordinator_address=f"127.0.0.1:{port}",
        num_processes=3, process_id=process_id,
    )  # fmt: skip
    if process_id > 0:
        from jserve.engine.follower import run_follower

        return run_follower(args)
    from jserve.engine.llm_engine import LLMEngine
    from jserve.runtime.compilation import forbid_compilation

    engine = LLMEngine(args)
    print("READY", flush=True)
    if mode == "die":
        sys.stdin.readline()
        try:
            run_workload(engine)
        except Exception as e:
            print("ERROR " + json.dumps(f"{type(e).__name__}: {e}"), flush=True)
            return 1
        return 0
    with forbid_compilation():
        report = run_workload(engine)
    channel = engine.runner.channel
    report["steps_sent"] = channel.steps_sent
    report["step_send_seconds"] = channel.step_send_seconds
    report["pool_shard_bytes"] = [
        s.data.nbytes for s in engine.runner.kv_cache[0].addressable_shards
    ]
    report["pool_bytes"] = engine.runner.kv_cache[0].nbytes
    print("REPORT" + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
