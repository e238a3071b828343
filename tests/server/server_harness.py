"""Helpers for the server tests: an in-process server on the mock, SSE parsing, metric reading,
and the mock's output computed independently of the mock's code."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator

from aiohttp.test_utils import TestClient, TestServer

from jserve.server.app import create_app
from jserve.server.engine_client import EngineClient
from jserve.server.runner import start_listening
from jserve.server.settings import ServerSettings


@contextlib.asynccontextmanager
async def serve(engine: EngineClient | None, **settings) -> AsyncIterator[TestClient]:
    """A client of the app, made with these ServerSettings, served on a loopback port
    (TestServer uses handler_cancellation)."""
    async with TestClient(TestServer(create_app(engine, ServerSettings(**settings)))) as client:
        yield client


def echo_text(prompt: str, num_tokens: int, choice: int = 0) -> str:
    """What the mock generates: the prompt repeated, choice j starting j characters in."""
    return "".join(prompt[(choice + k) % len(prompt)] for k in range(num_tokens))


def chat_prompt(messages: list[dict]) -> str:
    """The mock tokenizer's chat template, written out."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def parse_sse(raw: str) -> list[dict | str]:
    """Events of an SSE body; asserts the framing ("data: ...\\n\\n", ending in [DONE])."""
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    events: list[dict | str] = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events.count("[DONE]") == 1
    return events


async def stream_events(client: TestClient, path: str, body: dict) -> list[dict | str]:
    response = await client.post(path, json={**body, "stream": True})
    assert response.status == 200, await response.text()
    assert response.headers["Content-Type"].startswith("text/event-stream")
    return parse_sse(await response.text())


def metric(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in Prometheus text format (0 if absent)."""
    pattern = re.escape(name + (f"{{{labels}}}" if labels else "")) + r" ([0-9.e+-]+)$"
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def metric_sum(text: str, name: str) -> float:
    """The sum of one metric over all its label sets."""
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
    return sum(float(v) for v in values)


@contextlib.asynccontextmanager
async def serve_guarded(engine: EngineClient | None, **settings) -> AsyncIterator[tuple[str, int]]:
    """(host, port) of the app, made with these ServerSettings, served as run_server serves
    it: through the guarded handler, on a free loopback port."""
    server_settings = ServerSettings(host="127.0.0.1", port=0, **settings)
    runner, listener = await start_listening(create_app(engine, server_settings), server_settings)
    try:
        yield listener.sockets[0].getsockname()[:2]
    finally:
        listener.close()
        await runner.cleanup()


async def raw_exchange(address: tuple[str, int], data: bytes, timeout: float = 5.0) -> bytes:
    """Send raw bytes on a fresh connection; the one response to them (b"" if the server
    closed without one)."""
    reader, writer = await asyncio.open_connection(*address)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(timeout):
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as e:
                return e.partial
            length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
            return head + await reader.readexactly(int(length.group(1)) if length else 0)
    finally:
        writer.close()


def parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """(status, headers with lower-case names, body) of one raw HTTP/1.1 response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in header_lines)
    return int(status_line.split()[1]), {k.lower(): v for k, v in headers.items()}, body
