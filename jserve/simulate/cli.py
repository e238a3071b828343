"""`jserve simulate`: capacity planning with the real scheduler in virtual time, in seconds.

    jserve simulate --rate 4 --tenants A:4,B:1             # a synthetic workload, CPU table
    jserve simulate --cost-model roofline --rate 300       # an H200 serving an 8B model
    jserve simulate --dataset requests.jsonl               # arrivals and lengths from a file
    jserve simulate --preset all                           # the policy comparisons
    jserve simulate --compare-serve bench/results/serve_chunked-prefill.json

No model runs: each step the scheduler plans is priced by a cost model (jserve.simulate.costs)
and the virtual clock advances by that much. The measured cost model reads a per-bucket table:
by default the CPU table `python -m bench.bucket_costs` wrote (relative to the repository
root), or any `--bucket-report` (a bucket report, or a table `jserve serve --save-step-costs`
learned while serving). Every figure printed is labelled simulated.
"""

from __future__ import annotations

import argparse
import math

from jserve.config.scheduler import SchedulerConfig
from jserve.core.buckets import engine_buckets
from jserve.simulate.costs import MeasuredCost, RooflineCost
from jserve.simulate.presets import PRESETS
from jserve.simulate.report import serving_report
from jserve.simulate.simulator import simulate
from jserve.simulate.versus_measured import compare_serve
from jserve.simulate.workload import load_jsonl, parse_tenant_shares, synthetic

DEFAULT_REPORT = "bench/results/buckets_cpu.json"


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
    costs.add_argument("--cost-model", choices=["measured", "roofline"], default="measured")
    costs.add_argument("--bucket-report", default=DEFAULT_REPORT,
                       help="the measured per-bucket table (default: %(default)s)")  # fmt: skip
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
    engine.add_argument("--max-num-seqs", type=int, default=32)
    engine.add_argument("--max-num-batched-tokens", type=int, default=512)
    engine.add_argument("--num-kv-blocks", type=int, default=4096)
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
    config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=2048, fairness=args.fairness, scheduling=args.scheduling,
        target_itl_ms=args.target_itl_ms,
    )  # fmt: skip
    token_buckets, seq_buckets = engine_buckets(  # as a CPU engine has them
        args.max_num_batched_tokens, args.max_num_seqs, args.cost_model == "measured"
    )
    if args.cost_model == "measured":
        model = MeasuredCost.from_report(args.bucket_report, token_buckets, seq_buckets)
        costs = model.fresh_table()
    else:
        model = RooflineCost()
        costs = model.table(token_buckets, seq_buckets)
    result = simulate(workload, config, args.num_kv_blocks, model, costs)
    slo = {"slo_ttft_ms": args.slo_ttft, "slo_tpot_ms": args.slo_tpot}
    title = f"{args.cost_model} cost model, {len(workload)} requests"
    return serving_report(result, title, slo)
