"""What each precompiled bucket costs, and how much of a workload's compute is padding.

For every (token bucket T, sequence bucket S) the engine precompiles:
- compile time: XLA's backend compile of the model step, cold (a fresh compilation cache
  directory unless --compilation-cache-dir is given);
- median `ModelRunner.run` time after warm-up (wall, and CPU time of this process), and real
  tokens/s, on three kinds of inputs: decode (min(S, T) sequences, one token each, at context
  C), prefill (one sequence, T tokens from position 0) and mixed (S - 1 decodes at context C
  plus one prefill chunk filling T).
Then bench.offline's workload runs through the engine, each step recorded by a step observer
(`StepLog`: bucket, real tokens, runner time): padding share = sum(T - real tokens) / sum(T),
each bucket's share of the run's time, and how much of the engine's step time the model step
itself took.

    python -m bench.bucket_costs                        # default engine settings
    python -m bench.bucket_costs --max-num-seqs 16      # any engine flag
    python -m bench.bucket_costs --smoke --out /tmp/b   # tiny, for CI
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from array import array
from collections import defaultdict
from pathlib import Path

import jax
import numpy as np
from jax import monitoring

from bench.report_writer import RESULTS_DIR, figure, markdown_table, write_json, write_text
from bench.workloads import (
    OFFLINE_WORKLOAD,
    OFFLINE_WORKLOAD_SMOKE,
    add_requests,
    make_workload,
    text_token_pool,
)
from jserve.config.engine_args import add_engine_arguments, engine_args_from_namespace
from jserve.core.block_manager import SINK_BLOCK_ID
from jserve.core.plan import ScheduledSeq, StepPlan
from jserve.engine.llm_engine import LLMEngine
from jserve.engine.step_observer import ModelStep
from jserve.loaders.model_source import load_model
from jserve.runtime.compilation import forbid_compilation
from jserve.runtime.step_inputs import StepInputBuilder, StepInputs

KINDS = ("decode", "prefill", "mixed")
SMOKE = {
    "max_num_seqs": 4,
    "max_num_batched_tokens": 16,
    "max_model_len": 128,
    "num_kv_blocks": 64,
    "context": 16,
    "warmup": 1,
    "reps": 2,
}
MODEL_STEP = "jit(_model_step)"  # the runner's jitted step, as JAX's compile events name it


class ModelStepCompiles:
    """Backend compile seconds of each model-step executable, in compile order."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs: object) -> None:
        is_backend_compile = event == "/jax/core/compile/backend_compile_duration"
        if is_backend_compile and kwargs.get("fun_name") == MODEL_STEP:
            self.seconds.append(duration)


def step_kind(num_decodes: int, num_seqs: int) -> str:
    return "decode" if num_decodes == num_seqs else "prefill" if num_decodes == 0 else "mixed"


def representative_inputs(engine: LLMEngine, kind: str, t: int, s: int, context: int):
    """Inputs of bucket (t, s) filled as `kind` (see the module docstring), and real tokens."""
    if kind == "decode":
        chunks = [(context, 1)] * min(s, t)
    elif kind == "prefill":
        chunks = [(0, t)]
    else:
        num_decodes = min(s - 1, t - 1)
        chunks = [(context, 1)] * num_decodes + [(0, t - num_decodes)]
    return chunk_inputs(engine, chunks, t, s), sum(n for _, n in chunks)


