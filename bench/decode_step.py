"""A decode step of the real engine against its matmul-only stack: the issue's step target.

The step is `ModelRunner.run` on one bucket filled with decode rows, each sequence with its own
pages at the given context (bench.bucket_costs' `representative_inputs`), timed up to its logits.
The matmul-only stack is the same step's products and nothing else: the four projections of
every layer at the step's token count under `lax.scan` (on the native kernels the engine's own
weights as it lays them out, packed GGUF blocks included; under XLA random ones of the model's
shapes) and the lm_head at one row per sequence. Both are timed
in alternation (bench.ab_driver), in one process, so a change in the machine's state moves
both; the report gives the median of the rounds and the step's share of the matmul-only rate
(stack / step), with the min, median and max of each round's share.
With --profile, the step's calls are also traced (jax.profiler) and reduced to a table: the ms
a step spends in the matmuls, attention, gathers and scatters, the other XLA ops, and the rest
of its wall time (dispatch and host), by the op names of the bucket's own optimized HLO.

    python -m bench.decode_step                          # 32 decodes at context 512
    python -m bench.decode_step --seqs 64 --context 400 --rounds 7
    python -m bench.decode_step --profile                # and where the step's time goes
    python -m bench.decode_step --smoke                  # tiny, for CI
"""

from __future__ import annotations

import argparse
import glob
import re
import statistics
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.ab_driver import alternate, describe
from bench.bucket_costs import representative_inputs
from bench.kernel_timings import median_seconds
from bench.report_writer import markdown_table, write_json
from bench.roofline import projection_shapes
from jserve.config.engine_args import add_engine_arguments, engine_args_from_namespace
from jserve.engine.llm_engine import LLMEngine
from jserve.models.config import ModelConfig
from jserve.pallas.layer_matmul import MatmulImpl, layer_matmul, pack_layer_weight


def matmul_stack(
    config: ModelConfig, impl: str, tokens: int, seqs: int, served: Any = None, seed: int = 0
):
    """fn(): the step's products once, jitted, on random inputs of the step's shapes and random
    weights laid out for `impl`; with `served` (a "native" engine's LlamaModel), its own
    weights as they are laid out, float panels or packed GGUF blocks."""
    rng = np.random.default_rng(seed)
    layers = config.num_layers

    def weight(k: int, n: int, num: int) -> jax.Array:
        w = rng.standard_normal((num, k, n), np.float32) * k**-0.5
        return pack_layer_weight(jnp.asarray(w), impl)

    shapes = projection_shapes(config)
    inputs = {
        name: jnp.asarray(rng.standard_normal((tokens, k), np.float32))
        for name, (k, _) in shapes.items()
    }
    if served is None:
        weights = {name: weight(k, n, layers) for name, (k, n) in shapes.items()}
        head = weight(config.hidden_size, config.vocab_size, 1)
    else:
        weights = {name: getattr(served.layers, name)[...] for name in shapes}
        head = (served.embed if config.tie_word_embeddings else served.lm_head)[...]
    rows = jnp.asarray(rng.standard_normal((seqs, config.hidden_size), np.float32))

    @jax.jit
    def run(weights, inputs, head, rows):
        def one(total, layer):
            for name, (_, n) in shapes.items():
                total = total + layer_matmul(inputs[name], weights[name], layer, impl, n)[0, 0]
            return total, None

        total = jax.lax.scan(one, jnp.float32(0), jnp.arange(layers, dtype=jnp.int32))[0]
        logits = layer_matmul(rows, head, jnp.int32(0), impl, config.vocab_size)
        return total + logits[0, 0]

    return lambda: run(weights, inputs, head, rows)


# A profile row of each native kernel, by the kernel name that starts its FFI target (a build's
# target adds its ISA level and key: jserve.pallas.native_build); other ops go by their names.
TARGET_ROWS = {
    "jserve_packed_matmul_f32": "matmuls",
    "jserve_quant_matmul_f32": "matmuls",
    "jserve_quant_columns_f32": "gathers and scatters",
    "jserve_ragged_attention_f32": "attention",
}
KERNEL = re.compile(rf'custom_call_target="({"|".join(TARGET_ROWS)})')
CONTAINERS = {"while", "conditional", "call"}  # ops whose time is their inner ops' time
PROFILE_ROWS = ("matmuls", "attention", "gathers and scatters", "other XLA ops")


def op_rows(hlo: str) -> dict[str, str]:
    """Each instruction of an optimized HLO module -> its profile row (containers left out)."""
    rows = {}
    line = re.compile(r"^\s*(?:ROOT\s+)?%?(\S+) = .*? ([a-z][\w-]*)\((.*)$", re.M)
    for name, opcode, rest in line.findall(hlo):
        if opcode in CONTAINERS:
            continue
        kernel = KERNEL.search(rest)
        if kernel:
            rows[name] = TARGET_ROWS[kernel.group(1)]
        elif re.search(r"scatter|gather|dynamic-slice|dynamic-update-slice", name + opcode):
            rows[name] = "gathers and scatters"
        else:
            rows[name] = "other XLA ops"
    return rows


