"""Speculative decoding, the whole table: methods off / ngram / suffix, on an input-grounded
workload (copy, edit, quote, extract, summarize) and an open one (stories, chat), at
concurrency 1, 4 and 32: time per output token, throughput and acceptance per method, greedy,
each method's outputs checked token for token against speculation off.

One engine serves every cell: speculation is switched by its scheduler's config (a verify step
uses the same precompiled step shapes) and the engine is reset before each run (empty prefix
cache, no suffix history from another run; the learned step costs are kept, as a server keeps
them). Within a cell the methods take turns round by round, each round in a rotated order, so
a shared machine's drift hits them alike; the 1-minute load average around each cell is
recorded with it.

    python -m bench.speculative --json bench/results/speculative_cpu.json

The first run compiles the engine's step shapes (a few minutes on a CPU, then cached under
JSERVE_CACHE_DIR). `--concurrency 1 --max-tokens 8 --rounds 1` is a smoke run.

`--bound` answers how much any drafter that reads the run's own text could gain one request at
a time, instead of the table. It times the model step of one sequence verifying d drafts
(d + 1 tokens, in the bucket the engine pads it to) for d = 0..k, adds the engine's measured
time between steps (TPOT without speculation minus the d = 0 step), runs each prompt without
speculation for its greedy output (which speculation must reproduce), and finds by dynamic
programming the fastest way to produce that output if, at every step, the drafter proposed
exactly the longest run of the next tokens that occurs anywhere in its text so far (the run's
earlier prompts and outputs, its prompt, its output so far), or any shorter prefix of it. No
drafter that copies from that text can be faster, and this one knows the future, so the bound
is generous: a proposer's measured speedup over the bound says how much of the reachable gain
it takes. Beside the bound, each method is replayed on the same outputs and step costs:
jserve's own scheduler plans the request alone with the recorded output standing in for the
model, so a change to a proposer or to the pricing of drafts shows its gain without the
model's timing noise (`--verify-step-ms` and `--between-ms` fix the costs across runs).
Last, it prices `--target` (a TPOT speedup) at d = 1..k drafts a step: the speedup if every
draft were accepted, and the accepted drafts a step must average to reach the target, for a
drafter that drafts for free (a copy) and for one that pays at least the model's vocabulary
head per drafted token (any drafter predicting over the model's vocabulary: a draft head, a
draft model sharing it, the model with layers skipped), with the per-token acceptance that
gives it.
"""

from __future__ import annotations

import argparse
import array
import dataclasses
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from bench.bucket_costs import chunk_inputs
from bench.kernel_timings import median_seconds
from bench.report_writer import write_json
from jserve.config.engine_args import EngineArgs
from jserve.config.scheduler import SchedulerConfig
from jserve.core.request import Request
from jserve.core.scheduler import Scheduler
from jserve.core.step_costs import StepCosts
from jserve.core.stopping import StopConditions
from jserve.engine.llm_engine import LLMEngine
from jserve.sampling_params import SamplingParams


def _copy(i: int) -> str:
    items = "".join(
        f"- item {i + j}: apple, banana, cherry, {(i + j) * 7} grams\n" for j in range(12)
    )
    return "Copy this list exactly, one item per line:\n" + items


def _edit(i: int) -> str:
    code = "".join(
        f"def add{i + j}(a, b):\n    # adds two numbers\n    return a + b + {j}\n\n"
        for j in range(6)
    )
    return "Rename the function add to plus and repeat the code:\n\n" + code


def _quote(i: int) -> str:
    return (
        "Quote the first two sentences of this passage word for word.\n\n"
        f"Report {i}. The history of computing is a story of ideas meeting machines. Early "
        "calculators were mechanical, then electrical, and finally electronic; each step made "
        "arithmetic faster. Programs came later, stored in the same memory as their data."
    )


def _extract(i: int) -> str:
    people = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Edsger Dijkstra", "Barbara Liskov"]
    rows = "".join(
        f"id={i * 10 + j}; name={name}; email={name.split()[0].lower()}@example.org; team=core\n"
        for j, name in enumerate(people)
    )
    return f"From these records, list each name with its email, one per line:\n\n{rows}"


