"""The simulator against real serving runs: the same requests, predicted vs measured.

Each real-engine run of a serving-benchmark JSON (`python -m bench.serve --out`, or
`python -m bench.serve_compare`) is replayed with its own arrivals, prompt and output lengths,
through the scheduler configured as that run's `jserve serve` command line was, priced by the
measured cost model; the table puts the measured and the simulated figures side by side.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from jserve.config.engine_args import add_engine_arguments, engine_args_from_namespace
from jserve.config.scheduler import SchedulerConfig
from jserve.core.buckets import engine_buckets
from jserve.simulate.costs import MeasuredCost
from jserve.simulate.metrics import summarize
from jserve.simulate.report import fmt, text_table
from jserve.simulate.simulator import simulate
from jserve.simulate.workload import SimRequest

# SmolLM2-135M's KV cache in float32 (the CPU default): 30 layers, 3 KV heads of 64, K and V.
SMOLLM2_KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 4


def served_config(command: str) -> tuple[SchedulerConfig, int, int]:
    """(scheduler config, KV blocks, block size) of a `jserve serve` command line, through the
    engine's own flags (so defaults cannot drift; the server's own flags are left aside)."""
    words = shlex.split(command)
    if "serve" not in words:
        raise ValueError(f"not a `jserve serve` command line: {command!r}")
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(parser)
    ns, _ = parser.parse_known_args(words[words.index("serve") + 1 :])
    engine = engine_args_from_namespace(ns)
    blocks = engine.num_kv_blocks or engine.kv_cache_memory // (
        SMOLLM2_KV_BYTES_PER_TOKEN * engine.block_size
    )
    return engine.scheduler_config(engine.max_model_len or 2048), blocks, engine.block_size


def _replay(run: dict, report_path: str) -> tuple[dict, dict]:
    """(measured summary, simulated summary) of one real run."""
    config, blocks, block_size = served_config(run["command"])
    workload = [
        SimRequest(r["start"], r["prompt_tokens"], r["expected_output_tokens"])
        for r in run["requests"]
    ]
    token_buckets, seq_buckets = engine_buckets(  # as the CPU engine that ran it
        config.max_num_batched_tokens, config.max_num_seqs, decode_midpoints=True
    )
    model = MeasuredCost.from_report(report_path, token_buckets, seq_buckets)
    result = simulate(workload, config, blocks, model, model.fresh_table(), None, block_size)
    predicted = summarize(result.records, result.duration)
    # Steps, and the run's duration over them: the server's step count (the serving
    # benchmark reads it from /metrics) for the measured run, the simulated steps here.
    predicted["engine_steps"] = result.steps
    predicted["wall_ms_per_step"] = 1000.0 * result.duration / max(result.steps, 1)
    return run["summary"], predicted


def compare_serve(path: str, report_path: str) -> str:
    """Predicted (measured-table cost model) vs measured, for each real-engine run in a
    serving-benchmark JSON: the same arrivals, prompt and output lengths."""
    data = json.loads(Path(path).read_text())
    runs = data.get("reports", {"run": data})
    rows = [["run", "", "req/s", "out tok/s", "TTFT p50 ms", "TPOT p50 ms", "steps",
             "ms/step"]]  # fmt: skip
    for name, run in runs.items():
        if "--mock" in run.get("command", ""):
            continue  # a mock server's cost is not the table's
        if "command" not in run:
            raise ValueError(f"{path}: run {name!r} does not record its server's command line")
        measured, predicted = _replay(run, report_path)
        for label, s in (("measured", measured), ("simulated", predicted)):
            rows.append([name, label, f"{s['request_throughput']:.3f}",
                         f"{s['output_throughput']:.1f}", fmt(s["ttft_ms"]["p50"]),
                         fmt(s["tpot_ms"]["p50"]), str(s.get("engine_steps", "-")),
                         fmt(s.get("wall_ms_per_step"))])  # fmt: skip
        ratio = [
            predicted["request_throughput"] / measured["request_throughput"],
            predicted["output_throughput"] / measured["output_throughput"],
            (predicted["ttft_ms"]["p50"] or 0) / (measured["ttft_ms"]["p50"] or 1),
            (predicted["tpot_ms"]["p50"] or 0) / (measured["tpot_ms"]["p50"] or 1),
            predicted["engine_steps"] / (measured.get("engine_steps") or float("nan")),
            predicted["wall_ms_per_step"] / (measured.get("wall_ms_per_step") or float("nan")),
        ]
        rows.append([name, "sim/measured", *(f"{x:.2f}" for x in ratio)])
    load = {n: r.get("loadavg_1min") for n, r in runs.items()}
    return "\n".join([f"== simulator vs measured: {path} ==", text_table(rows),
                      f"measured runs' 1-minute load (before/after): {load}"])  # fmt: skip
