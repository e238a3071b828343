"""Many concurrent streams, and clients that go away: metrics add up, KV is freed at once."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from server_harness import echo_text, metric, metric_sum, parse_sse, serve

from jserve.server.mock_engine import MockEngine

COMPLETIONS = "/v1/completions"


async def test_32_concurrent_streams_complete_and_metrics_add_up():
    prompts = [f"client {i:02d} says hi" for i in range(32)]
    lengths = [20 + i for i in range(32)]

    async with serve(MockEngine(token_delay=0.002)) as client:

        async def one(prompt: str, max_tokens: int) -> tuple[str, dict]:
            response = await client.post(
                COMPLETIONS,
                json={"prompt": prompt, "max_tokens": max_tokens, "stream": True,
                      "stream_options": {"include_usage": True}},
            )  # fmt: skip
            events = parse_sse(await response.text())
            text = "".join(e["choices"][0]["text"] for e in events[:-2])
            return text, events[-2]["usage"]

        results = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths, strict=True)))
        metrics = await (await client.get("/metrics")).text()

    for (text, usage), prompt, n in zip(results, prompts, lengths, strict=True):
        assert text == echo_text(prompt, n)
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(prompt), n)
    completion_tokens = sum(u["completion_tokens"] for _, u in results)
    prompt_tokens = sum(u["prompt_tokens"] for _, u in results)
    assert metric_sum(metrics, "jserve:request_success_total") == 32
    assert metric(metrics, "jserve:request_success_total", 'finished_reason="length"') == 32
    assert metric(metrics, "jserve:generation_tokens_total") == completion_tokens
    assert metric(metrics, "jserve:prompt_tokens_total") == prompt_tokens
    # Every scheduled token of every iteration, prompt and generated, lands in the histogram.
    assert metric(metrics, "jserve:iteration_tokens_sum") == prompt_tokens + completion_tokens
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):  # fmt: skip
        assert metric(metrics, f"jserve:{name}_count") == 32
    assert metric(metrics, "jserve:inter_token_latency_seconds_count") == completion_tokens - 32
    assert metric(metrics, "jserve:num_requests_running") == 0
    assert metric(metrics, "jserve:kv_cache_usage_perc") == 0


async def _idle_within(client, seconds: float) -> float:
    """Seconds until /metrics shows no running request and no KV in use (fails after `seconds`)."""
    start = time.monotonic()
    while True:
        text = await (await client.get("/metrics")).text()
        running = metric(text, "jserve:num_requests_running")
        if running == 0 and metric(text, "jserve:kv_cache_usage_perc") == 0:
            return time.monotonic() - start
        assert time.monotonic() - start < seconds, f"still {running} running after {seconds} s"
        await asyncio.sleep(0.01)


async def test_8_clients_disconnecting_mid_stream_free_kv_at_once():
    engine = MockEngine(token_delay=0.01)
    async with serve(engine) as client, aiohttp.ClientSession() as session:
        url = client.make_url(COMPLETIONS)
        body = {"prompt": "disconnect me", "max_tokens": 200, "stream": True}
        responses = [await session.post(url, json=body) for _ in range(8)]
        for response in responses:
            await response.content.readuntil(b"\n\n")  # streaming has begun
        busy = await (await client.get("/metrics")).text()
        assert metric(busy, "jserve:num_requests_running") == 8
        assert metric(busy, "jserve:kv_cache_usage_perc") > 0
        for response in responses:
            response.close()  # drop the connection mid-stream
        elapsed = await _idle_within(client, 1.0)
        after = await client.post(COMPLETIONS, json={"prompt": "next", "max_tokens": 4})
        assert (await after.json())["choices"][0]["text"] == "next"
        text = await (await client.get("/metrics")).text()
    assert elapsed < 1.0
    assert metric(text, "jserve:request_success_total", 'finished_reason="abort"') == 8


async def test_non_streaming_client_that_goes_away_is_aborted():
    engine = MockEngine(token_delay=0.01)
    async with serve(engine) as client:
        request = asyncio.create_task(
            client.post(COMPLETIONS, json={"prompt": "wait for it", "max_tokens": 200})
        )
        while engine.stats().num_requests_running == 0:
            await asyncio.sleep(0.005)
        request.cancel()  # closes the client's connection
        await asyncio.gather(request, return_exceptions=True)
        assert await _idle_within(client, 1.0) < 1.0
