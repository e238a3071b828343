"""Rerun the adversarial phases against a `jserve serve` on loopback and print a table.

    python -m bench.adversarial_phases --url http://127.0.0.1:8000 [--api-key KEY]
    python -m bench.adversarial_phases --start        # starts its own server (short timeouts)

Per phase: requests sent, served (2xx), 4xx, 5xx, closed (as the phase intends: the client
left, or the server cut a slow client), lost or hung; whether KV usage and running/waiting
requests went back to 0 afterwards (read from /metrics); whether a fixed greedy request
still gives the text it gave before the first phase; the worst latency of that request, sent
again and again from a process of its own while the phase runs, over its idle latency ("probe
x idle": a phase that stalls other tenants shows here); and findings beyond status codes
(bench.adversarial_inputs: unbounded error bodies, non-JSON admin answers, tool-call markup in
content). Every phase is
bounded in count and time. The first phases are the first adversarial round's (bad inputs,
bursts, disconnects, slow clients, framing); bench.adversarial_inputs holds the second's.
SIGTERM is not a phase (it ends the server): tests/server/test_shutdown.py covers it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

from bench import adversarial_inputs
from bench.adversarial_client import Client, ProbeProcess, Tally
from bench.report_writer import text_table

GREEDY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
OK = {"prompt": "Hello, my name is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
_BAD_VALUES = {
    "prompt": ["", [], [-1], [49152], [2**31], [[1], [2]], {"a": 1}, 5, [1.5], ["a", 1], None],
    "max_tokens": [0, -1, 2**31, 10**30, "ten", 1.5, True],
    "min_tokens": [-1, 2**31, 100],
    "n": [0, -1, 500, 1000, 2**31, True],
    "temperature": [-1, "hot", 1e39, -1e-9],
    "top_p": [0, -0.5, 1.5, 1e-300],
    "top_k": [-2, 2**31, 1.5],
    "min_p": [-0.1, 1.1],
    "presence_penalty": [3, -2.5],
    "frequency_penalty": [2.5, 1e39],
    "repetition_penalty": [0, 1e-300, 2.5, -1],
    "seed": [2**64, 1.5, "x"],
    "logprobs": [21, -1, 2**31],
    "stop": [[1], "", [""], {"a": 1}],
    "stop_token_ids": [[2147483648], [49152], [-1], ["x"], 5],
    "logit_bias": [{"1": 5}, {"99999999999": 1}],
    "priority": ["vip", 3],
    "timeout": [0, -1, "soon"],
    "stream_options": [{"include_usage": True}],
    "echo": ["yes"],
    "prompt_logprobs": [-1, 10**6],
    "best_of": [3],
}
_RAW_BAD = [
    b"{not json", b"[1, 2]", b'{"prompt": "a", "temperature": NaN}', b'{"prompt": "\xff"}',
    b'{"prompt": "Hi", "temperature": 1e400}',
    b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
]  # fmt: skip
_CHAT_BAD = [[], [{"content": "hi"}], [{"role": "user", "content": 5}],
             [{"role": "user", "content": [{"type": "image_url"}]}], "hi"]  # fmt: skip


def _framing(head: bytes) -> list[bytes]:
    """Requests aiohttp itself must refuse (or parse safely): bad framing, smuggling shapes."""
    return [
        head + b"Content-Length: abc\r\n\r\n",
        head + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        head + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
        head + b"Content-Encoding: br\r\nContent-Length: 4\r\n\r\nabcd",
        head + b"Content-Encoding: gzip\r\nContent-Length: 9\r\n\r\nnot gzip!",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
        b'Content-Length: 15\r\n\r\n{"prompt": "a"}',
        b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n\r\n"
        b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40,  # a TLS hello
    ]


async def bad_inputs(client: Client, tally: Tally, opts: argparse.Namespace) -> list[str]:
    sends = [client.post("/v1/completions", {"prompt": "Hi", "max_tokens": 4, name: value})
             for name, values in _BAD_VALUES.items() for value in values]  # fmt: skip
    sends += [client.post("/v1/completions", raw) for raw in _RAW_BAD]
    sends += [client.post("/v1/chat/completions", {"messages": m}) for m in _CHAT_BAD]
    sends += [client.post("/detokenize", {"tokens": t}) for t in ([2**70], [49152], [-1], "x")]
    sends += [client.post("/tokenize", {"text": "no prompt"})]
    return [await send for send in sends]  # one at a time, as a fuzzing client would


def burst(size: int) -> Callable[..., Awaitable[list[str]]]:
    async def phase(client: Client, tally: Tally, opts: argparse.Namespace) -> list[str]:
        bodies = [{**OK, "prompt": f"Item {i}: the best thing about {i} is", "stream": i % 2 == 0}
                  for i in range(size)]  # fmt: skip
        return await asyncio.gather(*(client.post("/v1/completions", b) for b in bodies))

    return phase


async def n_fairness(client: Client, tally: Tally, opts: argparse.Namespace) -> list[str]:
    refused = [await client.post("/v1/completions", {**OK, "n": n}) for n in (500, 1000)]
    big = client.post("/v1/completions", {**OK, "n": opts.max_n, "temperature": 1.0})
    others = [client.post("/v1/completions", {**OK, "prompt": f"Q{i}:"}) for i in range(16)]
    return refused + list(await asyncio.gather(big, *others))


async def disconnects(client: Client, tally: Tally, opts: argparse.Namespace) -> list[str]:
    long = {**OK, "max_tokens": 200}
    streams = [client.stream_then_leave(long, events=i % 3) for i in range(64)]
    cancels = [client.leave_after(long, 0.1 + 0.02 * i) for i in range(64)]
    return await asyncio.gather(*streams, *cancels)


async def long_prompts(client: Client, tally: Tally, opts: argparse.Namespace) -> list[str]:
    text = "word " * (3_900_000 // 5)  # 3.9 MB: under the 4 MiB body limit, over the context
    sends = [client.post("/v1/completions", {"prompt": text}) for _ in range(4)]
    sends.append(client.post("/v1/completions", {"prompt": "x" * 5_000_000}))  # over: 413
    return await _with_health_watch(client, tally, asyncio.gather(*sends))


async def slow_headers(client: Client, tally: Tally, opts: argparse.Namespace) -> list[str]:
    head = client.raw_head + b"X-Slow: " + b"a" * 200 + b"\r\n\r\n"  # 0.25 s a byte: long
    limit = opts.header_timeout + 5
    trickles = [client.raw(head, gap=0.25, timeout=limit) for _ in range(100)]
    return await _with_health_watch(client, tally, asyncio.gather(*trickles))


async def half_open_flood(client: Client, tally: Tally, opts: argparse.Namespace) -> list[str]:
    idle = [client.raw(b"", timeout=opts.header_timeout + 5) for _ in range(200)]
    return await asyncio.gather(*idle)


async def stalled_bodies(client: Client, tally: Tally, opts: argparse.Namespace) -> list[str]:
    stalled = client.raw_head + b"Content-Length: 100\r\n\r\n" + b'{"prompt": '
    sends = [client.raw(stalled, timeout=opts.body_timeout + 5) for _ in range(20)]
    return await asyncio.gather(*sends)


async def headers_and_framing(client: Client, tally: Tally, opts: argparse.Namespace) -> list[str]:
    big = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"SECRET" * 3000 + b"\r\n\r\n"
    sends = [client.raw(big) for _ in range(20)]
    return await asyncio.gather(*sends, *(client.raw(raw) for raw in _framing(client.raw_head)))


async def auth(client: Client, tally: Tally, opts: argparse.Namespace) -> list[str]:
    keys = ["", "Bearer wrong", "wrong", "Bearer " + "k" * 10_000, "Bearer \u00e9"]
    sends = [client.post("/v1/completions", OK, headers={"Authorization": k}) for k in keys]
    return await asyncio.gather(*sends)


async def _with_health_watch(client: Client, tally: Tally, work: Awaitable) -> list[str]:
    """Run `work` while timing /health every 50 ms; notes the slowest answer."""
    task = asyncio.ensure_future(work)
    worst = 0.0
    while not task.done():
        worst = max(worst, await client.health_latency())
        await asyncio.sleep(0.05)
    tally.notes.append(f"/health max {worst:.2f}s")
    return await task


async def run(opts: argparse.Namespace) -> list[Tally]:
    phases = [("bad inputs", bad_inputs), ("burst of 64", burst(64)),
              ("burst of 200", burst(200)), ("n fairness", n_fairness),
              ("disconnect+cancel storm", disconnects), ("long prompts", long_prompts),
              ("slow headers x100", slow_headers), ("half-open flood x200", half_open_flood),
              ("stalled bodies x20", stalled_bodies),
              ("big headers, framing", headers_and_framing),
              *adversarial_inputs.PHASES]  # fmt: skip
    if opts.api_key:
        phases.append(("auth", auth))
    phases = [(name, phase) for name, phase in phases if opts.only in name]
    opts.storm_seed = 0
    tallies = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        client = Client(opts.url, opts.api_key, session)
        known = await client.greedy_text(GREEDY)
        idle = await _idle_latency(opts)
        print(f"greedy reference: {known!r}, idle {idle:.3f} s", file=sys.stderr)
        for name, phase in phases:
            print(f"phase: {name}", file=sys.stderr)
            tally = await _run_phase(client, Tally(name), phase, opts, idle)
            tally.kv_leaked = await client.leaked()
            if tally.kv_leaked:
                tally.notes.append(f"after 10 s: {tally.kv_leaked}")
            tally.greedy_ok = known is not None and await client.greedy_text(GREEDY) == known
            tallies.append(tally)
    return tallies


async def _idle_latency(opts: argparse.Namespace) -> float:
    """The greedy probe's median latency with nothing else running."""
    async with ProbeProcess(opts.url, opts.api_key, GREEDY) as probe:
        await asyncio.sleep(1.0)
    return statistics.median(probe.latencies)


