"""`python -m bench.serve_compare router`: routing policies in front of the same jserve replicas.

1. Start the preset's replicas once, in parallel (each on a free port, each publishing its
   KV-cache events on its own ZMQ ports), and keep them for every side.
2. For each policy: start its router (smg, or vllm-router for kv_aware) through the fleet's
   own command builder (jserve.server.fleet.router_command), build the workload with this
   side's seed, run it through the router, stop the router. The prefix-cache hit rate is the
   sum over the replicas of the `jserve:prefix_cache_hits_total` / `..._queries_total` deltas.
   Each side gets its own system prompts (same lengths and tenant order, other words), so one
   side's cached blocks can never be another side's hits; stale blocks are evictable, so
   they take no room.
3. Fault phase: the preset's fault policy once more, and one replica is killed (SIGKILL)
   mid-run. Every request must end: served, or failed with an error; none may hang (a
   request still open at `--request-timeout` counts as hung).
Prints one table with the gain of each policy over the first (round_robin) and the fault
counts; writes serve_router.json under --out. On one machine the replicas share its cores:
absolute figures are per machine, the ratios are what the routing changes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import shlex
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.report_writer import fmt, text_table, write_json
from bench.serve import benchmark, first_model
from bench.serve_client import LoadConfig
from bench.serve_presets import RouterPreset
from bench.server_process import ServerProcess, jserve_command, mock_command
from bench.server_stats import scrape
from bench.workloads import preset_workload
from jserve.server.fleet import router_command

HIT, QUERY = "jserve:prefix_cache_hits_total", "jserve:prefix_cache_queries_total"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_commands(preset: RouterPreset, args: argparse.Namespace) -> tuple[list, list]:
    """Each replica's command line and its (PUB, replay) KV-event endpoints."""
    commands, endpoints = [], []
    extra = shlex.split(args.server_args)
    for _ in range(preset.replicas):
        if args.smoke:  # the mock has no prefix cache and publishes no events
            commands.append(mock_command([*preset.mock_args, *extra]))
            continue
        pub, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
        endpoints.append((pub, replay))
        commands.append(jserve_command([*preset.server_args, *extra, "--kv-events-endpoint", pub,
                                        "--kv-events-replay-endpoint", replay]))  # fmt: skip
    return commands, endpoints


def start_replicas(commands: list, out: Path, timeout: float, stack: contextlib.ExitStack):
    """Start every replica at once (loading is the slow part) and stop them on exit."""
    servers = [ServerProcess(c, out / "logs" / f"router_replica{i}.log", start_timeout=timeout)
               for i, c in enumerate(commands)]  # fmt: skip
    with ThreadPoolExecutor(len(servers)) as pool:
        futures = [pool.submit(s.__enter__) for s in servers]
    for server in servers:
        stack.callback(server.stop)
    for future in futures:
        future.result()  # raises the first start failure, after every replica was registered
    return servers


async def hit_counts(urls: list[str]) -> tuple[float, float]:
    scraped = await asyncio.gather(*(scrape(u) for u in urls))
    return sum(s.get(HIT, 0.0) for s in scraped), sum(s.get(QUERY, 0.0) for s in scraped)


def run_policy(
    preset: RouterPreset, policy: str, replicas: list[ServerProcess], endpoints: list,
    args: argparse.Namespace, seed: int, out: Path, kill_after_s: float | None = None,
) -> dict:  # fmt: skip
    """One side: start the router, run the workload (killing a replica if asked), stop it."""
    router = "vllm-router" if policy == "kv_aware" else "smg"
    port = free_port()
    model = asyncio.run(first_model(replicas[0].base_url))
    command = router_command(
        router, policy, [r.base_url for r in replicas], host="127.0.0.1", port=port,
        metrics_port=free_port(), kv_event_endpoints=endpoints if router != "smg" else None,
        model=model, block_size=preset.block_size,
    )  # fmt: skip
    label = policy if kill_after_s is None else f"{policy}-fault"
    print(f"\n### {preset.name} / {label}: {router} policy {policy}", flush=True)
    log_path = out / "logs" / f"router_{label}.log"
    # Nothing is in flight when the workload has ended, and smg keeps its listener open for 5 s
    # after SIGTERM (a settle window for load balancers, not a flag): stop it after 1 s.
    url = f"http://127.0.0.1:{port}"
    with ServerProcess(command, log_path, base_url=url, stop_timeout=1.0) as proxy:
        specs = asyncio.run(
            preset_workload(preset.build, replicas[0].base_url, seed, args.seed, args.smoke)
        )
        if kill_after_s is not None and not args.smoke:  # longer answers: streams to cut
            specs = [dataclasses.replace(s, max_tokens=preset.fault_output_len)
                     for s in specs[: preset.fault_requests]]  # fmt: skip
        config = LoadConfig(
            base_url=proxy.base_url, model=model, max_concurrency=preset.max_concurrency,
            request_timeout=args.request_timeout, max_duration=args.max_duration, seed=seed,
        )  # fmt: skip
        urls = [r.base_url for r in replicas]
        killer = None
        if kill_after_s is not None:
            victim = replicas[-1]
            killer = threading.Timer(kill_after_s, os.kill, (victim.process.pid, signal.SIGKILL))
            killer.start()
        counted = urls[:-1] if killer else urls  # a killed replica's counters are gone
        hits0, queries0 = asyncio.run(hit_counts(counted))
        report, _, _ = asyncio.run(benchmark(config, specs, show_progress=args.progress))
        hits1, queries1 = asyncio.run(hit_counts(counted))
        if killer:
            killer.join()
    queries = queries1 - queries0
    report["prefix_cache_hit_rate"] = (hits1 - hits0) / queries if queries > 0 else None
    report["router_command"] = " ".join(command)
    return report


