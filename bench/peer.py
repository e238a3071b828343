"""jserve against vLLM on the same CPU, workloads and protocol, in one invocation.

    python bench/peer.py --vllm-python $PEER/vllm-venv/bin/python \\
        --vllm-model $PEER/smollm2-hf              # offline: three workloads
    python bench/peer.py ... --rounds 3            # offline three times, engines alternating
    python bench/peer.py ... --mode online         # both servers (or: both)
    python bench/peer.py --smoke                   # jserve only, seconds (CI)

Offline (bench/peer_driver.py runs each engine in its own interpreter, jserve first, then vLLM;
with --rounds N that pair runs N times and a last table gives each round's ratio and their
median, since a single round moves with the machine's state):
- random: 64 requests, prompts 16-512 and outputs 8-256 tokens (uniform, seeded);
- shared-prefix: 32 requests of one 384-token prefix plus 32 own tokens, 64 output tokens each;
- batch-1: one 32-token prompt, 128 output tokens (reported as ms per output token).
Prompts are token ids drawn from the vocabulary (past the control tokens), identical for both
engines; greedy, EOS ignored, so both generate exactly the same number of tokens, and the first
16 greedy ids of every request are compared. A ratio is printed only when both runs were quiet
(bench/quiet.py: load before at most --max-load, other processes under 10% of a core while it
ran); otherwise the row says why not.

Online (--mode online or both): each engine as a server, one after the other, driven by
bench/serve.py with the same synthetic workload, all requests at once and at a Poisson
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

import numpy as np
from server_process import ServerProcess, jserve_command

HERE = Path(__file__).resolve().parent
VOCAB_SIZE = 49_152  # SmolLM2's; ids below FIRST_TEXT_ID are control tokens
FIRST_TEXT_ID = 17
VLLM_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "OMP_NUM_THREADS": "2",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}
MAX_OTHER_SHARE = 0.10
ONLINE_WORKLOAD = [
    "--num-requests", "64", "--prompt-len", "lognormal:128:0.8:1024",
    "--output-len", "lognormal:64:1.0:512", "--seed", "0",
]  # fmt: skip


def _ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(FIRST_TEXT_ID, VOCAB_SIZE, n).tolist()


def make_workloads(smoke: bool, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    scale = 8 if smoke else 1
    random_requests = [
        {"prompt_token_ids": _ids(rng, int(p)), "max_tokens": int(o)}
        for p, o in zip(
            rng.integers(16, 513, 64 // scale) // scale,
            rng.integers(8, 257, 64 // scale) // scale,
            strict=True,
        )
    ]
    prefix = _ids(rng, 384 // scale)
    shared = [
        {"prompt_token_ids": prefix + _ids(rng, 32 // scale), "max_tokens": 64 // scale}
        for _ in range(32 // scale)
    ]
    single = [{"prompt_token_ids": _ids(rng, 32), "max_tokens": 128 // scale}]
    return [
        {"name": "random", "requests": random_requests},
        {"name": "shared-prefix", "requests": shared},
        {"name": "batch-1", "requests": single},
    ]


def run_driver(
    engine: str, python: str, model: str | None, paths: list[Path], args, suffix: str = ""
) -> dict:
    out = args.out / f"peer_{engine}{suffix}.json"
    cmd = [python, str(HERE / "peer_driver.py"), "--engine", engine, "--out", str(out),
           "--workloads", *map(str, paths), "--max-num-seqs", str(args.max_num_seqs),
           "--max-load", str(args.max_load)]  # fmt: skip
    if model:
        cmd += ["--model", model]
    if args.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    env = {**os.environ, **(VLLM_ENV if engine == "vllm" else {})}
    print(f"running {engine}: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True, env=env, stdin=subprocess.DEVNULL)
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
    lines = [
        "| workload | " + " | ".join(f"{e} wall s (CPU s) | {e} out tok/s" for e in engines)
        + " | jserve / vLLM | first 16 ids equal | load before / after |",
        "|---" * (2 + 2 * len(engines) + 2) + "|",
    ]  # fmt: skip
    rows = []
    for i, run in enumerate(results[engines[0]]["runs"]):
        runs = {e: results[e]["runs"][i] for e in engines}
        row = {"workload": run["workload"]}
        cells = []
        for e, r in runs.items():
            rate = r["output_tokens"] / r["wall_s"]
            row[e] = {"wall_s": r["wall_s"], "cpu_s": r["cpu_s"], "output_tok_s": rate}
            if run["workload"] == "batch-1":
                row[e]["ms_per_output_token"] = 1000 * r["wall_s"] / r["output_tokens"]
            cells += [f"{r['wall_s']:.2f} ({r['cpu_s']:.1f})", f"{rate:.1f}"]
        problems = [f"{e}: {p}" for e, r in runs.items() if (p := quiet_problem(r, max_load))]
        if len(engines) < 2:
            ratio = "no peer"
        elif problems:
            ratio = "not reported (" + "; ".join(problems) + ")"
        else:
            row["ratio"] = runs["vllm"]["wall_s"] / runs["jserve"]["wall_s"]
            ratio = f"**{row['ratio']:.2f}x**"
        if len(engines) > 1:
            a, b = (runs[e]["first_ids"] for e in engines)
            same = sum(x == y for x, y in zip(a, b, strict=True))
            agree = f"{same}/{len(a)}"
            row["first_ids_equal"] = same
        else:
            agree = "-"
        loads = "; ".join(
            f"{r['quietness']['load_before']:.2f} / {r['quietness']['load_after']:.2f}"
            for r in runs.values()
        )
        lines.append(f"| {run['workload']} | " + " | ".join(cells) + f" | {ratio} | {agree} | "
                     f"{loads} |")  # fmt: skip
        rows.append(row)
    return "\n".join(lines), rows


def rounds_table(rows: list[dict]) -> str:
    """Per workload: each round's ratio (engines alternated round by round) and their median."""
    lines = ["| workload | jserve / vLLM by round | median | jserve wall s | vLLM wall s |",
             "|---|---|---|---|---|"]  # fmt: skip
    for workload in dict.fromkeys(row["workload"] for row in rows):
        mine = [row for row in rows if row["workload"] == workload]
        ratios = [row["ratio"] for row in mine if "ratio" in row]
        median = f"**{np.median(ratios):.2f}x** ({len(ratios)} of {len(mine)})" if ratios else "-"

        def walls(engine: str, mine: list[dict] = mine) -> str:
            return ", ".join(f"{row[engine]['wall_s']:.2f}" for row in mine if engine in row)

        lines.append(
            f"| {workload} | " + ", ".join(f"{r:.2f}" for r in ratios)
            + f" | {median} | {walls('jserve')} | {walls('vllm')} |"
        )  # fmt: skip
    return "\n".join(lines)