async def _run_phase(
    client: Client, tally: Tally, phase: Callable, opts: argparse.Namespace, idle: float
) -> Tally:
    """Run one phase with the greedy probe beside it; its slowest answer over `idle`."""
    async with ProbeProcess(opts.url, opts.api_key, GREEDY) as probe:
        tally.add(await asyncio.wait_for(phase(client, tally, opts), opts.phase_timeout))
    if probe.latencies and idle > 0:
        tally.probe_ratio = max(probe.latencies) / idle
    return tally


def table(tallies: list[Tally]) -> str:
    header = ["phase", "sent", "served", "4xx", "5xx", "closed", "lost/hung", "KV leaked",
              "greedy ok", "probe x idle", "notes"]  # fmt: skip
    rows = [[t.name, t.sent, t.counts["served"], t.counts["4xx"], t.counts["5xx"],
             t.counts["closed"], t.counts["lost"], "yes" if t.kv_leaked else "0",
             "yes" if t.greedy_ok else "NO",
             "-" if t.probe_ratio is None else f"{t.probe_ratio:.2f}",
             "; ".join([*t.wrong, *t.notes])] for t in tallies]  # fmt: skip
    return text_table([header, *([str(c) for c in row] for row in rows)], align="l" * 11,
                      rule=True)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="base URL of a running jserve serve (loopback)")
    parser.add_argument("--start", action="store_true", help="start a jserve serve for the run")
    parser.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    parser.add_argument("--header-timeout", type=float, default=10.0, help="the server's")
    parser.add_argument("--body-timeout", type=float, default=30.0, help="the server's")
    parser.add_argument("--max-n", type=int, default=64, help="the server's --max-n")
    parser.add_argument("--phase-timeout", type=float, default=300.0, help="seconds per phase")
    parser.add_argument("--only", default="", help="run only the phases whose name has this")
    opts = parser.parse_args()
    if opts.start:
        return _run_with_own_server(opts)
    if not opts.url or not opts.url.startswith(("http://127.", "http://localhost")):
        parser.error("give --url of a loopback server, or --start")
    tallies = asyncio.run(run(opts))
    print(table(tallies))
    return _exit_code(tallies)


def _exit_code(tallies: list[Tally]) -> int:
    """1 if any phase had a 5xx, a lost or hung request, leaked KV, a finding beyond the
    status codes, or changed the greedy text."""
    bad = any(t.counts["5xx"] or t.counts["lost"] or t.kv_leaked or t.wrong or not t.greedy_ok
              for t in tallies)  # fmt: skip
    return 1 if bad else 0


def _run_with_own_server(opts: argparse.Namespace) -> int:
    from bench.server_process import ServerProcess, jserve_command

    opts.header_timeout, opts.body_timeout, opts.api_key = 3.0, 3.0, "adversarial-key"
    flags = ["--header-timeout", "3", "--body-timeout", "3", "--api-key", opts.api_key,
             "--max-n", str(opts.max_n)]  # fmt: skip
    log = Path(tempfile.mkdtemp()) / "server.log"
    with ServerProcess(jserve_command(flags), log) as server:
        opts.url = server.base_url
        tallies = asyncio.run(run(opts))
    print(table(tallies))
    print(f"server log: {log}", file=sys.stderr)
    return _exit_code(tallies)


if __name__ == "__main__":
    sys.exit(main())