def chunk_inputs(
    engine: LLMEngine, chunks: list[tuple[int, int]], t: int, s: int, num_drafts: int = 0
) -> StepInputs:
    """Inputs of bucket (t, s) holding one sequence per (start, tokens) chunk; with
    `num_drafts`, the last chunk is a decode whose last `num_drafts` tokens are drafts (the
    step computes logits at each of them, as a verify step does)."""
    block_size = engine.args.block_size
    usable = [b for b in range(engine.scheduler.block_manager.num_blocks) if b != SINK_BLOCK_ID]
    seqs, next_block = [], 0
    for i, (start, n) in enumerate(chunks):
        num_blocks = math.ceil((start + n) / block_size)
        blocks = [usable[(next_block + j) % len(usable)] for j in range(num_blocks)]
        next_block += num_blocks
        tokens = array("q", range(1000 + i, 1000 + i + n))
        seqs.append(ScheduledSeq(f"seq{i}", start, tokens, blocks, True, (), array("q")))
    seqs[-1].num_drafts = num_drafts
    plan = StepPlan(
        seqs=seqs,
        num_decodes=sum(
            seq.start_pos > 0 and len(seq.token_ids) == 1 + seq.num_drafts for seq in seqs
        ),
        num_batched_tokens=sum(n for _, n in chunks),
    )
    # A builder whose only buckets are (t, s) pads to exactly this pair.
    max_blocks = math.ceil(engine.max_model_len / block_size)
    return StepInputBuilder((t,), (s,), block_size, max_blocks).build(plan)


def bucket_table(engine: LLMEngine, compiles: list[float], args) -> list[dict]:
    """Median wall and CPU time of every (bucket, kind) cell.

    Cells are timed in rounds (each round runs every cell once), so load from other processes
    that comes and goes spreads over all cells instead of skewing a few.
    """
    pairs = engine.bucket_pairs()
    if len(compiles) != len(pairs):
        raise RuntimeError(
            f"saw {len(compiles)} compile events named {MODEL_STEP!r} for {len(pairs)} buckets: "
            "has the runner's jitted step been renamed?"
        )
    cells = {
        (t, s, kind): representative_inputs(engine, kind, t, s, args.context)
        for t, s in pairs
        for kind in KINDS
    }
    wall, cpu = defaultdict(list), defaultdict(list)
    for round_index in range(args.warmup + args.reps):
        print(f"round {round_index + 1}/{args.warmup + args.reps}", file=sys.stderr, flush=True)
        timed = round_index >= args.warmup
        with forbid_compilation() if timed else contextlib.nullcontext():
            for key, (inputs, _) in cells.items():
                start_wall, start_cpu = time.perf_counter(), time.process_time()
                jax.block_until_ready(engine.runner.run(inputs))
                if timed:
                    wall[key].append(time.perf_counter() - start_wall)
                    cpu[key].append(time.process_time() - start_cpu)
    rows = []
    for (t, s), compile_s in zip(pairs, compiles, strict=True):
        row = {"T": t, "S": s, "compile_s": compile_s}
        for kind in KINDS:
            real = cells[(t, s, kind)][1]
            seconds = statistics.median(wall[(t, s, kind)])
            row[kind] = {
                "tokens": real,
                "step_ms": 1e3 * seconds,
                "cpu_ms": 1e3 * statistics.median(cpu[(t, s, kind)]),
                "tok_per_s": real / seconds,
            }
        rows.append(row)
    return rows


