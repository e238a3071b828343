"""Serving a GGUF's packed quantized blocks against the same file dequantized to float32, and
against llama.cpp on the same file, offline, on the same CPU, workloads and protocol.

    python -m bench.quant_compare --llamacpp-python /tmp/llamacpp/bin/python
    python -m bench.quant_compare --llamacpp-python ... --rounds 3  # sides alternate per round
    python -m bench.quant_compare --smoke                          # jserve only, seconds (CI)
    python -m bench.quant_compare --kv-cache-dtype int8            # + packed with an int8 pool
    python -m bench.quant_compare --model HF_DIR --quantization int8  # int8 vs float32

Three sides, each in its own interpreter through bench.peer_driver: jserve with
`--quantization auto` (the packed blocks), jserve with `--quantization none` (float32), and
llama.cpp through llama-cpp-python on 2 threads. The workloads are bench.workloads'
`quant_workloads`: batch-1 (one 32-token prompt, 128 output tokens: ms per output token) for
all three, 32-seqs (32 such requests at once: output tokens per second) for jserve's two, since
llama-cpp-python runs one request at a time. `--kv-cache-dtype int8` adds a side,
"packed-int8-kv": the packed blocks with an int8 KV pool (jserve.pallas.kv_cache), on jserve's
two workloads like the others. With `--quantization int8` the candidate is jserve with
`--quantization int8` on a float checkpoint (--model: an HF or jserve checkpoint directory),
against the same checkpoint in float32; llama.cpp has no side then. Greedy, EOS
ignored; the first 16 greedy ids are compared with the float32 side's. Each side also reports
its weights' bytes as served (jserve's parameters; llama.cpp's mapped GGUF) and its process's
resident memory. A figure taken while the machine was busy (bench.quiet: load before above
--max-load, or other processes over 10% of a core) is marked so.

llama.cpp is never a dependency: build llama-cpp-python 0.3 in a virtualenv of its own, outside
the repository, with aiohttp beside it (bench.quiet's import):
    python -m venv /tmp/llamacpp && CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF" \\
        /tmp/llamacpp/bin/pip install "llama-cpp-python==0.3.*" aiohttp
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from bench.peer_compare import quiet_problem, run_driver
from bench.report_writer import RESULTS_DIR, markdown_table, write_json
from bench.workloads import quant_workloads

SIDES = ("packed", "float32", "llama.cpp")
INT8_KV = "packed-int8-kv"  # the side --kv-cache-dtype int8 adds
# jserve's sides' flags
JSERVE_FLAGS = {
    "packed": ("--quantization", "auto"),
    "float32": ("--quantization", "none"),
    "int8": ("--quantization", "int8"),
    INT8_KV: ("--quantization", "auto", "--kv-cache-dtype", "int8"),
}
BATCH_1 = "batch-1"


def run_round(args, paths: dict[str, Path], index: int) -> dict[str, dict]:
    """One run of each side, the order rotating with the round so no side always goes first."""
    from jserve.loaders.model_source import default_model_path

    gguf = str(Path(args.model).resolve() if args.model else default_model_path())
    runs = {}
    candidate = "packed" if args.quantization == "auto" else args.quantization
    sides = (candidate, *SIDES[1:]) + ((INT8_KV,) if args.kv_cache_dtype == "int8" else ())
    order = sides[index % len(sides) :] + sides[: index % len(sides)]
    for side in order:
        suffix = f"_{side.replace('.', '')}_round{index + 1}"
        if side == "llama.cpp":
            if args.llamacpp_python:
                threads = ("--threads", str(args.llamacpp_threads))
                runs[side] = run_driver("llamacpp", args.llamacpp_python, gguf,
                                        [paths[BATCH_1]], args, suffix, threads)  # fmt: skip
            continue
        runs[side] = run_driver("jserve", sys.executable, args.model, list(paths.values()), args,
                                suffix, JSERVE_FLAGS[side])  # fmt: skip
    return runs


def round_rows(runs: dict[str, dict], index: int, max_load: float) -> list[dict]:
    rows = []
    reference = {r["workload"]: r["first_ids"] for r in runs["float32"]["runs"]}
    for side, result in runs.items():
        for run in result["runs"]:
            same = sum(a == b for a, b in zip(run["first_ids"], reference[run["workload"]],
                                              strict=True))  # fmt: skip
            rows.append({
                "round": index + 1, "side": side, "workload": run["workload"],
                "wall_s": run["wall_s"], "cpu_s": run["cpu_s"],
                "ms_per_output_token": 1000 * run["wall_s"] / run["output_tokens"],
                "output_tok_s": run["output_tokens"] / run["wall_s"],
                "first_ids_equal": f"{same}/{len(reference[run['workload']])}",
                "weight_bytes": result["weight_bytes"], "rss_bytes": result["rss_bytes"],
                "busy": quiet_problem(run, max_load),
                "load": run["quietness"]["load_before"],
            })  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    header = ["round", "side", "workload", "ms / output token", "output tok/s", "CPU s",
              "first 16 ids as float32's", "weights MB", "RSS MB", "machine"]  # fmt: skip
    cells = [[
        r["round"], r["side"], r["workload"], f"{r['ms_per_output_token']:.1f}",
        f"{r['output_tok_s']:.1f}", f"{r['cpu_s']:.1f}", r["first_ids_equal"],
        f"{r['weight_bytes'] / 1e6:.0f}", f"{r['rss_bytes'] / 1e6:.0f}",
        f"busy: {r['busy']}" if r["busy"] else f"quiet (load {r['load']:.2f})",
    ] for r in rows]  # fmt: skip
    return markdown_table(header, cells)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--llamacpp-python", default=None, help="python of llama-cpp-python")
    parser.add_argument("--llamacpp-threads", type=int, default=2,
                        help="llama.cpp's threads (its workers spin at barriers: on a busy "
                        "machine 2 threads can be far slower than 1)")  # fmt: skip
    parser.add_argument("--model", default=None,
                        help="a GGUF file (default: SmolLM2's); a checkpoint directory for "
                        "--quantization int8")  # fmt: skip
    parser.add_argument("--quantization", choices=("auto", "int8"), default="auto",
                        help="the candidate's: auto (a GGUF's packed blocks) or int8")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--kv-cache-dtype", choices=["auto", "int8"], default="auto",
                        help="int8: add the packed side with an int8 KV pool")  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="jserve only, tiny workloads")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-load", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="default: %(default)s")
    args = parser.parse_args(argv)
    args.max_num_batched_tokens = None  # jserve's own
    if args.smoke:
        args.llamacpp_python, args.max_load = None, float("inf")
    if args.quantization == "int8" and args.llamacpp_python:
        parser.error("--quantization int8 serves a float checkpoint, which llama.cpp cannot read")
    args.out = args.out.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    paths = {
        w["name"]: write_json(args.out / f"quant_workload_{w['name']}.json", w)
        for w in quant_workloads(args.smoke)
    }
    rows: list[dict] = []
    for index in range(args.rounds):
        rows += round_rows(run_round(args, paths, index), index, args.max_load)
        mine = [row for row in rows if row["round"] == index + 1]
        print(f"\n## Round {index + 1} of {args.rounds}\n\n" + table(mine), flush=True)
    report = {"rows": rows, "loadavg_1min_end": os.getloadavg()[0]}
    print(f"\nwrote {write_json(args.out / 'quant_compare.json', report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