def _summarize(i: int) -> str:
    return (
        "Summarize this text in two sentences, reusing its words.\n\n"
        f"Meeting {i} notes. The team reviewed the release plan for the new storage service. "
        "The storage service will replace the old file server in March. The migration will "
        "move every project folder to the storage service over two weekends. The team agreed "
        "that the old file server stays read-only for one month after the migration."
    )


def _story(i: int) -> str:
    topics = ["a lighthouse keeper", "a lost robot", "a baker's apprentice", "a comet"]
    return f"Write a short story about {topics[i % len(topics)]}."


def _chat(i: int) -> str:
    questions = [
        "What are some tips for learning a new language?",
        "Why is the sky blue?",
        "How do I keep basil alive indoors?",
        "What makes a good cup of coffee?",
    ]
    return questions[i % len(questions)]


WORKLOADS = {
    "grounded": (_copy, _edit, _quote, _extract, _summarize),
    "open": (_story, _chat),
}


@dataclasses.dataclass
class Run:
    """One method's run of one batch: per request tokens, TPOT (ms), and the totals."""

    tokens: dict[str, list[int]]
    tpot_ms: list[float]
    seconds: float
    drafted: int
    accepted: int


def _prompt_ids(engine: LLMEngine, text: str) -> list[int]:
    tokenizer = engine.tokenizer
    template = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return tokenizer.encode(template, add_special_tokens=False)