class StepLog:
    """An engine step observer that keeps each model step's bucket, contents and runner time.

    It asks for the runner's time up to its logits, which adds one sync point per step between
    the model step and the sampler.
    """

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def __call__(self, step: ModelStep) -> None:
        q_lens, kv_lens = step.q_lens, step.kv_lens
        self.steps.append(
            {
                "T": step.token_bucket,
                "S": step.seq_bucket,
                "tokens": step.num_tokens,
                "seqs": step.num_seqs,
                "kind": step_kind(step.num_decodes, step.num_seqs),
                # (query token, cached position) pairs the causal attention scores: a sequence's
                # q new tokens after kv - q cached ones see kv - q + 1 ... kv positions
                "attended": int(np.sum(q_lens * (kv_lens - q_lens) + q_lens * (q_lens + 1) // 2)),
                "context": int(kv_lens.sum()),  # cached positions the step's sequences read
                "runner_s": step.runner_s,
            }
        )


def logged_steps(engine: LLMEngine) -> list[dict]:
    """Step the engine until its queued requests are done: StepLog's record of every model
    step, with the engine step's whole wall time (`wall_s`) next to the runner's."""
    log = StepLog()
    engine.add_step_observer(log, runner_time=True)
    try:
        while engine.has_unfinished_requests():
            logged = len(log.steps)
            start = time.perf_counter()
            engine.step()
            if len(log.steps) > logged:  # a step that only finished requests ran no model
                log.steps[-1]["wall_s"] = time.perf_counter() - start
    finally:
        engine.remove_step_observer(log)
    return log.steps


def workload_padding(engine: LLMEngine, args) -> dict:
    """Run bench.offline's workload; padding shares and where the step time went."""
    preset = OFFLINE_WORKLOAD_SMOKE if args.smoke else OFFLINE_WORKLOAD
    pool = text_token_pool(engine.tokenizer)
    workload = make_workload(
        pool, args.num_requests, preset["prompt_len"], preset["output_len"], args.seed
    )
    add_requests(engine, workload)
    print(f"running {args.num_requests} requests ...", file=sys.stderr, flush=True)
    steps = logged_steps(engine)
    by_bucket = defaultdict(lambda: {"steps": 0, "computed": 0, "real": 0, "wall_s": 0.0})
    for step in steps:
        b = by_bucket[(step["T"], step["S"])]
        b["steps"] += 1
        b["computed"] += step["T"]
        b["real"] += step["tokens"]
        b["wall_s"] += step["wall_s"]
    total_wall = sum(step["wall_s"] for step in steps)
    computed = sum(step["T"] for step in steps)
    return {
        "num_requests": args.num_requests,
        "prompt_tokens": sum(map(len, workload.prompts)),
        "output_tokens": sum(workload.output_lens),
        "steps": len(steps),
        "wall_s": total_wall,
        "runner_s": sum(step["runner_s"] for step in steps),
        "computed_tokens": computed,
        "real_tokens": sum(step["tokens"] for step in steps),
        "padding_share": sum(step["T"] - step["tokens"] for step in steps) / computed,
        "seq_padding_share": sum(s["S"] - s["seqs"] for s in steps) / sum(s["S"] for s in steps),
        "steps_by_kind": {k: sum(s["kind"] == k for s in steps) for k in KINDS},
        "wall_s_by_kind": {k: sum(s["wall_s"] for s in steps if s["kind"] == k) for k in KINDS},
        "by_bucket": [
            {
                "T": t,
                "S": s,
                **b,
                "padding_share": 1 - b["real"] / b["computed"],
                "time_share": b["wall_s"] / total_wall,
            }
            for (t, s), b in sorted(by_bucket.items())
        ],
    }


def markdown(report: dict) -> str:
    header = ["T", "S", "compile s", "decode ms (tok/s)", "prefill ms (tok/s)",
              "mixed ms (tok/s)", "workload steps", "workload time share"]  # fmt: skip
    usage = {(b["T"], b["S"]): b for b in report["workload"]["by_bucket"]}
    rows = []
    for row in report["buckets"]:
        b = usage.get((row["T"], row["S"]), {"steps": 0, "time_share": 0.0})
        rows.append([
            str(row["T"]), str(row["S"]), f"{row['compile_s']:.2f}",
            *(f"{row[k]['step_ms']:.1f} ({row[k]['tok_per_s']:.0f})" for k in KINDS),
            str(b["steps"]), f"{100 * b['time_share']:.1f}%",
        ])  # fmt: skip
    lines = [markdown_table(header, rows)]
    w, c = report["workload"], report["compile"]
    compile_total = sum(r["compile_s"] for r in report["buckets"])
    lines += [
        "",
        f"Cold compile of {len(report['buckets'])} model steps: {compile_total:.1f} s (backend "
        f"compile); engine start-up {c['engine_startup_s']:.1f} s; fresh XLA cache: "
        f"{c['fresh_cache']}.",
        f"Workload: {w['num_requests']} requests, {w['steps']} steps {w['steps_by_kind']}, "
        f"{w['wall_s']:.1f} s (by kind: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in w["wall_s_by_kind"].items())
        + f"). Padding: {100 * w['padding_share']:.1f}% of computed tokens "
        f"({w['computed_tokens']} computed, {w['real_tokens']} real), "
        f"{100 * w['seq_padding_share']:.1f}% of sequence slots. The runner (model step) took "
        f"{w['runner_s']:.1f} s of the {w['wall_s']:.1f} s of engine steps; the rest is "
        "scheduling, input building, sampling and output processing.",
        f"Load average (1 min) before / after: {report['loadavg_1min']['before']:.1f} / "
        f"{report['loadavg_1min']['after']:.1f} on {os.cpu_count()} CPUs.",
    ]
    return "\n".join(lines)


def heatmap(report: dict, path: Path) -> None:
    from matplotlib.colors import LogNorm

    rows = report["buckets"]
    ts, ss = sorted({r["T"] for r in rows}), sorted({r["S"] for r in rows})
    all_ms = [r[kind]["step_ms"] for r in rows for kind in KINDS]
    norm = LogNorm(min(all_ms), max(all_ms) * 1.001)  # one scale for every panel
    size = (4 * len(KINDS) + 1, 0.45 * len(ts) + 2)
    with figure(path, len(KINDS), figsize=size, dpi=80, layout="constrained") as (fig, axes):
        for ax, kind in zip(axes, KINDS, strict=True):
            grid = np.full((len(ts), len(ss)), np.nan)
            for r in rows:
                grid[ts.index(r["T"]), ss.index(r["S"])] = r[kind]["step_ms"]
            image = ax.imshow(grid, cmap="viridis", norm=norm, aspect="auto", origin="lower")
            for (i, j), ms in np.ndenumerate(grid):
                if not np.isnan(ms):
                    color = "black" if norm(ms) > 0.6 else "white"
                    ax.text(j, i, f"{ms:.0f}", ha="center", va="center", color=color, fontsize=8)
            ax.set_title(f"{kind} (median ms per step)")
            ax.set_xlabel("sequence bucket S")
            ax.set_ylabel("token bucket T")
            ax.set_xticks(range(len(ss)), [str(s) for s in ss])
            ax.set_yticks(range(len(ts)), [str(t) for t in ts])
        fig.colorbar(image, ax=axes, label="ms per step", fraction=0.02)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_arguments(parser)
    parser.add_argument("--context", type=int, default=256, help="decode context C")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs per input")
    parser.add_argument("--reps", type=int, default=5, help="timed runs per input (median)")
    parser.add_argument("--num-requests", type=int, help="workload size (default 64, smoke 8)")
    parser.add_argument(
        "--out", default=str(RESULTS_DIR / "buckets_cpu"), help="writes OUT.json, .md and .png"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny buckets and workload, for CI")
    if parser.parse_known_args(argv)[0].smoke:
        parser.set_defaults(**SMOKE)
    args = parser.parse_args(argv)
    if args.num_requests is None:
        args.num_requests = (OFFLINE_WORKLOAD_SMOKE if args.smoke else OFFLINE_WORKLOAD)[
            "num_requests"
        ]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    temporary = args.compilation_cache_dir is None
    if temporary:
        args.compilation_cache_dir = tempfile.mkdtemp(prefix="jserve-xla-")
    cache_dir = Path(args.compilation_cache_dir)
    fresh = not cache_dir.exists() or not any(cache_dir.iterdir())
    compiles = ModelStepCompiles()
    loaded = load_model(args.model)
    start = time.perf_counter()
    engine = LLMEngine(engine_args_from_namespace(args), loaded=loaded)
    startup = time.perf_counter() - start
    if temporary:
        shutil.rmtree(cache_dir, ignore_errors=True)
    rows = bucket_table(engine, compiles.seconds, args)
    report = {
        "config": {k: v for k, v in vars(args).items() if k != "compilation_cache_dir"},
        "compile": {"fresh_cache": fresh, "engine_startup_s": startup},
        "buckets": rows,
        "workload": workload_padding(engine, args),
        "loadavg_1min": {"before": load_before, "after": os.getloadavg()[0]},
    }
    table = markdown(report)
    print(table)
    out = Path(args.out)
    write_json(out.with_suffix(".json"), report)
    write_text(out.with_suffix(".md"), table)
    heatmap(report, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
