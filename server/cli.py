"""The `jserve` program: `serve` (this package) plus the library's `generate` and `convert`.

The app sits on top of the library, so the program is assembled here: `jserve.cli` knows
nothing of the server. `python -m jserve.server ...` (and `python -m jserve.server.cli ...`) is
the same program as `jserve ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import threading
import time

from jserve.cli import add_library_commands, run_command
from jserve.config.engine_args import add_engine_arguments
from jserve.config.settings import add_flags, from_namespace
from jserve.core.tenants import load_tenant_policy
from jserve.sampling_params import SamplingParams
from jserve.server.fleet import add_fleet_arguments, run_fleet
from jserve.server.generation_config import sampling_defaults
from jserve.server.runner import EngineFactory, run_server
from jserve.server.settings import LogLevel, ServerSettings
from jserve.server.vllm_flags import add_vllm_flags, take_model_tag

_THREAD_GRACE_SECONDS = 1.0  # for idle worker threads to end once the loop has closed


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The HTTP server's flags, one per ServerSettings field (the engine's own flags are
    added by the caller)."""
    add_flags(parser.add_argument_group("server"), ServerSettings)


def serve_main(args: argparse.Namespace, engine_factory: EngineFactory) -> int:
    """Serve until SIGTERM or SIGINT; returns the exit code: 0 after a clean drain, 130 when
    a second SIGINT cut it short, 1 when the engine failed (jserve.server.runner)."""
    settings = from_namespace(ServerSettings, args)
    # Read now, so a bad tenants file fails before the model loads (the engine reads it too).
    tenants = load_tenant_policy(getattr(args, "tenants_file", None)).tenants
    defaults = sampling_defaults(settings.generation_config, getattr(args, "model", None))
    SamplingParams(**defaults)  # a bad value in the file fails here, not in every request
    _configure_logging(settings.log_level, getattr(args, "verbose", False))
    loop = asyncio.new_event_loop()
    try:
        code = loop.run_until_complete(
            run_server(engine_factory, settings, tenants=tenants, sampling_defaults=defaults)
        )
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()  # unlike asyncio.run, this does not wait for the loop's worker threads
    _exit_now_if_threads_linger(code)
    return code


def _exit_now_if_threads_linger(code: int) -> None:
    """End the process at once with `code` if a worker thread is still busy a moment after
    the server stopped: an engine stopped while it was loading compiles on until it is done,
    and the interpreter would wait for it before exiting."""
    others = [
        t for t in threading.enumerate() if not t.daemon and t is not threading.current_thread()
    ]
    deadline = time.monotonic() + _THREAD_GRACE_SECONDS
    for thread in others:
        thread.join(max(0.0, deadline - time.monotonic()))
    busy = [t.name for t in others if t.is_alive()]
    if busy:
        logging.getLogger(__name__).warning("exiting without waiting for threads %s", busy)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve(args: argparse.Namespace) -> int:
    from jserve.config.engine_args import engine_args_from_namespace
    from jserve.engine.async_engine import AsyncLLMEngine

    take_model_tag(args)
    engine_args = engine_args_from_namespace(args)
    if engine_args.process_id > 0:  # a multi-process run's other processes serve no HTTP
        from jserve.engine.follower import run_follower

        _configure_logging(LogLevel.INFO, args.verbose)
        return run_follower(engine_args)
    return serve_main(args, lambda: AsyncLLMEngine.start(engine_args))


def _fleet(args: argparse.Namespace, serve_parser: argparse.ArgumentParser) -> int:
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    # Check the replicas' flags now, not once per replica after the fleet has started.
    serve_ns = serve_parser.parse_args(serve_args)
    take_model_tag(serve_ns)
    return run_fleet(args, serve_args, serve_ns.block_size)


def _configure_logging(level: LogLevel, verbose: bool) -> None:
    """Log at `level` (--uvicorn-log-level; trace is debug), or debug with -v."""
    name = "DEBUG" if verbose or level == LogLevel.TRACE else level.upper()
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jserve", description="A JAX/XLA LLM inference engine and OpenAI-compatible server."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    add_library_commands(sub)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_arguments(serve)
    add_serve_arguments(serve)
    add_vllm_flags(serve)
    serve.set_defaults(func=_serve)
    fleet = sub.add_parser(
        "fleet",
        help="serve N replicas behind a router (smg or vllm-router): jserve fleet --replicas 2 "
        "--policy cache_aware -- SERVE_FLAGS",
    )
    add_fleet_arguments(fleet)
    fleet.set_defaults(func=lambda args: _fleet(args, serve))
    return parser


def main(argv: list[str] | None = None) -> int:
    """The `jserve` console script."""
    return run_command(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