# Seconds the routers need to take a dead replica out: two failed probes 2 s apart, and slack.
DETECTION_S = 6.0


def fault_counts(report: dict, kill_after_s: float) -> dict:
    """sent / served / failed / hung, and how many failed although they were sent after the
    router should have taken the dead replica out (must be 0)."""
    rows = report["requests"]
    hung = sum(1 for r in rows if not r["success"] and "Timeout" in r["error"])
    served = sum(1 for r in rows if r["success"])
    late = sum(1 for r in rows if not r["success"] and r["start"] > kill_after_s + DETECTION_S)
    return {"sent": len(rows), "served": served, "failed": len(rows) - served - hung,
            "hung": hung, "failed_after_detection": late}  # fmt: skip


_ROWS = [  # (label, value of a report, higher is better)
    ("prefix-cache hit rate", lambda r: r["prefix_cache_hit_rate"], True),
    ("TTFT p50 (ms)", lambda r: r["summary"]["ttft_ms"]["p50"], False),
    ("TTFT p99 (ms)", lambda r: r["summary"]["ttft_ms"]["p99"], False),
    ("output tokens/s", lambda r: r["summary"]["output_throughput"], True),
    ("requests/s", lambda r: r["summary"]["request_throughput"], True),
    ("E2E p50 (ms)", lambda r: r["summary"]["e2e_ms"]["p50"], False),
]


def table(policies: list[str], reports: dict[str, dict]) -> tuple[str, dict]:
    base = reports[policies[0]]
    rows, gains = [["metric", *policies]], {}
    for label, value, higher in _ROWS:
        cells = [value(reports[p]) for p in policies]
        rows.append([label, *(fmt(v, ".3f") for v in cells)])
        b = value(base)
        row_gains = {}
        for p, v in zip(policies[1:], cells[1:], strict=True):
            ok = v is not None and b is not None and min(v, b) > 0
            row_gains[p] = (v / b if higher else b / v) if ok else None
        gains[label] = row_gains
        rows.append([f"  gain over {policies[0]}", "",
                     *("-" if g is None else f"{g:.2f}x" for g in row_gains.values())])  # fmt: skip
    return text_table(rows, align="l" + "r" * len(policies), rule=True), gains


def verdicts(preset: RouterPreset, reports: dict[str, dict]) -> list[dict]:
    """Each goal of the preset, with the measured gain and whether it was met."""
    rows = {label: (value, higher) for label, value, higher in _ROWS}
    results = []
    for policy, label, reference, least in preset.goals:
        value, higher = rows[label]
        a, b = value(reports[reference]), value(reports[policy])
        ok = a is not None and b is not None and min(a, b) > 0
        g = (b / a if higher else a / b) if ok else None
        verdict = "n/a" if g is None else ("met" if g >= least else "NOT met")
        results.append({"policy": policy, "metric": label, "over": reference, "gain": g,
                        "goal": least, "verdict": verdict})  # fmt: skip
    return results


def run_router_preset(preset: RouterPreset, args: argparse.Namespace, out: Path) -> dict:
    commands, endpoints = replica_commands(preset, args)
    with contextlib.ExitStack() as stack:
        t0 = time.monotonic()
        replicas = start_replicas(commands, out, args.start_timeout, stack)
        print(f"{len(replicas)} replicas ready in {time.monotonic() - t0:.1f} s: "
              f"{', '.join(r.base_url for r in replicas)}", flush=True)  # fmt: skip
        reports = {
            policy: run_policy(preset, policy, replicas, endpoints, args, args.seed + i, out)
            for i, policy in enumerate(preset.policies)
        }
        kill_after = preset.kill_after_s_smoke if args.smoke else preset.kill_after_s
        fault = run_policy(preset, preset.fault_policy, replicas, endpoints, args,
                           args.seed + len(preset.policies), out,
                           kill_after_s=kill_after)  # fmt: skip
    printed, gains = table(list(preset.policies), reports)
    counts = fault_counts(fault, kill_after)
    print(f"\n==== {preset.name}: {preset.description}")
    print(printed)
    goals = verdicts(preset, reports)
    for v in goals:
        g = "-" if v["gain"] is None else f"{v['gain']:.2f}x"
        print(f"goal: {v['policy']} {v['metric']} over {v['over']}: {g} "
              f"(goal >= {v['goal']}x: {v['verdict']})")  # fmt: skip
    print(f"fault ({preset.fault_policy}, one replica SIGKILLed after {kill_after} s): "
          + ", ".join(f"{k} {v}" for k, v in counts.items()))  # fmt: skip
    if args.smoke:
        print("[smoke: mock replicas have no prefix cache; the ratios test the plumbing only]")
    result = {"preset": preset.name, "description": preset.description, "smoke": args.smoke,
              "policies": list(preset.policies), "gains": gains, "goals": goals,
              "fault": counts,
              "reports": reports, "fault_report": fault}  # fmt: skip
    write_json(out / f"serve_{preset.name}.json", result)
    return result
