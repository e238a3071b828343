"""The `jserve` program: `serve` (this package) plus the library's `generate` and `convert`.

The app sits on top of the library, so the program is assembled here: `jserve.cli` knows
nothing of the server. `python -m jserve.server.cli ...` is the same program as `jserve ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from jserve.cli import add_library_commands, run_command
from jserve.config.engine_args import add_engine_arguments
from jserve.core.tenants import TenantLabels, load_tenant_policy
from jserve.server.app import DEFAULT_MAX_BODY_BYTES
from jserve.server.connections import (
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_KEEPALIVE_TIMEOUT,
    DEFAULT_MAX_HALF_OPEN,
)
from jserve.server.fleet import add_fleet_arguments, run_fleet
from jserve.server.runner import EngineFactory, run_server
from jserve.server.state import DEFAULT_BODY_TIMEOUT, DEFAULT_STREAM_IDLE_TIMEOUT

DEFAULT_MAX_TENANT_LABELS = 32


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The HTTP-side flags (the engine's own flags are added by the caller)."""
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    group.add_argument(
        "--port", type=int, default=8000, help="port to bind; 0 picks a free one (default: 8000)"
    )
    group.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every endpoint except /health and /metrics",
    )
    group.add_argument(
        "--served-model-name",
        default=None,
        help="model id clients send and /v1/models lists (default: the engine's model name)",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may take to finish after SIGTERM; then each still "
        "running is cut, its stream ending with an error event and [DONE] (default: 30)",
    )
    group.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies are refused with 413 (default: %(default)s)",
    )
    group.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT,
        help="seconds a new connection may take to send its first complete request head "
        "before it is closed (default: %(default)s)",
    )
    group.add_argument(
        "--keepalive-timeout",
        type=float,
        default=DEFAULT_KEEPALIVE_TIMEOUT,
        help="seconds an idle keep-alive connection stays open; keep it longer than clients' "
        "connection pools keep theirs, or they lose requests sent as it closes "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT,
        help="seconds a client may take to send a request body; a stalled body gets 408 "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--stream-idle-timeout",
        type=float,
        default=DEFAULT_STREAM_IDLE_TIMEOUT,
        help="seconds a streaming client may stop reading before its request is aborted and "
        "its KV freed; 0 = wait forever (default: %(default)s)",
    )
    group.add_argument(
        "--max-tenant-labels",
        type=int,
        default=DEFAULT_MAX_TENANT_LABELS,
        help="tenants (besides those of --tenants-file) with their own metric label; later "
        "ones are reported as 'other' (default: %(default)s)",
    )
    group.add_argument(
        "--max-half-open-connections",
        type=int,
        default=DEFAULT_MAX_HALF_OPEN,
        help="connections that have not yet sent a complete request head; further ones are "
        "closed at once (default: %(default)s)",
    )


def serve_main(args: argparse.Namespace, engine_factory: EngineFactory) -> int:
    """Serve until SIGTERM; returns the exit code (0 after a clean drain)."""
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    for flag in ("header_timeout", "keepalive_timeout", "body_timeout"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if args.stream_idle_timeout < 0:
        raise ValueError(f"--stream-idle-timeout must be >= 0, got {args.stream_idle_timeout}")
    if args.max_tenant_labels < 0:
        raise ValueError(f"--max-tenant-labels must be >= 0, got {args.max_tenant_labels}")
    # Read now, so a bad tenants file fails before the model loads (the engine reads it too).
    tenants = load_tenant_policy(getattr(args, "tenants_file", None)).tenants
    if args.max_half_open_connections < 1:
        raise ValueError(
            f"--max-half-open-connections must be >= 1, got {args.max_half_open_connections}"
        )
    _configure_logging()
    return asyncio.run(
        run_server(
            engine_factory,
            host=args.host,
            port=args.port,
            shutdown_timeout=args.shutdown_timeout,
            api_key=args.api_key,
            served_model_name=args.served_model_name,
            max_body_bytes=args.max_body_bytes,
            header_timeout=args.header_timeout,
            keepalive_timeout=args.keepalive_timeout,
            body_timeout=args.body_timeout,
            max_half_open=args.max_half_open_connections,
            stream_idle_timeout=args.stream_idle_timeout or None,
            tenant_labels=TenantLabels(tenants, args.max_tenant_labels),
        )
    )


def _serve(args: argparse.Namespace) -> int:
    from jserve.config.engine_args import engine_args_from_namespace
    from jserve.engine.async_engine import AsyncLLMEngine

    engine_args = engine_args_from_namespace(args)
    if engine_args.process_id > 0:  # a multi-process run's other processes serve no HTTP
        from jserve.engine.follower import run_follower

        _configure_logging()
        return run_follower(engine_args)
    return serve_main(args, lambda: AsyncLLMEngine.start(engine_args))


def _fleet(args: argparse.Namespace, serve_parser: argparse.ArgumentParser) -> int:
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    # Check the replicas' flags now, not once per replica after the fleet has started.
    serve_ns = serve_parser.parse_args(serve_args)
    return run_fleet(args, serve_args, serve_ns.block_size)


def _configure_logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


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
