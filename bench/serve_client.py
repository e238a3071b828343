"""Send a workload to an OpenAI-compatible server and time every streamed token.

Walkthrough of `run_load`:
1. Each request gets a send time: its own `arrival_s`, else the running sum of exponential gaps
   at `request_rate` (Poisson arrivals; rate inf = everything at t=0). `max_concurrency`
   additionally caps how many are in flight (fixed-concurrency load when the rate is inf).
2. Each request streams (`stream_options.include_usage`) and records, per SSE chunk that carries
   text, the arrival time and its token count (the length of its logprobs token list when the
   server sends one, else 1). The final usage chunk gives the prompt and output token counts.
3. Failures (HTTP errors, in-band error events, disconnects, a timeout, or the overall
   `max_duration`) become records with `success=False` and a short reason; nothing raises.
Records are jserve.simulate.metrics' RequestRecord, so a simulated run and a measured one are
summarized by the same code.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass

import aiohttp
import numpy as np
from tqdm import tqdm

from bench.workloads import RequestSpec
from jserve.simulate.metrics import RequestRecord


@dataclass(frozen=True)
class LoadConfig:
    base_url: str
    model: str
    endpoint: str = "completions"  # or "chat"
    request_rate: float = float("inf")
    max_concurrency: int | None = None
    ignore_eos: bool = True
    request_timeout: float = 600.0
    max_duration: float = 1800.0
    seed: int = 0


def request_body(config: LoadConfig, spec: RequestSpec) -> dict:
    body: dict = {
        "model": config.model,
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:  # vLLM extras; jserve accepts them too
        body.update(ignore_eos=True, min_tokens=spec.max_tokens)
    if spec.tenant is not None:
        body["user"] = spec.tenant
    if config.endpoint == "chat":
        messages = [{"role": "system", "content": spec.system}] if spec.system else []
        body["messages"] = [*messages, {"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = f"{spec.system}\n\n{spec.prompt}" if spec.system else spec.prompt
    return body


def _chunk_text_tokens(choice: dict) -> tuple[str, int]:
    """(new text, tokens in it) of one streamed choice, for either endpoint."""
    text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    logprobs = choice.get("logprobs") or {}
    tokens = logprobs.get("tokens") or logprobs.get("content")
    return text, len(tokens) if tokens else 1


async def _stream_one(
    session: aiohttp.ClientSession, config: LoadConfig, spec: RequestSpec, record: RequestRecord,
    t0: float,
) -> None:  # fmt: skip
    path = "/v1/chat/completions" if config.endpoint == "chat" else "/v1/completions"
    started = time.perf_counter()
    record.start = started - t0
    # A tenant's requests form one session for a router's session affinity (vllm-router).
    headers = {"x-session-id": spec.tenant} if spec.tenant is not None else None
    async with session.post(
        config.base_url + path, json=request_body(config, spec), headers=headers
    ) as resp:
        if resp.status != 200:
            body = (await resp.text())[:200]
            raise RuntimeError(f"HTTP {resp.status}: {body}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"in-band error: {json.dumps(chunk['error'])[:200]}")
            now = time.perf_counter()
            for choice in chunk.get("choices") or []:
                text, tokens = _chunk_text_tokens(choice)
                if text:
                    record.chunk_times.append(now - t0)
                    record.chunk_tokens.append(tokens)
            if chunk.get("usage"):
                record.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                record.output_tokens = chunk["usage"].get("completion_tokens", 0)
    record.e2e = time.perf_counter() - started
    if not record.chunk_times:
        raise RuntimeError("the stream ended without any text")
    record.ttft = record.chunk_times[0] - record.start
    record.output_tokens = record.output_tokens or sum(record.chunk_tokens)
    record.success = True


async def _run_one(
    session: aiohttp.ClientSession, config: LoadConfig, spec: RequestSpec, record: RequestRecord,
    t0: float, gate: asyncio.Semaphore | None, progress: tqdm,
) -> None:  # fmt: skip
    try:
        async with gate or contextlib.nullcontext():
            await asyncio.wait_for(
                _stream_one(session, config, spec, record, t0), config.request_timeout
            )
    except TimeoutError:
        record.error = f"timed out after {config.request_timeout:g} s"
    except asyncio.CancelledError:
        record.error = f"cancelled: the run passed --max-duration {config.max_duration:g} s"
    except RuntimeError as exc:  # raised above with a message that starts with the reason
        record.error = str(exc)[:300]
    except (aiohttp.ClientError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        progress.update(1)


def send_times(specs: list[RequestSpec], rate: float, seed: int) -> list[float]:
    """Send offsets: a spec's own arrival_s, else Poisson arrivals at `rate` (inf: all at 0)."""
    rng = np.random.default_rng(seed)
    clock, times = 0.0, []
    for spec in specs:
        if spec.arrival_s is not None:
            times.append(spec.arrival_s)
            continue
        times.append(clock)
        if rate != float("inf"):
            clock += float(rng.exponential(1.0 / rate))
    return times


async def run_load(
    config: LoadConfig, specs: list[RequestSpec], *, show_progress: bool = True
) -> tuple[list[RequestRecord], float]:
    """Run the workload; returns one record per spec (in spec order) and the wall duration."""
    if config.request_rate <= 0:
        raise ValueError(
            f"request_rate must be > 0 (inf for all at once), got {config.request_rate}"
        )
    if config.max_concurrency is not None and config.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {config.max_concurrency}")
    records = [RequestRecord(i, s.group, s.max_tokens) for i, s in enumerate(specs)]
    gate = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    timeout = aiohttp.ClientTimeout(total=None, sock_read=config.request_timeout)
    connector = aiohttp.TCPConnector(limit=0)
    progress = tqdm(total=len(specs), desc="requests", unit="req", disable=not show_progress)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        t0 = time.perf_counter()

        async def launch(delay: float, spec: RequestSpec, record: RequestRecord) -> None:
            await asyncio.sleep(delay)
            await _run_one(session, config, spec, record, t0, gate, progress)

        tasks = [
            asyncio.create_task(launch(delay, spec, record))
            for delay, spec, record in zip(
                send_times(specs, config.request_rate, config.seed), specs, records, strict=True
            )
        ]
        _, pending = await asyncio.wait(tasks, timeout=config.max_duration)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - t0
    progress.close()
    for record in records:  # cancelled before they were even sent
        if not record.success and not record.error:
            record.error = f"not sent: the run passed --max-duration {config.max_duration:g} s"
    return records, duration
