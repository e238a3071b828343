"""Async scheduling on the real model serves exactly what the synchronous engine serves.

One workload goes through the shared engine (a 64-token step and a 48-block pool: chunked
prefill of ~400-token prompts and preemption) in each mode: greedy requests, a stop string,
max_tokens, a seeded n=2 request, a grammar, and an abort once the first token is out. Every
request's tokens, text and finish reasons must be equal.
"""

from __future__ import annotations

import asyncio

from jserve.engine.async_engine import AsyncLLMEngine
from jserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.shared_engine import assert_no_blocks_held

PARAGRAPH = (
    "The history of computing is a story of ideas meeting machines. Early calculators were "
    "mechanical, then electrical, and finally electronic; each step made arithmetic faster. "
)


def _workload() -> list[tuple[str, str, SamplingParams]]:
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [
        # Distinct from their first token (no shared prefix): 3 x ~25 blocks of 48.
        *[(f"long{i}", f"Essay {i}. " + PARAGRAPH * 14 + "Point:", greedy) for i in range(3)],
        ("stop", "Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=40, stop=[" 5,"])),
        ("eos", "Q: What is 2 + 2?\nA:", SamplingParams(temperature=0, max_tokens=24)),
        ("n2", "Say something.", SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=8)),
        (
            "grammar",
            "A phone number:",
            SamplingParams(
                temperature=0,
                max_tokens=16,
                structured_outputs=StructuredOutputsParams(regex=r"\d{3}-\d{4}"),
            ),
        ),
        ("abort", "Once upon a time", SamplingParams(temperature=0, max_tokens=200)),
    ]


def _serve(engine) -> dict[str, list[tuple]]:
    """Run the workload to the end; request id -> each sample's (tokens, text, finish
    reason, stop reason). "abort" is aborted as soon as its first token is out."""
    for request_id, prompt, params in _workload():
        engine.add_request(request_id, prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
            elif out.request_id == "abort" and out.outputs[0].token_ids:
                final["abort"] = engine.abort_request("abort")
    return {
        request_id: [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in out.outputs]
        for request_id, out in final.items()
    }


def test_async_scheduling_gives_the_synchronous_engines_outputs(engine, monkeypatch):
    sync = _serve(engine)
    assert_no_blocks_held(engine)
    engine.reset()
    monkeypatch.setattr(engine, "async_scheduling", True)
    overlapped, dispatches = [], []
    schedule, run = engine.scheduler.schedule, engine.runner.run

    def recording_schedule(*args, **kwargs):
        in_flight = engine._in_flight is not None
        plan = schedule(*args, **kwargs)
        overlapped.append(in_flight and not plan.is_empty)
        return plan

    def recording_run(inputs):
        dispatches.append(inputs.num_tokens)
        return run(inputs)

    monkeypatch.setattr(engine.scheduler, "schedule", recording_schedule)
    monkeypatch.setattr(engine.runner, "run", recording_run)
    got = _serve(engine)
    assert got == sync
    assert engine.scheduler.stats().num_preemptions > 0  # the pool was tight
    assert_no_blocks_held(engine)
    reasons = {sample[2] for samples in sync.values() for sample in samples}
    assert reasons == {"length", "stop", "abort"}, reasons
    assert sync["stop"][0][3] == " 5," and sync["abort"][0][0]
    # The engine never idled, so every step after the first was planned while one ran.
    assert sum(overlapped) == len(dispatches) - 1 > 0


def test_the_async_front_streams_and_aborts_with_a_step_in_flight(engine, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("ref", "Count: 1, 2, 3,", params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            reference = out.outputs[0].token_ids
    monkeypatch.setattr(engine, "async_scheduling", True)

    async def serve() -> tuple[list, int]:
        aengine = AsyncLLMEngine(engine)
        try:
            long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
            seen, stream = 0, aengine.generate("Once upon a time", long, "left")
            async for _ in stream:
                seen += 1
                if seen == 2:
                    break
            await stream.aclose()  # the client goes away: an abort while its next step runs
            outputs = [out async for out in aengine.generate("Count: 1, 2, 3,", params, "ok")]
            return outputs, seen
        finally:
            await aengine.shutdown()

    outputs, seen = asyncio.run(asyncio.wait_for(serve(), timeout=120))
    assert seen == 2
    assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == reference
    assert engine._in_flight is None  # the step loop drained it before stopping
