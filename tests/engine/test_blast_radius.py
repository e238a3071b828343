"""One request's failure stays its own, and no request takes more than its share of the queue;
a failed device step restarts the engine in-process.

Faults are injected where validation cannot reach (a value mutated after admission, a
detokenizer that raises, a device step that raises), so each test shows the containment, not
the validation in front of it.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from jserve.config.settings import InvalidSetting
from jserve.engine.async_engine import MAX_FAILED_STEPS_IN_A_ROW, AsyncLLMEngine
from jserve.errors import EngineDeadError, RequestRejected
from jserve.sampling_params import SamplingParams
from tests.shared_engine import assert_no_blocks_held, make_engine, run_to_completion

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def expected(shared_engine) -> str:
    """PROMPT's greedy text, alone on a healthy engine."""
    shared_engine.add_request("expected", PROMPT, GREEDY)
    return run_to_completion(shared_engine)["expected"].outputs[0].text


@pytest.fixture
def small_queue(engine, monkeypatch):
    """The shared engine with a waiting queue of 8 and n at most 4, until the test ends."""
    config = engine.scheduler.config
    engine.scheduler.reconfigure(dataclasses.replace(config, max_waiting_requests=8))
    monkeypatch.setattr(engine, "args", dataclasses.replace(engine.args, max_n=4))
    yield engine
    engine.scheduler.reconfigure(config)


@pytest.mark.parametrize(
    ("prompt", "params", "param", "message"),
    [
        ({"prompt_token_ids": [1, 49152]}, GREEDY, "prompt",
         "prompt[1] must be a token id in [0, 49152), got 49152"),
        (PROMPT, SamplingParams(stop_token_ids=[49152], min_tokens=1), "stop_token_ids",
         "stop_token_ids[0] must be a token id in [0, 49152), got 49152"),
    ],
)  # fmt: skip
def test_the_offline_api_checks_ids_against_the_vocabulary(engine, prompt, params, param, message):
    with pytest.raises(RequestRejected) as error:
        engine.add_request("bad", prompt, params)
    assert (error.value.reason, error.value.param, str(error.value)) == ("invalid", param, message)
    assert not engine.has_unfinished_requests()


def test_n_is_capped_and_every_sample_counts_against_the_waiting_cap(small_queue):
    engine = small_queue
    few = SamplingParams(temperature=1.0, max_tokens=2, seed=1)
    with pytest.raises(RequestRejected) as error:
        engine.add_request("greedy-n", PROMPT, SamplingParams(n=5, max_tokens=2))
    assert (error.value.param, str(error.value)) == ("n", "n must be an integer in [1, 4], got 5")
    engine.add_request("four", PROMPT, SamplingParams(n=4, max_tokens=2, seed=1))
    engine.add_request("three", PROMPT, SamplingParams(n=3, max_tokens=2, seed=1))
    assert engine.stats().num_requests_waiting == 7
    with pytest.raises(RequestRejected) as error:  # 2 samples, 1 place: neither joins
        engine.add_request("two", PROMPT, SamplingParams(n=2, max_tokens=2, seed=1))
    assert error.value.reason == "queue_full"
    assert engine.stats().num_requests_waiting == 7
    engine.add_request("one", PROMPT, few)
    final = run_to_completion(engine)
    assert sorted(final) == ["four", "one", "three"]
    assert [len(final[r].outputs) for r in ("four", "three", "one")] == [4, 3, 1]
    assert_no_blocks_held(engine)


def test_a_request_whose_sampling_row_fails_fails_alone(engine, expected):
    bad = SamplingParams(temperature=0, max_tokens=4, min_tokens=2)
    engine.add_request("bad", "Hi", bad)
    # Past validation: a stop id the int32 sampling row cannot hold (defect 1), banned while
    # the request is below its min_tokens.
    state = engine._states["bad"]
    state.stop = dataclasses.replace(state.stop, min_tokens_banned_ids=(2, 2**31))
    engine.add_request("good", PROMPT, GREEDY)
    final = run_to_completion(engine)
    failed = final["bad"]
    assert [o.finish_reason for o in failed.outputs] == ["error"]
    assert failed.error.startswith("OverflowError: ")
    assert final["good"].outputs[0].text == expected
    assert_no_blocks_held(engine)


def test_a_request_whose_detokenizer_fails_fails_alone(engine, expected):
    engine.add_request("bad", "Hello", SamplingParams(temperature=0, max_tokens=6, n=2))
    engine.add_request("good", PROMPT, GREEDY)

    def broken(token_id):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    engine._states["bad"].samples[1].detokenizer.add_token = broken
    final = run_to_completion(engine)
    assert [o.finish_reason for o in final["bad"].outputs] == ["error", "error"]
    assert "UnicodeDecodeError" in final["bad"].error
    assert final["good"].outputs[0].text == expected
    assert_no_blocks_held(engine)


