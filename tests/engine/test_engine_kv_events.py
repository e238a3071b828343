"""The engine publishes its prefix cache's changes: the replayed stream equals the cache."""

from __future__ import annotations

import time
from collections import Counter

import msgspec
import pytest

from jserve.kv_events.publisher import KVEventBatch
from jserve.sampling_params import SamplingParams
from tests.core.test_kv_cache_events import cache_contents
from tests.engine.test_kv_events_wire import replay
from tests.shared_engine import make_engine, run_to_completion


def replayed(endpoint: str) -> tuple[dict, Counter]:
    """The cache every batch published so far describes, and how many events of each kind."""
    blocks: dict = {}
    kinds: Counter = Counter()
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    for _, _, payload in replay(endpoint, 0):
        for event in decoder.decode(payload).events:
            kind = type(event).__name__
            kinds[kind] += 1
            if kind == "BlockStored":
                size = event.block_size
                for j, h in enumerate(event.block_hashes):
                    blocks[h] = tuple(event.token_ids[j * size : (j + 1) * size])
            elif kind == "BlockRemoved":
                for h in event.block_hashes:
                    del blocks[h]
            else:
                blocks.clear()
    return blocks, kinds


def wait_replayed(endpoint: str, expected: dict) -> Counter:
    """The publisher thread sends asynchronously: replay until the state matches (or 10 s)."""
    deadline = time.monotonic() + 10
    while True:
        blocks, kinds = replayed(endpoint)
        if blocks == expected or time.monotonic() > deadline:
            assert blocks == expected
            return kinds
        time.sleep(0.05)


@pytest.fixture(scope="module")
def publishing_engine(default_model):
    """An engine of the shared sizes (48 usable blocks of 16 tokens; the shared engine's
    shapes, so the compilation cache serves it), publishing its KV events on free ports. The
    second test needs its cache empty: the engine is fresh, or the first test's closing
    restart cleared it."""
    engine = make_engine(
        default_model, kv_events_endpoint="tcp://127.0.0.1:*",
        kv_events_replay_endpoint="tcp://127.0.0.1:*",
    )  # fmt: skip
    yield engine
    engine.close()


def test_served_requests_publish_stores_evictions_and_a_clear_on_restart(publishing_engine):
    # Each round's three 200-token prompts share 96 tokens and take 13 blocks each, so later
    # rounds evict earlier rounds' blocks.
    engine = publishing_engine
    endpoint = engine._kv_events.replay_endpoint
    shared = list(range(1000, 1096))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for round_ in range(4):
        for i in range(3):
            own = [2000 + 300 * i + 7 * round_ + k for k in range(104)]
            engine.add_request(f"r{round_}-{i}", shared + own, params)
        run_to_completion(engine)
        kinds = wait_replayed(endpoint, cache_contents(engine.scheduler.block_manager))
    assert kinds["BlockStored"] > 0 and kinds["BlockRemoved"] > 0
    assert engine.stats().prefix_cache_hits > 0  # the shared prefix was found
    engine.recover(RuntimeError("injected"))
    assert wait_replayed(endpoint, {})["AllBlocksCleared"] == 1


def test_a_prompts_blocks_are_published_before_the_step_that_computes_them(
    publishing_engine, monkeypatch
):
    # As vLLM does, the blocks a step completes are stored when it is planned, so a KV-aware
    # router learns where a prefix lives a whole prefill step earlier.
    engine = publishing_engine
    endpoint = engine._kv_events.replay_endpoint
    seen_at_first_run: list[dict] = []
    run = engine.runner.run

    def run_and_look(inputs):
        if not seen_at_first_run:  # the prompt's step has not run yet
            expected = cache_contents(engine.scheduler.block_manager)
            wait_replayed(endpoint, expected)
            seen_at_first_run.append(expected)
        return run(inputs)

    monkeypatch.setattr(engine.runner, "run", run_and_look)
    prompt = list(range(1000, 1100))  # 6 full blocks of 16 and 4 tokens
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=2))
    run_to_completion(engine)
    (published,) = seen_at_first_run
    blocks = [tuple(prompt[i * 16 : (i + 1) * 16]) for i in range(6)]
    # The first chunk's full blocks (the test engine's budget chunks the prompt).
    assert published and sorted(published.values()) == blocks[: len(published)]
