"""I/O for bench.adversarial_phases: outcome tallies, HTTP and raw-socket senders, the leak check.

Every sender returns one outcome and never raises: "served" (2xx, a stream ending in [DONE]
without an error event), "4xx", "5xx" (or an error event in a stream), "closed" (the
connection ended as the phase intends: the client left, or the server cut a slow client), or
"lost" (no answer where one was due, a stream cut short, or a timeout: lost or hung).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import re
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import aiohttp

OUTCOMES = ("served", "4xx", "5xx", "closed", "lost")


@dataclass
class Tally:
    name: str
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    kv_leaked: str = ""  # what was still held after the phase, if anything
    greedy_ok: bool = True
    probe_ratio: float | None = None  # a greedy probe's worst latency during the phase / idle
    wrong: list[str] = field(default_factory=list)  # findings beyond the status codes
    notes: list[str] = field(default_factory=list)

    @property
    def sent(self) -> int:
        return sum(self.counts.values())

    def add(self, outcomes: list[str]) -> None:
        for outcome in outcomes:
            self.counts[outcome] += 1


def classify(status: int) -> str:
    return "served" if status < 300 else "4xx" if status < 500 else "5xx"


class Client:
    """Requests to one server (loopback), with its API key if it has one."""

    def __init__(self, base_url: str, api_key: str | None, session: aiohttp.ClientSession):
        self.base_url = base_url
        self.host, port = re.match(r"http://([^:/]+):(\d+)", base_url).groups()
        self.address = (self.host, int(port))
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        auth = f"Authorization: Bearer {api_key}\r\n".encode() if api_key else b""
        self.raw_head = (  # a raw POST head without its length, ready for more header lines
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n" + auth
        )
        self.session = session

    async def post(
        self, path: str, body: dict | bytes, *, timeout: float = 120.0, headers: dict | None = None
    ) -> str:
        outcome, _, _ = await self.post_read(path, body, timeout=timeout, headers=headers)
        return outcome

    async def post_read(
        self, path: str, body: dict | bytes, *, timeout: float = 120.0, headers: dict | None = None
    ) -> tuple[str, int, dict | None]:
        """(outcome, HTTP status or 0, the JSON body if it is one) of a POST."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        all_headers = {"Content-Type": "application/json", **self.headers, **(headers or {})}
        try:
            async with self.session.post(
                self.base_url + path, data=data, headers=all_headers,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as response:  # fmt: skip
                raw = await response.read()
                if response.status == 200 and raw.startswith(b"data: "):
                    return _stream_outcome(raw), response.status, None
                return classify(response.status), response.status, _json_or_none(raw)
        except (TimeoutError, aiohttp.ClientError):
            return "lost", 0, None

    async def stream_then_leave(self, body: dict, events: int) -> str:
        """Read `events` SSE events (0: none), then drop the connection."""
        try:
            async with self.session.post(
                self.base_url + "/v1/completions", json={**body, "stream": True},
                headers=self.headers, timeout=aiohttp.ClientTimeout(total=60),
            ) as response:  # fmt: skip
                if response.status != 200:
                    return classify(response.status)
                for _ in range(events):
                    await response.content.readuntil(b"\n\n")
                response.close()
                return "closed"
        except (TimeoutError, aiohttp.ClientError):
            return "lost"

    async def leave_after(self, body: dict, seconds: float) -> str:
        """A non-streaming request the client cancels after `seconds`."""
        outcome = await self.post("/v1/completions", body, timeout=seconds)
        return "closed" if outcome == "lost" else outcome

    async def get_text(self, path: str) -> str:
        async with self.session.get(self.base_url + path, headers=self.headers) as response:
            return await response.text()

    async def health_latency(self) -> float:
        start = time.monotonic()
        async with self.session.get(self.base_url + "/health") as response:
            await response.read()
        return time.monotonic() - start

    async def greedy_text(self, body: dict) -> str | None:
        try:
            async with self.session.post(
                self.base_url + "/v1/completions", json=body, headers=self.headers
            ) as response:
                return (await response.json())["choices"][0]["text"]
        except (aiohttp.ClientError, KeyError, ValueError):
            return None

    async def leaked(self, settle_s: float = 10.0) -> str:
        """ "" if running and waiting requests and KV usage return to 0 within settle_s, else
        what they still were."""
        deadline = time.monotonic() + settle_s
        names = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        while True:
            text = await self.get_text("/metrics")
            values = {name: _metric(text, f"jserve:{name}") for name in names}
            if not any(values.values()):
                return ""
            if time.monotonic() > deadline:
                return " ".join(f"{name}={value:g}" for name, value in values.items())
            await asyncio.sleep(0.1)

    async def raw(self, data: bytes, *, gap: float = 0.0, timeout: float = 30.0) -> str:
        """Send raw bytes (one byte per `gap` s if gap > 0); the outcome of what comes back."""
        try:
            reader, writer = await asyncio.open_connection(*self.address)
        except OSError:
            return "lost"
        try:
            async with asyncio.timeout(timeout):
                chunks = [data[i : i + 1] for i in range(len(data))] if gap else [data]
                for chunk in chunks:
                    writer.write(chunk)
                    await writer.drain()
                    if gap:
                        try:
                            async with asyncio.timeout(gap):
                                if await reader.read(1) == b"":
                                    return "closed"
                        except TimeoutError:
                            pass
                head = await reader.readuntil(b"\r\n\r\n")
                return classify(int(head.split(b" ", 2)[1]))
        except asyncio.IncompleteReadError as e:  # closed by the server without an answer
            return "closed" if not e.partial else "lost"
        except ConnectionError:
            return "closed"
        except TimeoutError:
            return "lost"  # hung: neither an answer nor a close in time
        finally:
            writer.close()


def _json_or_none(raw: bytes) -> dict | None:
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def _stream_outcome(raw: bytes) -> str:
    if not raw.rstrip().endswith(b"data: [DONE]"):
        return "lost"
    return "5xx" if b'"error"' in raw else "served"


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


class ProbeProcess:
    """The greedy probe, sent again and again from a process of its own until the block ends;
    `latencies` then holds each answer's seconds. In its own process, the phase's senders
    (encoding megabytes of JSON, opening hundreds of sockets) cannot hold the probe's event
    loop or the GIL: only the server's answer times it."""

    def __init__(self, base_url: str, api_key: str | None, body: dict):
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_probe_loop, args=(base_url, api_key, body, child), daemon=True
        )
        self.latencies: list[float] = []

    async def __aenter__(self) -> ProbeProcess:
        self._process.start()
        await asyncio.to_thread(self._conn.recv)  # connected, and its first answer came
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._conn.send("stop")
        self.latencies = await asyncio.to_thread(self._conn.recv)
        await asyncio.to_thread(self._process.join, 30)


def _probe_loop(base_url: str, api_key: str | None, body: dict, conn: Connection) -> None:
    async def loop() -> None:
        async with aiohttp.ClientSession() as session:
            client = Client(base_url, api_key, session)
            await client.greedy_text(body)
            conn.send("ready")
            latencies = []
            while not conn.poll():
                start = time.monotonic()
                await client.greedy_text(body)
                latencies.append(time.monotonic() - start)
            conn.send(latencies)

    asyncio.run(loop())