def run_online(args) -> dict:
    """Both servers in turn under bench/serve.py: all at once, then at a Poisson rate."""
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
        log = args.out / f"peer_online_{engine}.log"
        with ServerProcess(command, log, base_url=base_url, env=env) as server:
            for mode, rate in (("all-at-once", "inf"), ("poisson", str(args.request_rate))):
                name = f"peer_online_{engine}_{mode}"
                cmd = [sys.executable, str(HERE / "serve.py"), "--base-url", server.base_url,
                       *ONLINE_WORKLOAD, "--request-rate", rate, "--no-progress",
                       "--server-pid", str(server.process.pid), "--out", str(args.out),
                       "--name", name]  # fmt: skip
                subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL)
                reports[name] = json.loads((args.out / f"{name}.json").read_text())
    return reports


def online_table(reports: dict) -> str:
    lines = [
        "| run | req/s | out tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | load before / after |",
        "|---|---|---|---|---|---|",
    ]
    for name, report in reports.items():
        s, load = report["summary"], report["loadavg_1min"]
        lines.append(
            f"| {name.removeprefix('peer_online_')} | {s['request_throughput']:.2f} | "
            f"{s['output_throughput']:.1f} | {s['ttft_ms']['p50']:.0f} / {s['ttft_ms']['p99']:.0f}"
            f" | {s['tpot_ms']['p50']:.0f} / {s['tpot_ms']['p99']:.0f} | "
            f"{load['before']:.2f} / {load['after']:.2f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vllm-python", default=None, help="python of the vLLM virtualenv")
    parser.add_argument("--vllm-model", default=None, help="HF directory vLLM loads")
    parser.add_argument("--smoke", action="store_true", help="jserve only, tiny workloads")
    parser.add_argument(
        "--mode", choices=["offline", "online", "both"], default="offline",
        help="offline engines, servers under bench/serve.py, or both (default: offline)",
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
    parser.add_argument("--out", type=Path, default=Path("bench/out"))
    args = parser.parse_args(argv)
    if not args.smoke and not (args.vllm_python and args.vllm_model):
        parser.error("give --vllm-python and --vllm-model (see bench/peer_vllm.md), or --smoke")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.smoke:  # small buckets compile in seconds; no peer, so no quietness to judge
        args.vllm_python, args.mode = None, "offline"
        args.max_num_seqs, args.max_num_batched_tokens = 8, 64
        args.max_load = float("inf")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {}
    if args.mode in ("offline", "both"):
        paths = []
        for workload in make_workloads(args.smoke):
            path = args.out / f"peer_workload_{workload['name']}.json"
            path.write_text(json.dumps(workload))
            paths.append(path)
        report["offline"], report["engines"] = [], {}
        for i in range(args.rounds):
            suffix = f"_round{i + 1}" if args.rounds > 1 else ""
            results = {"jserve": run_driver("jserve", sys.executable, None, paths, args, suffix)}
            if args.vllm_python:
                results["vllm"] = run_driver(
                    "vllm", args.vllm_python, args.vllm_model, paths, args, suffix
                )
            table, rows = offline_table(results, args.max_load)
            report["offline"] += [{"round": i + 1, **row} for row in rows]
            report["engines"] = {
                e: {k: v for k, v in r.items() if k != "runs"} for e, r in results.items()
            }
            title = f", round {i + 1} of {args.rounds}" if args.rounds > 1 else ""
            print(f"\n## Offline{title}\n\n" + table, flush=True)
        if args.rounds > 1:
            print("\n## Offline, all rounds\n\n" + rounds_table(report["offline"]))
    if args.mode in ("online", "both"):
        online = run_online(args)
        report["online"] = {name: r["summary"] for name, r in online.items()}
        print("\n## Online\n\n" + online_table(online))
    (args.out / "peer.json").write_text(json.dumps(report, indent=1))
    print(f"\nwrote {args.out / 'peer.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