async def _collect(aengine: AsyncLLMEngine, request_id: str, prompt: str, params):
    last = None
    async for out in aengine.generate(prompt, params, request_id):
        last = out
    return last


def _fail_device_steps(monkeypatch, engine, times: int, when=lambda: True) -> list[int]:
    """The next `times` device steps once `when()` holds raise, as an XLA error would."""
    calls = []
    real_run = engine.runner.run

    def run(inputs):
        if when():
            calls.append(1)
        if calls and len(calls) <= times and when():
            # Like a real failure, the donated KV pool is gone.
            engine.runner.kv_cache[0].delete()
            raise RuntimeError("INTERNAL: injected device failure")
        return real_run(inputs)

    monkeypatch.setattr(engine.runner, "run", run)
    return calls


def test_a_failed_device_step_restarts_the_engine(engine, expected, monkeypatch):
    asyncio.run(_restart_scenario(engine, expected, monkeypatch))


async def _restart_scenario(engine, expected, monkeypatch) -> None:
    aengine = AsyncLLMEngine(engine)
    restarts = engine.num_restarts
    try:
        # Fail the first step that has both requests in flight.
        _fail_device_steps(monkeypatch, engine, times=1, when=lambda: len(engine._states) == 2)
        long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        in_flight = await asyncio.gather(
            _collect(aengine, "a", "Once upon a time", long),
            _collect(aengine, "b", "def main():", long),
        )
        for out in in_flight:
            assert [o.finish_reason for o in out.outputs] == ["error"]
            assert "injected device failure" in out.error and "engine restarted" in out.error
        assert aengine.state == "ready"
        assert (aengine.num_restarts, engine.stats().num_restarts) == (1, restarts + 1)
        after = await _collect(aengine, "c", PROMPT, GREEDY)
        assert after.outputs[0].text == expected and after.error is None
    finally:
        await aengine.shutdown()
    assert_no_blocks_held(engine)


def test_a_command_that_raises_never_ends_the_step_loop(engine, expected, monkeypatch):
    # A dead step loop would leave the control's future unsettled forever: fail, not hang.
    scenario = _raising_commands_scenario(engine, expected, monkeypatch)
    asyncio.run(asyncio.wait_for(scenario, timeout=120))


async def _raising_commands_scenario(engine, expected, monkeypatch) -> None:
    aengine = AsyncLLMEngine(engine)
    restarts = engine.num_restarts
    try:
        with pytest.raises(InvalidSetting) as error:  # an OverflowError before it was checked
            await aengine.control({"free_block_watermark": 10**400})
        assert error.value.name == "free_block_watermark"
        with monkeypatch.context() as patch:  # exception types nobody expects
            patch.setattr(engine, "control", lambda changes: {}[changes["missing"]])
            with pytest.raises(KeyError):
                await aengine.control({"max_num_seqs": 2})
            patch.setattr(engine, "abort_request", lambda request_id: 1 / 0)
            await aengine.abort("nobody")
        after = await _collect(aengine, "after", PROMPT, GREEDY)
        assert after.outputs[0].text == expected and after.error is None
        assert aengine.state == "ready" and engine.num_restarts == restarts
        assert (await aengine.control({}))["free_block_watermark"] == 0.01  # unchanged
    finally:
        await aengine.shutdown()
    assert_no_blocks_held(engine)


def test_an_engine_failing_every_step_dies_and_fails_its_requests(default_model, monkeypatch):
    engine = make_engine(default_model)  # its own: it dies
    calls = _fail_device_steps(monkeypatch, engine, times=10**9)
    asyncio.run(_death_scenario(engine, calls))


async def _death_scenario(engine, calls: list[int]) -> None:
    aengine = AsyncLLMEngine(engine)
    try:
        outcomes = []
        for i in range(MAX_FAILED_STEPS_IN_A_ROW + 1):
            try:
                outcomes.append((await _collect(aengine, f"r{i}", PROMPT, GREEDY)).error)
            except EngineDeadError as e:
                outcomes.append(f"dead: {e}")
        assert len(calls) == MAX_FAILED_STEPS_IN_A_ROW + 1
        assert all("engine restarted" in o for o in outcomes[:-1]), outcomes
        assert outcomes[-1].startswith("dead: RuntimeError: INTERNAL: injected"), outcomes
        assert aengine.state == "dead"
        with pytest.raises(EngineDeadError):
            await _collect(aengine, "later", PROMPT, GREEDY)
    finally:
        await aengine.shutdown()
