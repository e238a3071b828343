"""jserve against vLLM on the same CPU, workloads and protocol, in one invocation.

    python -m bench.peer_compare --vllm-python $PEER/vllm-venv/bin/python \\
        --vllm-model $PEER/smollm2-hf              # offline: three workloads
    python -m bench.peer_compare ... --rounds 3    # offline three times, engines alternating
    python -m bench.peer_compare ... --mode online # both servers (or: both)
    python -m bench.peer_compare --smoke           # jserve only, seconds (CI)

Offline (bench.peer_driver runs each engine in its own interpreter, jserve first, then vLLM;
with --rounds N the A/B driver (bench.ab_driver) runs that pair N times and a last table gives
each round's ratio and their min, median and max, since a single round moves with the
machine's state). The workloads are bench.workloads' `peer_workloads`:
- random: 64 requests, prompts 16-512 and outputs 8-256 tokens (uniform, seeded);
- shared-prefix: 32 requests of one 384-token prefix plus 32 own tokens, 64 output tokens each;
- batch-1: one 32-token prompt, 128 output tokens (reported as ms per output token).
Prompts are token ids drawn from the vocabulary (past the control tokens), identical for both
engines; greedy, EOS ignored, so both generate exactly the same number of tokens, and the first
16 greedy ids of every request are compared. A ratio is printed only when both runs were quiet
(bench.quiet: load before at most --max-load, other processes under 10% of a core while it
ran); otherwise the row says why not.

Online (--mode online or both): each engine as a server, one after the other, driven by
bench.serve with the same synthetic workload, all requests at once and at a Poisson
--request-rate.

vLLM is never a dependency: it runs from its own virtualenv, made as bench/peer_vllm.md says
($PEER is the folder it was made in).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.ab_driver import alternate, ratio_stats
from bench.report_writer import RESULTS_DIR, markdown_table, write_json
from bench.server_process import ServerProcess, jserve_command
from bench.workloads import PEER_ONLINE, SMOKE_ENGINE, peer_workloads

ROOT = Path(__file__).resolve().parents[1]  # where `python -m bench.X` finds the package
VLLM_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "OMP_NUM_THREADS": "2",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}
MAX_OTHER_SHARE = 0.10


def run_driver(
    engine: str,
    python: str,
    model: str | None,
    paths: list[Path],
    args,
    suffix: str = "",
    extra: tuple[str, ...] = (),
) -> dict:
    """One bench.peer_driver run of `engine` under `python` (`extra`: more of its flags)."""
    out = args.out / f"peer_{engine}{suffix}.json"
    cmd = [python, "-m", "bench.peer_driver", "--engine", engine, "--out", str(out),
           "--workloads", *map(str, paths), "--max-num-seqs", str(args.max_num_seqs),
           "--max-load", str(args.max_load), *extra]  # fmt: skip
    if model:
        cmd += ["--model", model]
    if args.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    env = {**os.environ, **(VLLM_ENV if engine == "vllm" else {})}
    print(f"running {engine}: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True, env=env, stdin=subprocess.DEVNULL, cwd=ROOT)
    return json.loads(out.read_text())


def quiet_problem(run: dict, max_load: float) -> str | None:
    q = run["quietness"]
    if q["load_before"] > max_load:
        return f"load {q['load_before']:.2f} before"
    if q["others_cpu_s"] > MAX_OTHER_SHARE * q["wall_s"]:
        return f"others used {q['others_cpu_s']:.1f} CPU s"
    return None


def offline_table(results: dict[str, dict], max_load: float) -> tuple[str, list[dict]]:
    engines = list(results)
    header = ["workload", *(f"{e} {what}" for e in engines
                            for what in ("wall s (CPU s)", "out tok/s")),
              "jserve / vLLM", "first 16 ids equal", "load before / after"]  # fmt: skip
    cells, rows = [], []
    for i, run in enumerate(results[engines[0]]["runs"]):
        runs = {e: results[e]["runs"][i] for e in engines}
        row = {"workload": run["workload"]}
        line = [run["workload"]]
        for e, r in runs.items():
            rate = r["output_tokens"] / r["wall_s"]
            row[e] = {"wall_s": r["wall_s"], "cpu_s": r["cpu_s"], "output_tok_s": rate}
            if run["workload"] == "batch-1":
                row[e]["ms_per_output_token"] = 1000 * r["wall_s"] / r["output_tokens"]
            line += [f"{r['wall_s']:.2f} ({r['cpu_s']:.1f})", f"{rate:.1f}"]
        problems = [f"{e}: {p}" for e, r in runs.items() if (p := quiet_problem(r, max_load))]
        if len(engines) < 2:
            ratio = "no peer"
        elif problems:
            ratio = "not reported (" + "; ".join(problems) + ")"
        else:
            row["ratio"] = runs["vllm"]["wall_s"] / runs["jserve"]["wall_s"]
            ratio = f"**{row['ratio']:.2f}x**"
        agree = "-"
        if len(engines) > 1:
            a, b = (runs[e]["first_ids"] for e in engines)
            row["first_ids_equal"] = same = sum(x == y for x, y in zip(a, b, strict=True))
            agree = f"{same}/{len(a)}"
        loads = "; ".join(
            f"{r['quietness']['load_before']:.2f} / {r['quietness']['load_after']:.2f}"
            for r in runs.values()
        )
        cells.append([*line, ratio, agree, loads])
        rows.append(row)
    return markdown_table(header, cells), rows


def rounds_table(rows: list[dict]) -> str:
    """Per workload: each round's ratio (engines alternated round by round) and their median,
    min and max (quiet rounds only)."""
    header = ["workload", "jserve / vLLM by round", "median", "min / max", "jserve wall s",
              "vLLM wall s"]  # fmt: skip
    cells = []
    for workload in dict.fromkeys(row["workload"] for row in rows):
        mine = [row for row in rows if row["workload"] == workload]
        stats = ratio_stats([row.get("ratio") for row in mine])
        kept = [r for r in stats["ratios"] if r is not None]
        median, spread = "-", "-"
        if kept:
            median = f"**{stats['median']:.2f}x** ({stats['n']} of {stats['of']})"
            spread = f"{stats['min']:.2f} / {stats['max']:.2f}"

        def walls(engine: str, mine: list[dict] = mine) -> str:
            return ", ".join(f"{row[engine]['wall_s']:.2f}" for row in mine if engine in row)

        ratios = ", ".join(f"{r:.2f}" for r in kept)
        cells.append([workload, ratios, median, spread, walls("jserve"), walls("vllm")])
    return markdown_table(header, cells)


def run_online(args) -> dict:
    """Both servers in turn under bench.serve: all at once, then at a Poisson rate."""
    servers = {"jserve": jserve_command(["--max-num-seqs", "32", "--served-model-name", "m"])}
    if args.vllm_python:
        servers["vllm"] = [
            args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
            args.vllm_model, "--dtype", "float32", "--host", "127.0.0.1", "--port",
            str(args.vllm_port), "--served-model-name", "m", "--max-model-len", "2048",
            "--max-num-seqs", "32", "--max-num-batched-tokens", "512",
        ]  # fmt: skip
    reports = {}
    for engine, command in servers.items():
        base_url = f"http://127.0.0.1:{args.vllm_port}" if engine == "vllm" else None
        env = {**os.environ, **VLLM_ENV} if engine == "vllm" else None
        log = args.out / "logs" / f"peer_online_{engine}.log"
        with ServerProcess(command, log, base_url=base_url, env=env) as server:
            for mode, rate in (("all-at-once", "inf"), ("poisson", str(args.request_rate))):
                name = f"peer_online_{engine}_{mode}"
                cmd = [sys.executable, "-m", "bench.serve", "--base-url", server.base_url,
                       *PEER_ONLINE, "--request-rate", rate, "--no-progress",
                       "--server-pid", str(server.process.pid), "--out", str(args.out),
                       "--name", name]  # fmt: skip
                subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL, cwd=ROOT)
                reports[name] = json.loads((args.out / f"{name}.json").read_text())
    return reports


def online_table(reports: dict) -> str:
    header = ["run", "req/s", "out tok/s", "TTFT p50 / p99 ms", "TPOT p50 / p99 ms",
              "load before / after"]  # fmt: skip
    cells = []
    for name, report in reports.items():
        s, load = report["summary"], report["loadavg_1min"]
        cells.append([
            name.removeprefix("peer_online_"), f"{s['request_throughput']:.2f}",
            f"{s['output_throughput']:.1f}",
            f"{s['ttft_ms']['p50']:.0f} / {s['ttft_ms']['p99']:.0f}",
            f"{s['tpot_ms']['p50']:.0f} / {s['tpot_ms']['p99']:.0f}",
            f"{load['before']:.2f} / {load['after']:.2f}",
        ])  # fmt: skip
    return markdown_table(header, cells)


# The smoke's jserve engine takes bench.workloads' SMOKE_ENGINE: these flags and the sizes that
# parse_args sets (the drivers' own flags, which a peer takes too).
SMOKE_FLAGS = ("--max-model-len", str(SMOKE_ENGINE["max_model_len"]),
               "--num-kv-blocks", str(SMOKE_ENGINE["num_kv_blocks"]))  # fmt: skip


def run_offline(args, report: dict) -> None:
    """The offline rounds, jserve then its peer in each (bench.ab_driver), tables as they end."""
    paths = [
        write_json(args.out / f"peer_workload_{workload['name']}.json", workload)
        for workload in peer_workloads(args.smoke)
    ]
    report["offline"], report["engines"] = [], {}
    shown: list[int] = []  # the rounds whose table is printed

    def side(engine: str, python: str | None, model: str | None):
        def run() -> dict | None:
            if python is None:
                return None  # no peer (smoke): jserve runs alone
            suffix = f"_round{len(shown) + 1}" if args.rounds > 1 else ""
            extra = SMOKE_FLAGS if args.smoke else ()
            return run_driver(engine, python, model, paths, args, suffix, extra)

        return run

    def show_round(index: int, jserve: dict, vllm: dict | None) -> None:
        shown.append(index)
        results = {"jserve": jserve, **({"vllm": vllm} if vllm else {})}
        table, rows = offline_table(results, args.max_load)
        report["offline"] += [{"round": index + 1, **row} for row in rows]
        report["engines"] = {
            e: {k: v for k, v in r.items() if k != "runs"} for e, r in results.items()
        }
        title = f", round {index + 1} of {args.rounds}" if args.rounds > 1 else ""
        print(f"\n## Offline{title}\n\n" + table, flush=True)

    rounds = alternate(side("jserve", sys.executable, None),
                       side("vllm", args.vllm_python, args.vllm_model), args.rounds,
                       after_pair=show_round)  # fmt: skip
    report["loadavg_1min"] = rounds.loadavg_1min
    if args.rounds > 1:
        print("\n## Offline, all rounds\n\n" + rounds_table(report["offline"]))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vllm-python", default=None, help="python of the vLLM virtualenv")
    parser.add_argument("--vllm-model", default=None, help="HF directory vLLM loads")
    parser.add_argument("--smoke", action="store_true", help="jserve only, tiny workloads")
    parser.add_argument(
        "--mode", choices=["offline", "online", "both"], default="offline",
        help="offline engines, servers under bench.serve, or both (default: offline)",
    )  # fmt: skip
    parser.add_argument("--request-rate", type=float, default=1.5, help="online Poisson req/s")
    parser.add_argument("--vllm-port", type=int, default=8200)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="default: each engine's own")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1,
                        help="offline: run both engines this many times, alternating, and "
                        "report each round's ratio and their median")  # fmt: skip
    parser.add_argument("--max-load", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="default: %(default)s")
    args = parser.parse_args(argv)
    if not args.smoke and not (args.vllm_python and args.vllm_model):
        parser.error("give --vllm-python and --vllm-model (see bench/peer_vllm.md), or --smoke")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.smoke:  # small buckets compile in seconds; no peer, so no quietness to judge
        args.vllm_python, args.mode = None, "offline"
        args.max_num_seqs = SMOKE_ENGINE["max_num_seqs"]
        args.max_num_batched_tokens = SMOKE_ENGINE["max_num_batched_tokens"]
        args.max_load = float("inf")
    args.out = args.out.resolve()  # the drivers run from the repository root
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report: dict = {}
    if args.mode in ("offline", "both"):
        run_offline(args, report)
    if args.mode in ("online", "both"):
        online = run_online(args)
        report["online"] = {name: r["summary"] for name, r in online.items()}
        print("\n## Online\n\n" + online_table(online))
    path = write_json(args.out / "peer.json", report)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
