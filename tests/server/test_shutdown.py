"""Start-up and SIGTERM on a real server process (`python -m server --mock`) on a loopback port."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import sys
from pathlib import Path

import aiohttp
import pytest
from server_harness import echo_text, parse_sse

from server.runner import run_server

REPO_ROOT = Path(__file__).resolve().parents[2]


async def _start(*flags: str) -> tuple[asyncio.subprocess.Process, str]:
    """The server process and its base URL (it binds port 0 and logs the port it got)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "server", "--mock", "--port", "0", *flags,
        cwd=REPO_ROOT, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    while True:
        line = (await asyncio.wait_for(proc.stderr.readline(), timeout=20)).decode()
        assert line, f"server exited before listening (rc {await proc.wait()})"
        found = re.search(r"listening on (http://\S+)", line)
        if found:
            return proc, found.group(1)


async def _exit_code(proc: asyncio.subprocess.Process, timeout: float) -> tuple[int, str]:
    _, stderr = await asyncio.wait_for(proc.communicate(), timeout=timeout)
    return proc.returncode, stderr.decode()


async def _health(session: aiohttp.ClientSession, url: str) -> tuple[int, dict]:
    async with session.get(f"{url}/health") as response:
        return response.status, await response.json()


async def test_sigterm_during_a_stream_lets_it_finish_then_exits_0():
    proc, url = await _start("--mock-start-delay", "0.5", "--mock-token-delay", "0.02",
                             "--shutdown-timeout", "10")  # fmt: skip
    try:
        async with aiohttp.ClientSession() as session:
            assert await _health(session, url) == (503, {"status": "starting"})
            while (await _health(session, url))[0] != 200:
                await asyncio.sleep(0.05)
            body = {"prompt": "drain me", "max_tokens": 40, "stream": True}
            async with session.post(f"{url}/v1/completions", json=body) as response:
                first = await response.content.readuntil(b"\n\n")
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                with pytest.raises(aiohttp.ClientConnectionError):  # no longer listening
                    async with aiohttp.ClientSession() as fresh:
                        await fresh.get(f"{url}/health")
                rest = await response.content.read()
        events = parse_sse((first + rest).decode())
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == echo_text("drain me", 40)
        code, stderr = await _exit_code(proc, timeout=10)
        assert code == 0, stderr
        assert "jserve stopped" in stderr
    finally:
        if proc.returncode is None:
            proc.kill()


async def test_streams_past_the_shutdown_timeout_are_cut_and_the_process_still_exits_0():
    proc, url = await _start("--mock-token-delay", "0.02", "--shutdown-timeout", "0.3")
    try:
        async with aiohttp.ClientSession() as session:
            while (await _health(session, url))[0] != 200:
                await asyncio.sleep(0.05)
            body = {"prompt": "too slow", "max_tokens": 200, "stream": True}  # ~4 s of tokens
            async with session.post(f"{url}/v1/completions", json=body) as response:
                await response.content.readuntil(b"\n\n")
                proc.send_signal(signal.SIGTERM)
                received = b""
                # The connection is closed mid-stream, as it should be.
                with contextlib.suppress(aiohttp.ClientPayloadError):
                    received = await response.content.read()
        assert b"[DONE]" not in received
        code, stderr = await _exit_code(proc, timeout=5)
        assert code == 0, stderr
    finally:
        if proc.returncode is None:
            proc.kill()


async def test_sigterm_while_the_engine_is_still_starting_exits_0():
    proc, url = await _start("--mock-start-delay", "60")
    try:
        async with aiohttp.ClientSession() as session:
            assert await _health(session, url) == (503, {"status": "starting"})
        proc.send_signal(signal.SIGTERM)
        code, stderr = await _exit_code(proc, timeout=5)
        assert code == 0, stderr
    finally:
        if proc.returncode is None:
            proc.kill()


async def test_an_engine_that_fails_to_start_exits_1():
    async def broken_factory():
        raise FileNotFoundError("no model at /nowhere.gguf")

    assert await run_server(broken_factory, port=0) == 1
