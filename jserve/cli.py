"""The library's commands of the `jserve` program: generate and convert (serve is the app's)."""

from __future__ import annotations

import argparse
import logging
import sys

from jserve.config.engine_args import add_engine_arguments

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


def add_library_commands(sub: argparse._SubParsersAction) -> None:
    """Add `generate` and `convert`: the commands that need the engine but no server.

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