def profile_step(fn, hlo: str, calls: int) -> dict[str, float]:
    """ms per call of fn() in each profile row, from a jax.profiler trace of `calls` calls, and
    "dispatch and host": the calls' wall time that no op of the module accounts for."""
    from jax.profiler import ProfileData

    rows = op_rows(hlo)
    module = re.search(r"^HloModule (\S+?),", hlo, re.M).group(1)
    jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            start = time.perf_counter()
            for _ in range(calls):
                jax.block_until_ready(fn())
            wall_ms = (time.perf_counter() - start) * 1e3 / calls
        (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        data = ProfileData.from_file(path)
    ms = dict.fromkeys(PROFILE_ROWS, 0.0)
    for plane in data.planes:
        for events in plane.lines:
            for event in events.events:
                stats = dict(event.stats)
                row = rows.get(stats.get("hlo_op"))
                if row is not None and stats.get("hlo_module") == module:
                    ms[row] += event.duration_ns / 1e6 / calls
    ms["dispatch and host"] = wall_ms - sum(ms.values())
    ms["wall"] = wall_ms
    return ms


def median_ms(fn, calls: int) -> float:
    """Median wall ms of fn() over `calls` calls, after one warm-up call."""
    return median_seconds(fn, (), calls, warmup=1)[0] * 1e3


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_arguments(parser)
    parser.add_argument("--seqs", type=int, default=32, help="decode rows (= token bucket)")
    parser.add_argument("--context", type=int, default=512, help="cached positions per row")
    parser.add_argument("--rounds", type=int, default=5, help="alternations of step and stack")
    parser.add_argument("--calls", type=int, default=9, help="timed calls per round (median)")
    parser.add_argument("--profile", action="store_true", help="also trace the step's ops")
    parser.add_argument("--smoke", action="store_true", help="tiny buckets, one round")
    parser.add_argument("--json", help="also write the report here")
    if parser.parse_known_args(argv)[0].smoke:  # small buckets compile in seconds
        parser.set_defaults(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
        parser.set_defaults(seqs=8, context=64, rounds=1, calls=2)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    engine = LLMEngine(engine_args_from_namespace(args))
    buckets = engine.inputs_builder.token_buckets
    if args.seqs not in buckets:
        raise SystemExit(f"--seqs {args.seqs} is not one of the token buckets {buckets}")
    inputs, _ = representative_inputs(engine, "decode", args.seqs, args.seqs, args.context)
    runner = engine.runner
    served = None  # a native engine's stack reads its own weights (a packed GGUF's blocks too)
    if runner.matmul_impl == MatmulImpl.NATIVE:
        served = nnx.merge(runner.step.graphdef, runner.state)
    stack = matmul_stack(engine.model_config, runner.matmul_impl, args.seqs, args.seqs, served)
    rounds = alternate(
        lambda: median_ms(lambda: engine.runner.run(inputs), args.calls),
        lambda: median_ms(stack, args.calls),
        args.rounds,
    )
    step_ms, stack_ms = rounds.a, rounds.b
    ab = rounds.summary(lambda step, stack: stack / step)
    shares = ab["ratio"]
    report = {
        "seqs": args.seqs,
        "context": args.context,
        "matmul_impl": engine.runner.matmul_impl,
        "step_ms": step_ms,
        "stack_ms": stack_ms,
        "median_step_ms": statistics.median(step_ms),
        "median_stack_ms": statistics.median(stack_ms),
        "share_of_matmul_rate": statistics.median(stack_ms) / statistics.median(step_ms),
        "share_range": [shares["min"], shares["max"]],
        "ab": ab,
        "loadavg_1min": rounds.loadavg_1min,
    }
    print(
        f"{args.seqs} decodes at context {args.context} ({report['matmul_impl']} matmuls), "
        f"{args.rounds} rounds: step {report['median_step_ms']:.1f} ms "
        f"({min(step_ms):.1f}-{max(step_ms):.1f}), matmul-only stack "
        f"{report['median_stack_ms']:.1f} ms ({min(stack_ms):.1f}-{max(stack_ms):.1f}): the step "
        f"runs at {report['share_of_matmul_rate']:.0%} of the matmul-only rate "
        f"({shares['min']:.0%}-{shares['max']:.0%}; each round's share: {describe(shares)}); "
        f"1-minute load {rounds.load_before:.2f} -> {rounds.load_after:.2f}"
    )
    if args.profile:
        hlo = engine.runner.hlo_text(args.seqs, args.seqs)
        profile = profile_step(lambda: engine.runner.run(inputs), hlo, args.calls)
        report["profile_ms"] = profile
        rows = [[row, f"{ms:.1f}", f"{ms / profile['wall']:.0%}"] for row, ms in profile.items()]
        print(markdown_table(["where a step's time goes", "ms", "share"], rows, align="lrr"))
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
