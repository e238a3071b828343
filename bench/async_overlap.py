"""Host time async scheduling hides per decode step, on the default model.

One engine keeps `batch` sequences decoding and alternates (bench.ab_driver, ABBA) a run of
synchronous steps with a run of async ones (`LLMEngine.async_scheduling`), for each batch
size. Each side reports its median step time (one `engine.step()` call) and the host time its
steps spend planning and building inputs (`schedule`, `build`) and postprocessing (appending
tokens, detokenizing, stop checks): in a synchronous step the device waits through all of it,
in an async one it runs while a step computes. Hidden per step = the synchronous median minus
the async one. On a CPU "the device" is XLA:CPU's threads on the same cores, so the overlap
there is bounded by the cores left over; label the load with the result.

    python -m bench.async_overlap --batches 32 128
    python -m bench.async_overlap --smoke      # a few steps, for CI
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from bench.ab_driver import alternate, describe
from jserve.config.engine_args import EngineArgs
from jserve.engine.llm_engine import LLMEngine
from jserve.sampling_params import SamplingParams

PROMPT_LEN = 16


class HostClock:
    """Seconds the engine's host phases took, accumulated by wrapping their methods."""

    def __init__(self, engine: LLMEngine) -> None:
        self.seconds = 0.0
        builders = (engine.inputs_builder, engine._spare_builder)
        phases = [(engine.scheduler, "schedule"), (engine, "_postprocess")]
        for owner, name in [*phases, *((b, "build") for b in builders)]:
            setattr(owner, name, self._timed(getattr(owner, name)))

    def _timed(self, method: Callable) -> Callable:
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        return timed


def timed_steps(engine: LLMEngine, clock: HostClock, use_async: bool, steps: int) -> dict:
    """`steps` steps in one mode (after one more that switches to it); median wall and host
    time per step, in ms."""
    engine.async_scheduling = use_async
    engine.step()  # the switch: drains or starts the in-flight step
    walls, hosts = [], []
    for _ in range(steps):
        host_before, started = clock.seconds, time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - started)
        hosts.append(clock.seconds - host_before)
    return {
        "step_ms": 1e3 * statistics.median(walls),
        "host_ms": 1e3 * statistics.median(hosts),
    }


def measure(engine: LLMEngine, batch: int, steps: int, pairs: int) -> dict:
    """Keep `batch` sequences decoding; alternate sync and async runs of `steps` steps."""
    engine.reset()
    clock = HostClock(engine)
    max_tokens = (2 * pairs + 2) * (steps + 1) + 64
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens)
    for i in range(batch):
        prompt = [(i * 31 + j) % 5000 + 10 for j in range(PROMPT_LEN)]
        engine.add_request(f"b{i}", {"prompt_token_ids": prompt}, params)
    while engine.scheduler.stats().num_waiting or engine.scheduler.stats().num_running < batch:
        engine.step()
    for _ in range(4):  # the last prefill chunks, then decodes only
        engine.step()
    result = alternate(
        lambda: timed_steps(engine, clock, False, steps),
        lambda: timed_steps(engine, clock, True, steps),
        pairs,
        abba=True,
    )
    engine.async_scheduling = False
    for i in range(batch):
        engine.abort_request(f"b{i}")
    while engine.has_unfinished_requests():
        engine.step()
    sync = statistics.median(r["step_ms"] for r in result.a)
    overlapped = statistics.median(r["step_ms"] for r in result.b)
    return {
        "batch": batch,
        "sync_step_ms": sync,
        "async_step_ms": overlapped,
        "host_ms_per_sync_step": statistics.median(r["host_ms"] for r in result.a),
        "host_ms_per_async_step": statistics.median(r["host_ms"] for r in result.b),
        "hidden_ms_per_step": sync - overlapped,
        "async_over_sync": describe(result.summary(_step_ratio)["ratio"]),
        "loadavg_1min": result.loadavg_1min,
    }


def _step_ratio(sync: dict, overlapped: dict) -> float:
    return overlapped["step_ms"] / sync["step_ms"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per side and pair")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="batch 8, 2 steps, 1 pair")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batches, args.steps, args.pairs = [8], 2, 1
    largest = max(args.batches)
    args_ = EngineArgs(max_num_seqs=largest, max_num_batched_tokens=largest, max_model_len=512)
    engine = LLMEngine(args_)
    for batch in args.batches:
        print(json.dumps(measure(engine, batch, args.steps, args.pairs)), flush=True)


if __name__ == "__main__":
    main()