def _run_batch(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> Run:
    """All `prompts` at once (greedy), stepped until done."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    before = engine.stats()
    started = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    tpot = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            ids = list(out.outputs[0].token_ids)
            if ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                tokens[out.request_id] = ids
                if len(ids) > 1:
                    tpot.append(1000 * (now - first[out.request_id]) / (len(ids) - 1))
    after = engine.stats()
    return Run(
        tokens, tpot, time.perf_counter() - started,
        after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
        after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens,
    )  # fmt: skip


def _cell(engine, configs, prompts, rounds, max_tokens) -> dict[str, list[Run]]:
    """Each method's runs of `prompts`, round by round in a rotated order."""
    methods = list(configs)
    runs: dict[str, list[Run]] = {method: [] for method in methods}
    for r in range(rounds):
        for method in methods[r % len(methods) :] + methods[: r % len(methods)]:
            engine.scheduler.reconfigure(configs[method])
            engine.reset()
            runs[method].append(_run_batch(engine, prompts, max_tokens))
    return runs


def _summary(runs: list[Run], off: list[Run]) -> dict:
    tokens = sum(len(t) for run in runs for t in run.tokens.values())
    tpot = statistics.mean(t for run in runs for t in run.tpot_ms)
    drafted = sum(run.drafted for run in runs)
    return {
        "tpot_ms": tpot,
        "throughput_tok_s": tokens / sum(run.seconds for run in runs),
        "acceptance": sum(run.accepted for run in runs) / drafted if drafted else None,
        "draft_tokens": drafted,
        "identical_to_off": all(a.tokens == b.tokens for a, b in zip(runs, off, strict=True)),
    }


def _engine(max_concurrency: int, quantization: str = "auto") -> LLMEngine:
    if max_concurrency <= 8:  # the test suite's sizes (tests/shared_engine.py): steps cached
        sizes = dict(max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=49)
    else:  # every sequence's prompt and output in the pool at once: no preemption
        sizes = dict(
            max_num_seqs=max_concurrency,
            max_num_batched_tokens=256,
            num_kv_blocks=max_concurrency * 512 // 16 + 1,
        )
    return LLMEngine(EngineArgs(**sizes, max_model_len=512, quantization=quantization))


def _table(engine: LLMEngine, configs: dict, args: argparse.Namespace) -> list[dict]:
    """Every (workload, concurrency) cell's rows, one per method, printed as they come."""
    rows = []
    for workload in args.workloads:
        makers = WORKLOADS[workload]
        for concurrency in args.concurrency:
            # Whole batches of `concurrency` that hold every prompt kind at least once.
            n = concurrency * -(-len(makers) // concurrency)
            texts = [makers[i % len(makers)](i) for i in range(n)]
            batches = [texts[i : i + concurrency] for i in range(0, n, concurrency)]
            load_before = os.getloadavg()[0]
            cell = {method: [] for method in configs}
            for batch in batches:
                prompts = [_prompt_ids(engine, text) for text in batch]
                for method, runs in _cell(
                    engine, configs, prompts, args.rounds, args.max_tokens
                ).items():
                    cell[method].extend(runs)
            load = {"before": load_before, "after": os.getloadavg()[0]}
            off = _summary(cell["off"], cell["off"])
            for method, runs in cell.items():
                row = {"method": method, "k": args.k if method != "off" else 0,
                       "workload": workload, "concurrency": concurrency,
                       **_summary(runs, cell["off"]), "loadavg_1min": load}  # fmt: skip
                row["tpot_speedup"] = off["tpot_ms"] / row["tpot_ms"]
                row["throughput_ratio"] = row["throughput_tok_s"] / off["throughput_tok_s"]
                rows.append(row)
                print(
                    f"{workload:9} c={concurrency:<3} {method:7} TPOT {row['tpot_ms']:7.1f} ms "
                    f"({row['tpot_speedup']:.2f}x)  {row['throughput_tok_s']:7.1f} tok/s "
                    f"({row['throughput_ratio']:.2f}x)  acceptance {row['acceptance']}  "
                    f"identical {row['identical_to_off']}  load {load}",
                    flush=True,
                )
    return rows


def verify_step_seconds(engine: LLMEngine, k: int, context: int, reps: int = 10) -> list[float]:
    """Median seconds of the model step of one sequence at `context` verifying d drafts, in
    the bucket the engine pads d + 1 tokens to, for d = 0..k (rounds rotate over d)."""
    cells = []
    for d in range(k + 1):
        t, s = engine.scheduler.step_costs.bucket(d + 1, d + 1)
        cells.append(chunk_inputs(engine, [(context, d + 1)], t, s, num_drafts=d))
    times: list[list[float]] = [[] for _ in cells]
    for r in range(reps + 2):
        for d, inputs in enumerate(cells):
            start = time.perf_counter()
            jax.block_until_ready(engine.runner.run(inputs))
            if r >= 2:  # the first two rounds warm up
                times[d].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def head_seconds(engine: LLMEngine, reps: int = 50) -> float:
    """Median seconds of the model's vocabulary head (the logits of one row, as the step
    computes them): the least a drafter predicting over the model's vocabulary pays a token."""
    runner = engine.runner
    graphdef, impl = runner.step.graphdef, runner.matmul_impl
    h = jnp.ones((1, engine.model_config.hidden_size), jnp.float32)
    head = jax.jit(lambda state, h: nnx.merge(graphdef, state).head_logits(h, impl, None))
    return median_seconds(head, (runner.state, h), reps, warmup=1)[0]


def per_token_acceptance(accepted: float, drafts: int) -> float | None:
    """The a in [0, 1] with a + a^2 + ... + a^drafts = accepted (each draft accepted with
    chance a once the ones before it are); None when even a = 1 falls short."""
    if accepted > drafts:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid**i for i in range(1, drafts + 1)) < accepted else (lo, mid)
    return hi


def target_needs(costs: list[float], head: float, target: float) -> list[dict]:
    """For d = 1..k drafts a step (costs[d]: a step verifying d drafts, with the time between
    steps): the speedup over plain decoding (costs[0] a token) if every draft were accepted,
    and the accepted drafts a step must average for `target`, for a free drafter ("copy") and
    one paying `head` a drafted token ("model"), with the per-token acceptance that gives it."""
    rows = []
    for d in range(1, len(costs)):
        row: dict = {"drafts": d}
        for kind, step in (("copy", costs[d]), ("model", costs[d] + d * head)):
            accepted = target * step / costs[0] - 1
            row[kind] = {
                "full_acceptance_speedup": (d + 1) * costs[0] / step,
                "accepted_drafts_needed": accepted,
                "per_token_acceptance_needed": per_token_acceptance(accepted, d),
            }
        rows.append(row)
    return rows


def _needs_line(row: dict) -> str:
    cells = []
    for kind in ("copy", "model"):
        cell = row[kind]
        a = cell["per_token_acceptance_needed"]
        cells.append(
            f"{kind}: {cell['full_acceptance_speedup']:.2f}x at full acceptance, needs "
            f"{cell['accepted_drafts_needed']:.2f} accepted a step"
            + (f" (a = {a:.2f})" if a is not None else " (more than drafted: out of reach)")
        )
    return f"d = {row['drafts']}: " + "; ".join(cells)


def longest_copy(text: bytes, out: array.array, i: int, k: int) -> int:
    """The largest m <= k such that out[i : i + m] occurs in `text` (int64 tokens as bytes)."""
    m = 0
    while m < min(k, len(out) - i):
        pattern = out[i : i + m + 1].tobytes()
        hit, found = text.find(pattern), False
        while hit >= 0:  # only hits on a token boundary count
            if hit % out.itemsize == 0:
                found = True
                break
            hit = text.find(pattern, hit + 1)
        if not found:
            break
        m += 1
    return m


def fastest_seconds(history: bytes, out: list[int], step: list[float]) -> float:
    """Least total step time producing `out` after its first token (the prefill's) when a
    step verifying d drafts costs step[d] and may take d up to the longest copy from the text
    (`history`, then `out` so far) at that point: a shortest path over output positions."""
    tokens = array.array("q", out)
    best = [float("inf")] * (len(out) + 1)
    best[1] = 0.0
    for i in range(1, len(out)):
        text = history + tokens[:i].tobytes()
        for d in range(min(longest_copy(text, tokens, i, len(step) - 1), len(out) - 1 - i) + 1):
            best[i + 1 + d] = min(best[i + 1 + d], best[i] + step[d])
    return best[len(out)]


def replayed_seconds(
    engine: LLMEngine,
    config: SchedulerConfig,
    prompt: list[int],
    out: list[int],
    step: list[float],
    between: float,
) -> float:
    """Seconds the method of `config` takes to produce `out` after its first token, replayed:
    jserve's own scheduler (proposer, pricing, acceptance) plans every step of the request
    alone, the recorded greedy output stands in for the model (each draft accepted while it
    matches, then `out`'s next token sampled), and a step verifying d drafts costs step[d]
    plus `between` (the engine's time between steps), which the scheduler's step-cost table
    holds as the engine's would have learned them."""
    costs = engine.scheduler.step_costs
    table = StepCosts(costs.token_buckets, costs.seq_buckets)
    for d, seconds in enumerate(step):
        table.observe(d + 1, d + 1, seconds)
    table.between_steps = between
    scheduler = Scheduler(config, engine.scheduler.cache_config, None, table)
    stop = StopConditions(max_tokens=len(out))
    scheduler.add_request(Request("r", prompt, stop=stop, arrival_time=0.0, can_speculate=True))
    total = 0.0
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule(0.0)
        (seq,) = plan.seqs
        done = len(seq.output_token_ids)
        drafts = seq.token_ids[len(seq.token_ids) - seq.num_drafts :]
        accepted = 0
        while accepted < seq.num_drafts and drafts[accepted] == out[done + accepted]:
            accepted += 1
        sampled = {"r": out[done + accepted]} if seq.sample else {}
        for request in scheduler.update_from_output(plan, sampled, {"r": accepted}):
            scheduler.finish_request(request.request_id, request.finish_reason)
        if done:  # after the first token: what TPOT counts
            total += step[seq.num_drafts] + between
    return total


def _speedups(seconds: dict[str, float]) -> dict[str, float]:
    """Each entry's speedup over seconds["off"]."""
    return {key: seconds["off"] / value for key, value in seconds.items() if key != "off"}


def bound_table(engine: LLMEngine, configs: dict, args: argparse.Namespace) -> list[dict]:
    """Each prompt's speedup bound at concurrency 1 (module docstring), and each workload's,
    beside each method's replayed speedup on the same outputs and step costs."""
    if args.verify_step_ms:  # another run's costs: replays then compare across code changes
        step = [ms / 1000 for ms in args.verify_step_ms]
    else:
        step = verify_step_seconds(engine, args.k, args.bound_context)
    print("verify step ms by drafts:", [round(1000 * t, 2) for t in step], flush=True)
    rows, history, priced = [], b"", None
    for workload, makers in WORKLOADS.items():
        prompts = [_prompt_ids(engine, makers[i % len(makers)](i)) for i in range(len(makers))]
        engine.reset()
        runs = [_run_batch(engine, [p], args.max_tokens) for p in prompts]
        between = statistics.mean(t for run in runs for t in run.tpot_ms) / 1000 - step[0]
        if args.between_ms is not None:
            between = args.between_ms / 1000
        costs = [t + between for t in step]
        totals = dict.fromkeys(["off", "bound", *configs], 0.0)
        tpots = dict.fromkeys(totals, 0.0)  # sums of each request's time per output token
        for maker, prompt, run in zip(makers, prompts, runs, strict=True):
            out = next(iter(run.tokens.values()))
            seconds = {"off": (len(out) - 1) * costs[0]}
            seconds["bound"] = fastest_seconds(
                history + array.array("q", prompt).tobytes(), out, costs
            )
            history += array.array("q", prompt + out).tobytes()
            for method, config in configs.items():
                seconds[method] = replayed_seconds(engine, config, prompt, out, step, between)
            totals = {key: totals[key] + seconds[key] for key in totals}
            tpots = {key: tpots[key] + seconds[key] / max(1, len(out) - 1) for key in tpots}
            name = maker.__name__.strip("_")
            rows.append({"workload": workload, "prompt": name, "tokens": len(out)})
            rows[-1].update(_speedups(seconds))
            print(f"{workload:9} {name:10} {len(out):4} tokens  " + _line(_speedups(seconds)))
        rows.append({"workload": workload, "prompt": "all", **_speedups(totals),
                     "mean_tpot": _speedups(tpots), "between_steps_ms": 1000 * between,
                     "verify_step_ms": [1000 * t for t in step]})  # fmt: skip
        print(f"{workload:9} all (time)       " + _line(_speedups(totals)))
        print(f"{workload:9} all (mean TPOT)  " + _line(_speedups(tpots)), flush=True)
        if workload == "grounded":  # the workload the target is set for
            priced = costs
    head = head_seconds(engine)
    print(f"\n{args.target}x at one request, the vocabulary head {1000 * head:.2f} ms a token:")
    needs = target_needs(priced, head, args.target)
    for row in needs:
        print(_needs_line(row))
    rows.append({"target": args.target, "head_ms": 1000 * head, "needs": needs})
    return rows


def _line(speedups: dict[str, float]) -> str:
    return "  ".join(f"{key} {value:.2f}x" for key, value in speedups.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["ngram", "suffix"])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 32])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each method per cell")
    parser.add_argument("--quantization", choices=("auto", "none"), default="auto",
                        help="auto: the GGUF packed; none: expanded to float32")  # fmt: skip
    parser.add_argument("--json", help="write the result here")
    parser.add_argument(
        "--bound",
        action="store_true",
        help="the speedup bound at concurrency 1 instead of the table",
    )
    parser.add_argument("--bound-context", type=int, default=256,
                        help="context of the timed verify steps")  # fmt: skip
    parser.add_argument("--verify-step-ms", type=float, nargs="+",
                        help="--bound: these step costs of d = 0..k drafts, not timed")  # fmt: skip
    parser.add_argument("--between-ms", type=float,
                        help="--bound: this time between steps, not measured")  # fmt: skip
    parser.add_argument("--target", type=float, default=1.8,
                        help="--bound: the TPOT speedup to price (default 1.8)")  # fmt: skip
    args = parser.parse_args()
    if args.verify_step_ms and len(args.verify_step_ms) != args.k + 1:
        parser.error(f"--verify-step-ms takes k + 1 = {args.k + 1} costs (0..k drafts)")
    engine = _engine(1 if args.bound else max(args.concurrency), args.quantization)
    plain = dataclasses.replace(engine.scheduler.config, speculative_config=None)
    speculating = {
        method: dataclasses.replace(
            plain,
            speculative_config=json.dumps({"method": method, "num_speculative_tokens": args.k}),
        )
        for method in args.methods
    }
    if args.bound:
        rows = bound_table(engine, speculating, args)
        if args.json:
            write_json(args.json, {"machine": platform.processor() or platform.machine(),
                                   "k": args.k, "rows": rows})  # fmt: skip
        return
    configs = {"off": plain} | speculating
    # First-use costs out of the way, and the verify steps' buckets measured once, so the
    # step-cost rule (docs/speculative.md) starts from measured costs in every cell.
    _cell(engine, configs, [_prompt_ids(engine, _copy(100))], 1, 16)
    rows = _table(engine, configs, args)
    if args.json:
        write_json(
            args.json,
            {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
             "max_tokens": args.max_tokens, "rounds": args.rounds, "rows": rows},
        )  # fmt: skip


if __name__ == "__main__":
    main()
