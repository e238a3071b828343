"""Clients that misbehave below the JSON layer: bad framing, huge headers, odd encodings, slow
or stalled sends, half-open floods. Served as run_server serves (the guarded handler)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time

import aiohttp
import pytest
from server_harness import parse_response, raw_exchange, serve_guarded

from jserve.server.mock_engine import CharTokenizer, MockEngine
from jserve.server.state import STATE, ServerState, read_body

POST = (
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    b"Content-Type: application/json\r\n"
)


def _json_error(raw: bytes, status: int) -> dict:
    got, headers, body = parse_response(raw)
    assert got == status, raw[:300]
    assert headers["content-type"].startswith("application/json"), headers
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


async def test_aiohttps_own_errors_are_json_and_echo_nothing():
    secret = b"SECRET-" * 2000  # one header line far over aiohttp's 8190-byte limit
    cases = [
        # (raw request, status, a fragment of the message, the header at fault)
        (POST + b"Content-Length: abc\r\n\r\n", 400, "malformed HTTP request", None),
        (POST + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400,
         "malformed HTTP request", None),  # a request-smuggling shape
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + secret + b"\r\n\r\n", 431,
         "too long", None),
        (POST + b"Content-Encoding: br\r\nContent-Length: 4\r\n\r\nabcd", 400,
         "Content-Encoding is not supported", "Content-Encoding"),
    ]  # fmt: skip
    async with serve_guarded(MockEngine()) as address:
        for raw, status, fragment, param in cases:
            response = await raw_exchange(address, raw)
            assert b"SECRET" not in response
            error = _json_error(response, status)
            assert fragment in error["message"] and error["param"] == param, response[:300]


async def test_a_gzip_body_that_does_not_decompress_is_400():
    body = b"this is not gzip data"
    raw = POST + b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    async with serve_guarded(MockEngine()) as address:
        error = _json_error(await raw_exchange(address, raw), 400)
    assert error["message"] == "the request body could not be decoded: ContentEncodingError"


async def test_a_non_utf8_authorization_header_is_401_not_500():
    body = b'{"prompt": "a"}'
    raw = (
        POST
        + b"Authorization: Bearer \xff\xfe\x80\r\nContent-Length: %d\r\n\r\n" % len(body)
        + body
    )
    async with serve_guarded(MockEngine(), api_key="sekret") as address:
        error = _json_error(await raw_exchange(address, raw), 401)
    assert error["code"] == "invalid_api_key"


async def test_a_stalled_body_gets_408_within_the_body_timeout():
    raw = POST + b"Content-Length: 100\r\n\r\n" + b'{"prompt": '  # 89 bytes never come
    async with serve_guarded(MockEngine(), body_timeout=0.5) as address:
        start = time.monotonic()
        error = _json_error(await raw_exchange(address, raw), 408)
        elapsed = time.monotonic() - start
    assert 0.5 <= elapsed < 1.5, elapsed
    assert (error["code"], error["message"]) == (
        "request_timeout",
        "the request body did not arrive within 0.5 s",
    )


async def _trickle(address: tuple[str, int], head: bytes, gap: float) -> float:
    """Send `head` a byte every `gap` s; seconds until the server closes the connection."""
    reader, writer = await asyncio.open_connection(*address)
    start = time.monotonic()
    try:
        for byte in head:
            writer.write(bytes([byte]))
            await writer.drain()
            try:
                if await asyncio.wait_for(reader.read(1), gap) == b"":
                    break  # closed by the server
            except TimeoutError:
                continue
        return time.monotonic() - start
    except ConnectionError:
        return time.monotonic() - start
    finally:
        writer.close()


async def test_trickled_headers_are_cut_at_the_header_timeout_and_health_stays_fast():
    head = POST + b"X-Slow: " + b"a" * 200 + b"\r\n\r\n"
    async with serve_guarded(MockEngine(), header_timeout=1.0) as address:
        url = f"http://{address[0]}:{address[1]}/health"
        trickles = [asyncio.create_task(_trickle(address, head, 0.05)) for _ in range(20)]
        await asyncio.sleep(0.3)
        async with aiohttp.ClientSession() as session:
            start = time.monotonic()
            async with session.get(url) as response:
                assert response.status == 200
            assert time.monotonic() - start < 0.3
        closed_after = await asyncio.gather(*trickles)
    assert all(0.95 <= t < 1.6 for t in closed_after), closed_after  # timer starts at accept


async def test_a_new_connection_past_the_half_open_cap_evicts_the_oldest():
    async with serve_guarded(MockEngine(), max_half_open_connections=5) as address:
        idle = []
        for _ in range(5):
            idle.append(await asyncio.open_connection(*address))
            await asyncio.sleep(0.02)  # in order, oldest first
        served = await raw_exchange(
            address, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        assert parse_response(served)[0] == 200
        oldest, *others = (reader for reader, _ in idle)
        assert await asyncio.wait_for(oldest.read(), 0.5) == b""  # closed by the server
        for reader in others:  # still open: reading times out
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(reader.read(), 0.05)
                raise AssertionError("a younger half-open connection was closed")
        for _, writer in idle:
            writer.close()


class _SlowTokenizer(CharTokenizer):
    """Tokenizing takes a second (as 4 MB of text does with the real tokenizer)."""

    calls = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        _SlowTokenizer.calls += 1
        time.sleep(1.0)
        return super().encode(text, add_special_tokens)


async def test_tokenizing_runs_off_the_event_loop_after_the_body_limit():
    engine = MockEngine(token_delay=0.001)
    engine.tokenizer = _SlowTokenizer()
    async with serve_guarded(engine, max_body_bytes=1000) as address:
        base = f"http://{address[0]}:{address[1]}"
        async with aiohttp.ClientSession() as session:
            too_big = {"prompt": "x" * 2000}
            async with session.post(f"{base}/v1/completions", json=too_big) as response:
                assert response.status == 413
            assert _SlowTokenizer.calls == 0  # refused before any tokenizing
            slow = asyncio.create_task(
                session.post(f"{base}/v1/completions", json={"prompt": "abc", "max_tokens": 2})
            )
            await asyncio.sleep(0.2)  # it is tokenizing now
            start = time.monotonic()
            async with session.get(f"{base}/health") as response:
                assert response.status == 200
            assert time.monotonic() - start < 0.3
            async with await slow as response:
                assert (await response.json())["choices"][0]["text"] == "ab"
    assert _SlowTokenizer.calls == 1


class _BodyArriving:
    """A request whose body comes in one loop turn after the read starts."""

    def __init__(self) -> None:
        self.app = {STATE: ServerState(None)}

    async def read(self) -> bytes:
        await asyncio.sleep(0)
        return b'{"prompt": "a"}'


@pytest.mark.parametrize("turns", range(5))
async def test_a_client_leaving_as_its_body_arrives_still_cancels_the_handler(turns):
    # A cancel (the client left) landing in the loop turn where the read completes was
    # swallowed by asyncio.wait_for on Python 3.11: the abandoned request then ran to its end,
    # holding KV blocks for nobody (seen once in bench.adversarial_phases' disconnect storm).
    task = asyncio.create_task(read_body(_BodyArriving()))
    for _ in range(turns):
        await asyncio.sleep(0)
    if task.cancel():  # still running: the cancellation must win
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_an_idle_keepalive_connection_outlives_the_header_timeout():
    # Closing idle connections at the header timeout lost requests of clients that reused a
    # pooled connection just as it closed (30 of a 200-request burst in bench.adversarial_phases).
    get = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    async with serve_guarded(MockEngine(), header_timeout=0.3, keepalive_timeout=5) as address:
        reader, writer = await asyncio.open_connection(*address)
        try:
            for _ in range(2):
                writer.write(get)
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
                assert head.startswith(b"HTTP/1.1 200"), head
                await reader.readexactly(int(re.search(rb"Content-Length: (\d+)", head)[1]))
                await asyncio.sleep(0.6)  # idle for twice the header timeout
        finally:
            writer.close()
