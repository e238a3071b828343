"""`python -m jserve.server --mock`: the server on the hand-computable mock engine (demos, tests).

The real model is served by `jserve serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from jserve.server.cli import add_serve_arguments, serve_main
from jserve.server.mock_engine import MockEngine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jserve.server", description=__doc__)
    parser.add_argument("--mock", action="store_true", required=True, help="serve the mock engine")
    parser.add_argument("--mock-token-delay", type=float, default=0.02, help="seconds per token")
    parser.add_argument(
        "--mock-start-delay", type=float, default=0.0, help="seconds the mock takes to 'load'"
    )
    add_serve_arguments(parser)
    args = parser.parse_args(argv)

    async def start_mock() -> MockEngine:
        await asyncio.sleep(args.mock_start_delay)
        return MockEngine(token_delay=args.mock_token_delay)

    return serve_main(args, start_mock)


if __name__ == "__main__":
    sys.exit(main())
