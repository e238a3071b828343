"""`jserve simulate`: capacity planning with the real scheduler in virtual time, in seconds.

    jserve simulate --rate 4 --tenants A:4,B:1             # a synthetic workload, CPU table
    jserve simulate --compile-report bench/results/compile_llama-3-8b_h200.json --rate 300
    jserve simulate --dataset requests.jsonl               # arrivals and lengths from a file
    jserve simulate --preset all                           # the policy comparisons
    jserve simulate --compare-serve bench/results/serve_chunked-prefill.json

No model runs: each step the scheduler plans is priced by a per-bucket table
(jserve.simulate.costs) and the virtual clock advances by that much. The table is measured:
by default the CPU table `python -m bench.bucket_costs` wrote (relative to the repository
root), or any `--bucket-report` (a bucket report, or a table `jserve serve --save-step-costs`
learned while serving); or, with `--compile-report`, estimated: each step bucket's roofline
from a `jserve compile --report` JSON, for a TPU or GPU this machine lacks, the scheduler
limited as that compiled engine is. Every figure printed is labelled simulated.
"""

from __future__ import annotations

import argparse
import math

from jserve.config.scheduler import SchedulerConfig
from jserve.core.buckets import engine_buckets
from jserve.simulate.costs import CompiledEngine, MeasuredCost
from jserve.simulate.presets import DEFAULT_COMPILE_REPORT, PRESETS
from jserve.simulate.report import serving_report
from jserve.simulate.simulator import simulate
from jserve.simulate.versus_measured import compare_serve
from jserve.simulate.workload import load_jsonl, parse_tenant_shares, synthetic

DEFAULT_REPORT = "bench/results/buckets_cpu.json"
# The scheduler's limits without a compile report (a compile report brings its engine's).
ENGINE_LIMITS = {"--max-num-seqs": 32, "--max-num-batched-tokens": 512, "--num-kv-blocks": 4096}


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_argument_group("what to simulate")
    what.add_argument(
        "--preset",
        choices=[*PRESETS, "all"],
        help="run a policy comparison (docs/scheduling.md) under both cost models",
    )
    what.add_argument(
        "--compare-serve", nargs="+", metavar="JSON",
        help="serving-benchmark results (python -m bench.serve or bench.serve_compare): "
        "simulate the same workloads and print predicted vs measured",
    )  # fmt: skip
    what.add_argument("--dataset", help="JSONL workload: arrival_s, prompt_tokens, max_tokens "
                      "(tenant, lane, timeout optional)")  # fmt: skip
    costs = parser.add_argument_group("cost model")
    costs.add_argument("--bucket-report", default=DEFAULT_REPORT,
                       help="the measured per-bucket table (default: %(default)s)")  # fmt: skip
    costs.add_argument(
        "--compile-report", metavar="JSON",
        help="price steps by a `jserve compile --report` JSON's roofline step times (an "
        "estimate) and limit the scheduler as that engine is; the presets' second cost model "
        f"(default there: {DEFAULT_COMPILE_REPORT})",
    )  # fmt: skip
    load = parser.add_argument_group("synthetic workload")
    load.add_argument("--num-requests", type=int, help="default: per preset, else 200")
    load.add_argument("--rate", type=float, help="req/s, Poisson (default: per preset, else "
                      "all at once)")  # fmt: skip
    load.add_argument("--prompt-len", default="lognormal:128:0.8:1024",
                      help="N, uniform:LO:HI or lognormal:MEDIAN:SIGMA[:MAX] tokens")  # fmt: skip
    load.add_argument("--output-len", default="lognormal:64:1.0:512", help="as --prompt-len")
    load.add_argument("--tenants", default="default:1", help="NAME:SHARE,... of the requests")
    load.add_argument("--seed", type=int, default=0)
    engine = parser.add_argument_group("scheduler")
    engine.add_argument("--fairness", choices=["vtc", "fcfs"], default="vtc")
    engine.add_argument("--scheduling", choices=["continuous", "static"], default="continuous")
    for flag, default in ENGINE_LIMITS.items():
        engine.add_argument(flag, type=int, help=f"default: {default}; with --compile-report, "
                            "the compiled engine's")  # fmt: skip
    engine.add_argument("--target-itl-ms", type=float, default=0.0)
    slo = parser.add_argument_group("goodput")
    slo.add_argument("--slo-ttft", type=float, help="ms")
    slo.add_argument("--slo-tpot", type=float, help="ms")


def run_simulate(args: argparse.Namespace) -> int:
    """Print what the arguments ask for; a bad argument or file raises ValueError."""
    if args.compare_serve:
        print("\n\n".join(compare_serve(p, args.bucket_report) for p in args.compare_serve))
    elif args.preset:
        names = list(PRESETS) if args.preset == "all" else [args.preset]
        print("\n\n".join(PRESETS[name](args) for name in names))
    else:
        print(_simulate_workload(args))
    return 0


def _simulate_workload(args: argparse.Namespace) -> str:
    if args.dataset:
        workload = load_jsonl(args.dataset)
    else:
        rate = math.inf if args.rate is None else args.rate
        workload = synthetic(args.num_requests or 200, rate, args.prompt_len, args.output_len,
                             parse_tenant_shares(args.tenants), args.seed)  # fmt: skip
    policy = {"fairness": args.fairness, "scheduling": args.scheduling,
              "target_itl_ms": args.target_itl_ms}  # fmt: skip
    if args.compile_report:
        given = [flag for flag in ENGINE_LIMITS if getattr(args, _dest(flag)) is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)}: a compile report brings its engine's limits; leave "
                "them out, or compile with the ones to simulate"
            )
        engine = CompiledEngine.from_report(args.compile_report)
        config, num_blocks = engine.scheduler_config(**policy), engine.num_blocks
        model, costs, block_size = engine.cost_model(), engine.fresh_table(), engine.block_size
    else:
        limits = {flag: getattr(args, _dest(flag)) or d for flag, d in ENGINE_LIMITS.items()}
        seqs, tokens = limits["--max-num-seqs"], limits["--max-num-batched-tokens"]
        config = SchedulerConfig(
            max_num_seqs=seqs, max_num_batched_tokens=tokens, max_model_len=2048, **policy
        )
        token_buckets, seq_buckets = engine_buckets(tokens, seqs, decode_midpoints=True)
        model = MeasuredCost.from_report(args.bucket_report, token_buckets, seq_buckets)
        costs, num_blocks, block_size = model.fresh_table(), limits["--num-kv-blocks"], 16
    result = simulate(workload, config, num_blocks, model, costs, None, block_size)
    slo = {"slo_ttft_ms": args.slo_ttft, "slo_tpot_ms": args.slo_tpot}
    return serving_report(result, f"{model.label}, {len(workload)} requests", slo)


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")
