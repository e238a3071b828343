"""Each engine step of a peer workload against its roofline: how far from its floor a step runs.

A step's floor is max(FLOPs / peak, bytes / bandwidth), counted from what the step really
computes (its bucket's padding is not work):
- FLOPs: every real token through the layers' projections (2 x their weight elements), one
  lm_head row per sequence, and 4 x heads x head_dim per layer for every (query token, cached
  position) pair its causal attention scores (QK and PV);
- bytes: the float32 weights once per step (layers and lm_head) and every cached position of
  every sequence of the step once (K and V of all layers).
Steps are grouped by kind and token bucket; the table gives their wall time, their floor, the
floor's share of the wall time and the FLOP rate reached. Peak and bandwidth are the machine's:
measure them and pass them. For the peak, an FMA loop on every core gives the cores' bound and
the best GEMM rate at the model's shapes the bound a real kernel has; for the bandwidth, a large
sum or copy.

    python -m bench.roofline --workload shared-prefix --peak-gflops 230 --bandwidth-gbs 30
    python -m bench.roofline --workload random --max-num-seqs 64
    python -m bench.roofline --smoke --json /tmp/roofline.json     # tiny, for CI

The workloads are bench.peer_compare's (bench.workloads' `peer_workloads`: random,
shared-prefix, batch-1), run with the peer's settings (64 sequences, 2,048-token context),
every request queued at once; a step observer (bench.bucket_costs' StepLog) records each step.
"""

from __future__ import annotations

import argparse
import os
from collections import defaultdict

from bench.bucket_costs import logged_steps
from bench.report_writer import markdown_table, write_json
from bench.workloads import Workload, add_requests, greedy, peer_workloads
from jserve.config.engine_args import add_engine_arguments, engine_args_from_namespace
from jserve.engine.llm_engine import LLMEngine
from jserve.models.config import ModelConfig

FLOAT32_BYTES = 4


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(K, N) of each layer projection as the model fuses them (Q/K/V and gate/up fused)."""
    h, q = config.hidden_size, config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    i = config.intermediate_size
    return {"wqkv": (h, q + 2 * kv), "wo": (q, h), "w_gate_up": (h, 2 * i), "w_down": (i, h)}


def projection_flops_per_token(config: ModelConfig) -> int:
    """2 x the weight elements of the layers' Q/K/V, output, gate/up and down projections."""
    per_layer = sum(k * n for k, n in projection_shapes(config).values())
    return 2 * config.num_layers * per_layer


def step_cost(config: ModelConfig, step: dict) -> tuple[int, int]:
    """(FLOPs, bytes) of one StepLog step, as the module docstring counts them."""
    projections = projection_flops_per_token(config)
    head = 2 * config.hidden_size * config.vocab_size
    attention = 4 * config.num_layers * config.num_heads * config.head_dim
    flops = step["tokens"] * projections + step["seqs"] * head + step["attended"] * attention
    weights = FLOAT32_BYTES * (projections + head) // 2
    kv = 2 * FLOAT32_BYTES * config.num_layers * config.num_kv_heads * config.head_dim
    return flops, weights + step["context"] * kv


def step_group(step: dict) -> str:
    return f"{step['kind']} T={step['T']}"


def roofline_table(config: ModelConfig, steps: list[dict], peak: float, bandwidth: float) -> list:
    """Per group of steps: count, wall s, floor s, floor / wall, GFLOP/s reached, and how many
    of its steps are compute-bound at this peak and bandwidth; slowest group first."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for step in steps:
        groups[step_group(step)].append(step)
    rows = []
    for name, members in groups.items():
        costs = [step_cost(config, s) for s in members]
        wall = sum(s["wall_s"] for s in members)
        floor = sum(max(f / peak, b / bandwidth) for f, b in costs)
        rows.append(
            {
                "steps": name,
                "n": len(members),
                "wall_s": wall,
                "floor_s": floor,
                "of_floor": floor / wall,
                "gflops": sum(f for f, _ in costs) / wall / 1e9,
                "compute_bound": sum(f / peak >= b / bandwidth for f, b in costs),
            }
        )
    return sorted(rows, key=lambda r: -r["wall_s"])


def markdown(report: dict) -> str:
    header = ["steps", "n", "wall s", "floor s", "floor / wall", "GFLOP/s", "compute-bound"]
    rows = [
        [r["steps"], str(r["n"]), f"{r['wall_s']:.2f}", f"{r['floor_s']:.2f}",
         f"{100 * r['of_floor']:.0f}%", f"{r['gflops']:.0f}", str(r["compute_bound"])]
        for r in report["groups"]
    ]  # fmt: skip
    lines = [markdown_table(header, rows, align="lrrrrrr")]
    t = report["total"]
    lines += [
        "",
        f"{report['workload']}: {t['steps']} steps, {t['wall_s']:.2f} s of engine steps against "
        f"a floor of {t['floor_s']:.2f} s ({100 * t['floor_s'] / t['wall_s']:.0f}%) at "
        f"{report['peak_gflops']:g} GFLOP/s and {report['bandwidth_gbs']:g} GB/s; 1-minute load "
        f"{report['loadavg_1min']['before']:.2f} before, {report['loadavg_1min']['after']:.2f} "
        "after.",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_arguments(parser)
    parser.add_argument("--workload", choices=("random", "shared-prefix", "batch-1"),
                        default="shared-prefix")  # fmt: skip
    parser.add_argument("--peak-gflops", type=float, default=230.0, help="compute peak")
    parser.add_argument("--bandwidth-gbs", type=float, default=30.0, help="memory bandwidth")
    parser.add_argument("--smoke", action="store_true", help="the peer's smoke workloads")
    parser.add_argument("--json", help="also write the report here")
    parser.set_defaults(max_num_seqs=64, max_model_len=2048)
    if parser.parse_known_args(argv)[0].smoke:  # small buckets compile in seconds
        parser.set_defaults(max_num_seqs=8, max_num_batched_tokens=64)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    (workload,) = [w for w in peer_workloads(args.smoke) if w["name"] == args.workload]
    engine = LLMEngine(engine_args_from_namespace(args))
    warmup = {"prompt_token_ids": workload["requests"][0]["prompt_token_ids"][:8]}
    engine.add_request("warm-up", warmup, greedy(2))
    while engine.has_unfinished_requests():
        engine.step()
    load_before = os.getloadavg()[0]
    requests = workload["requests"]
    prompts = [r["prompt_token_ids"] for r in requests]
    add_requests(engine, Workload(prompts, [r["max_tokens"] for r in requests]))  # all at once
    steps = logged_steps(engine)
    load_after = os.getloadavg()[0]
    peak, bandwidth = args.peak_gflops * 1e9, args.bandwidth_gbs * 1e9
    groups = roofline_table(engine.model_config, steps, peak, bandwidth)
    report = {
        "workload": args.workload,
        "peak_gflops": args.peak_gflops,
        "bandwidth_gbs": args.bandwidth_gbs,
        "loadavg_1min": {"before": load_before, "after": load_after},
        "total": {
            "steps": len(steps),
            "wall_s": sum(s["wall_s"] for s in steps),
            "floor_s": sum(g["floor_s"] for g in groups),
        },
        "groups": groups,
        "steps": steps,
    }
    print(markdown(report))
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
