"""Start-up, SIGTERM, Ctrl-C and engine death of a real server process
(`python -m jserve.server --mock`)."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
import time
from pathlib import Path

import aiohttp
import openai
import pytest
from server_harness import echo_text, parse_sse

from jserve.server.mock_engine import MockEngine
from jserve.server.runner import run_server
from jserve.server.settings import ServerSettings

REPO_ROOT = Path(__file__).resolve().parents[2]


# A server whose engine loads in a worker thread for ten minutes, as a real engine compiles.
SLOW_LOADER = """
import argparse, asyncio, sys, time
from jserve.server.cli import add_serve_arguments, serve_main
parser = argparse.ArgumentParser()
add_serve_arguments(parser)
async def load_for_ten_minutes():
    await asyncio.to_thread(time.sleep, 600)
sys.exit(serve_main(parser.parse_args(sys.argv[1:]), load_for_ten_minutes))
"""


async def _start(
    *flags: str, program: tuple[str, ...] = ("-m", "jserve.server", "--mock")
) -> tuple[asyncio.subprocess.Process, str]:
    """The server process and its base URL (it binds port 0 and logs the port it got)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *program, "--port", "0", *flags,
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


async def _until_ready(session: aiohttp.ClientSession, url: str) -> None:
    while (await _health(session, url))[0] != 200:
        await asyncio.sleep(0.05)


async def test_sigterm_during_a_stream_lets_it_finish_then_exits_0():
    proc, url = await _start("--mock-start-delay", "0.5", "--mock-token-delay", "0.02",
                             "--shutdown-timeout", "10")  # fmt: skip
    try:
        async with aiohttp.ClientSession() as session:
            assert await _health(session, url) == (503, {"status": "starting"})
            await _until_ready(session, url)
            body = {"prompt": "drain me", "max_tokens": 40, "stream": True}
            async with session.post(f"{url}/v1/completions", json=body) as response:
                first = await response.content.readuntil(b"\n\n")
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                # Still listening while it drains: /health tells load balancers to go away,
                # and new work is refused.
                async with aiohttp.ClientSession() as fresh:
                    assert await _health(fresh, url) == (503, {"status": "draining"})
                    async with fresh.post(f"{url}/v1/completions", json=body) as refused:
                        assert refused.status == 503
                        assert (await refused.json())["error"]["code"] == "shutting_down"
                rest = await response.content.read()
        events = parse_sse((first + rest).decode())
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == echo_text("drain me", 40)
        code, stderr = await _exit_code(proc, timeout=10)
        assert code == 0, stderr
        assert "jserve stopped" in stderr
    finally:
        if proc.returncode is None:
            proc.kill()


async def test_streams_past_the_shutdown_timeout_are_cut_with_an_error_event_then_done():
    proc, url = await _start("--mock-token-delay", "0.03", "--shutdown-timeout", "1.5")
    try:
        async with aiohttp.ClientSession() as session:
            await _until_ready(session, url)
            body = {"prompt": "too slow", "max_tokens": 200, "stream": True}  # ~6 s of tokens
            once = {"prompt": "too slow", "max_tokens": 200}
            async with session.post(f"{url}/v1/completions", json=body) as response:
                first = await response.content.readuntil(b"\n\n")
                plain = asyncio.create_task(session.post(f"{url}/v1/completions", json=once))
                await asyncio.sleep(0.2)  # the non-streaming one is under way too
                proc.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                rest = await response.content.read()
                cut_after = time.monotonic() - signalled
            events = parse_sse((first + rest).decode())
            async with await plain as unstreamed:
                assert unstreamed.status == 503
                assert (await unstreamed.json())["error"]["code"] == "shutting_down"
        # Cut at the timeout, not at twice it (aiohttp's own shutdown took 2x).
        assert 1.5 <= cut_after < 2.0, cut_after
        *chunks, error, done = events
        assert done == "[DONE]" and chunks
        assert error["error"]["code"] == "shutting_down", error
        assert "shut down before this request finished" in error["error"]["message"]
        code, stderr = await _exit_code(proc, timeout=5)
        assert code == 0, stderr
    finally:
        if proc.returncode is None:
            proc.kill()


async def test_the_openai_client_reads_a_cut_stream_as_an_error():
    proc, url = await _start("--mock-token-delay", "0.03", "--shutdown-timeout", "0.5")
    try:
        async with aiohttp.ClientSession() as session:
            await _until_ready(session, url)
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        stream = await client.completions.create(
            model="mock-model", prompt="cut me", max_tokens=200, stream=True
        )
        texts = []
        with pytest.raises(openai.APIError, match="shut down before this request finished"):
            async for chunk in stream:
                texts.append(chunk.choices[0].text)
                if len(texts) == 1:
                    proc.send_signal(signal.SIGTERM)
        text = "".join(texts)
        assert text and text == echo_text("cut me", len(text))
        code, stderr = await _exit_code(proc, timeout=5)
        assert code == 0, stderr
    finally:
        if proc.returncode is None:
            proc.kill()


async def test_a_second_sigint_cuts_in_flight_streams_at_once_and_exits_130():
    proc, url = await _start("--mock-token-delay", "0.1", "--shutdown-timeout", "30")
    try:
        async with aiohttp.ClientSession() as session:
            await _until_ready(session, url)
            body = {"prompt": "interrupt me", "max_tokens": 200, "stream": True}  # ~20 s
            async with session.post(f"{url}/v1/completions", json=body) as response:
                first = await response.content.readuntil(b"\n\n")
                proc.send_signal(signal.SIGINT)  # the first Ctrl-C drains
                await asyncio.sleep(0.5)
                assert await _health(session, url) == (503, {"status": "draining"})
                during = await response.content.readuntil(b"\n\n")  # still streaming
                proc.send_signal(signal.SIGINT)  # the second one cuts
                signalled = time.monotonic()
                rest = await response.content.read()
                cut_after = time.monotonic() - signalled
        events = parse_sse((first + during + rest).decode())
        *chunks, error, done = events
        assert done == "[DONE]" and len(chunks) >= 2
        assert error["error"]["code"] == "shutting_down", error
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert text == echo_text("interrupt me", len(text)) and len(text) < 200
        assert cut_after < 1.5, cut_after  # not the 30 s shutdown timeout
        code, stderr = await _exit_code(proc, timeout=5)
        assert code == 130, stderr
        assert "second SIGINT: cutting in-flight requests" in stderr
    finally:
        if proc.returncode is None:
            proc.kill()


async def test_a_stop_during_a_start_up_in_a_worker_thread_exits_at_once():
    proc, url = await _start(program=("-c", SLOW_LOADER))
    try:
        async with aiohttp.ClientSession() as session:
            assert await _health(session, url) == (503, {"status": "starting"})
        proc.send_signal(signal.SIGINT)
        code, stderr = await _exit_code(proc, timeout=10)  # not the ten minutes of loading
        assert code == 0, stderr
        assert "exiting without waiting for threads" in stderr
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

    assert await run_server(broken_factory, ServerSettings(port=0)) == 1


async def test_an_engine_that_dies_makes_the_server_exit_1():
    engine = MockEngine(token_delay=0.01)

    async def factory():
        return engine

    server = asyncio.create_task(run_server(factory, ServerSettings(port=0)))
    await asyncio.sleep(0.3)  # serving
    engine.kill("a step failed and the engine could not restart")
    assert await asyncio.wait_for(server, timeout=5) == 1
