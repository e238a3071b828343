"""The library's commands of the `jserve` program: generate, convert, compile and simulate
(serve is the app's)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from jserve.config.engine_args import add_engine_arguments
from jserve.simulate import cli as simulate_cli

log = logging.getLogger("jserve")


def _generate(args: argparse.Namespace) -> int:
    from jserve.config.engine_args import engine_args_from_namespace
    from jserve.engine.llm_engine import LLMEngine
    from jserve.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.request_seed
    )
    engine_args = engine_args_from_namespace(args)
    if engine_args.process_id > 0:  # a multi-process run's other processes only follow
        from jserve.engine.follower import run_follower

        return run_follower(engine_args)
    engine = LLMEngine(engine_args)
    tok = engine.tokenizer
    if args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}])
        prompt = {"prompt_token_ids": tok.encode(text, add_special_tokens=False)}
    else:
        prompt = args.prompt
    engine.add_request("generate", prompt, params)
    printed = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
    sys.stdout.write("\n")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from jserve.loaders.model_source import convert

    dst = convert(args.src, args.dst)
    log.info("wrote %s", dst)
    return 0


def _compile(args: argparse.Namespace) -> int:
    # Before JAX starts: compile-only devices need no accelerator, and none may be claimed.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jserve.aot.compiler import compile_engine
    from jserve.aot.host import measure_host
    from jserve.aot.targets import cpu_target, cuda_target, tpu_target
    from jserve.config.engine_args import engine_args_from_namespace
    from jserve.engine.setup import compilation_cache_dir
    from jserve.loaders.model_source import load_config

    engine_args = engine_args_from_namespace(args)
    if engine_args.gpu_memory_utilization is not None:  # it needs the weights on the chip
        raise ValueError(
            "jserve compile sizes the KV pool with --kv-cache-fraction (of each chip's memory) "
            "or --kv-cache-memory; drop --gpu-memory-utilization"
        )
    name, cfg = load_config(engine_args.model)
    if args.target == "tpu":
        target = tpu_target(args.topology)
    elif args.target == "cuda":
        target = cuda_target(args.gpu, engine_args.tensor_parallel_size)
    else:
        target = cpu_target()
    # Executables are written to the compilation cache only when a cache directory is named.
    named = engine_args.cache_dir or engine_args.compilation_cache_dir
    cache_dir = compilation_cache_dir(engine_args) if named else None
    report = compile_engine(
        engine_args, cfg, name, target, args.kv_cache_fraction, args.steps, cache_dir
    )
    if args.host_iterations:
        report.host = measure_host(report.block_size, report.max_model_len, args.host_iterations)
    sys.stdout.write(report.table())
    if args.report:
        report.write(args.report)
    for error in report.errors:
        print(f"jserve compile: {error}", file=sys.stderr)
    return 1 if report.errors else 0


def _step_buckets(text: str) -> list[tuple[int, int]]:
    """ "8x8,64x8" -> [(8, 8), (64, 8)]."""
    try:
        pairs = [tuple(int(n) for n in pair.split("x")) for pair in text.split(",")]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 for p in pairs):
        raise argparse.ArgumentTypeError(f"expected TOKENSxSEQS[,TOKENSxSEQS...], got {text!r}")
    return pairs


def _host_iterations(text: str) -> int:
    n = int(text)
    if n < 0 or n == 1:
        raise argparse.ArgumentTypeError(f"0 (no measurement) or at least 2, got {n}")
    return n


def _add_compile_command(sub: argparse._SubParsersAction) -> None:
    from jserve.aot.chips import GPUS, TPU_TOPOLOGIES

    comp = sub.add_parser(
        "compile",
        help="compile every executable the engine would run for a TPU slice or NVIDIA GPUs "
        "(no accelerator needed, no weights read) and report compile times, costs, memory, "
        "what fits and the host's scheduler cost beside the step; with --cache-dir or "
        "--compilation-cache-dir, also write the executables to that compilation cache for a "
        "server to load; exits 1 if anything fails to compile or does not fit",
    )
    comp.add_argument("--target", choices=["tpu", "cuda", "cpu"], required=True)
    comp.add_argument(
        "--topology", default="v5e:1x1", choices=TPU_TOPOLOGIES, help="TPU slice (--target tpu)"
    )
    comp.add_argument(
        "--gpu",
        default="h200",
        choices=GPUS,
        help="GPU (--target cuda); --tensor-parallel-size of them",
    )
    comp.add_argument(
        "--kv-cache-fraction", type=float, default=None,
        help="size the KV pool as this fraction of each chip's HBM (overrides --kv-cache-memory)",
    )  # fmt: skip
    comp.add_argument(
        "--steps", default=None, type=_step_buckets,
        help="only the model step of these buckets, TOKENSxSEQS comma-separated (e.g. 8x8,64x8),"
        " and no sampler: a quick check",
    )  # fmt: skip
    comp.add_argument(
        "--host-iterations", type=_host_iterations, default=1000,
        help="scheduler iterations to time at each host load (256 and 1,024 running decodes), "
        "set beside the estimated decode step; 0: no host measurement (default: %(default)s)",
    )  # fmt: skip
    comp.add_argument("--report", default=None, help="also write the report as JSON to this file")
    add_engine_arguments(comp)
    comp.set_defaults(func=_compile)


def add_library_commands(sub: argparse._SubParsersAction) -> None:
    """Add `generate` and `convert` (the engine without a server), `compile` (every step for a
    target, on compile-only devices) and `simulate` (the scheduler without a model).

    The `jserve` program itself (with `serve`) is assembled by `jserve.server.cli`, so this library
    never imports the app built on top of it.
    """
    gen = sub.add_parser("generate", help="stream one completion of PROMPT to standard output")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--request-seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    add_engine_arguments(gen)
    # One request: small buckets, so there is little to compile before it starts.
    gen.set_defaults(func=_generate, max_num_seqs=1, max_num_batched_tokens=256)

    conv = sub.add_parser("convert", help="write a model as a jserve (orbax) checkpoint directory")
    conv.add_argument("src", help="a .gguf file or model directory; 'default' for SmolLM2")
    conv.add_argument("dst", help="output directory")
    conv.set_defaults(func=_convert)
    _add_compile_command(sub)

    sim = sub.add_parser(
        "simulate",
        help="the real scheduler in virtual time, priced by a cost model: capacity and policy "
        "comparisons in seconds, no model",
        description=simulate_cli.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    simulate_cli.add_simulate_arguments(sim)
    sim.set_defaults(func=simulate_cli.run_simulate)


def run_command(args: argparse.Namespace) -> int:
    """Set up logging and run the parsed command; user errors exit 2 with one line."""
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not args.verbose:
        logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every file at INFO
    if args.command == "convert" and args.src == "default":
        args.src = None
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"jserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
