"""`python -m jserve.server ARGS` is the `jserve` program (`jserve ARGS`, e.g. `serve`).

With `--mock` it serves the hand-computable mock engine instead (demos, tests, benchmarks of
the server alone), taking the server's flags and the mock's own:

    python -m jserve.server --mock [--mock-token-delay S] [--mock-start-delay S] [SERVER FLAGS]
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from jserve.server import cli
from jserve.server.mock_engine import MockEngine


def serve_mock(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jserve.server --mock", description="Serve the mock engine."
    )
    parser.add_argument("--mock", action="store_true", required=True, help="serve the mock engine")
    parser.add_argument("--mock-token-delay", type=float, default=0.02, help="seconds per token")
    parser.add_argument(
        "--mock-start-delay", type=float, default=0.0, help="seconds the mock takes to 'load'"
    )
    cli.add_serve_arguments(parser)
    args = parser.parse_args(argv)

    async def start_mock() -> MockEngine:
        await asyncio.sleep(args.mock_start_delay)
        return MockEngine(token_delay=args.mock_token_delay)

    return cli.serve_main(args, start_mock)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return serve_mock(argv) if "--mock" in argv else cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
