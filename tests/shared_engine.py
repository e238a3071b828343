"""The one engine configuration the test run shares, in-process and in the processes it starts.

Every test that needs an engine on the real model and no special setting uses the session's
`shared_engine` (tests/conftest.py) through the function-scoped `engine` fixture, which resets
it before the test and checks after it that the test left it idle and unchanged. Servers, the
CLI and benchmarks started as processes take the same sizes (`engine_flags`), so their step
shapes are the ones the persistent compilation cache already holds: only the first process of
a run compiles them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jserve.config.engine_args import EngineArgs
from jserve.config.scheduler import SchedulerConfig
from jserve.engine.llm_engine import LLMEngine
from jserve.loaders.model_source import LoadedModel

# Tight on purpose: a 64-token step forces chunked prefill of long prompts, and 48 blocks of 16
# tokens (768 slots) cannot hold 8 sequences of up to ~430 tokens, forcing preemption.
SHARED = dict(max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=49, max_model_len=512)


def make_engine(default_model: LoadedModel, **overrides: Any) -> LLMEngine:
    """An engine of the shared sizes (and the same compiled steps) with `overrides` set; for
    the tests that need a setting the shared engine must not have."""
    return LLMEngine(EngineArgs(**{**SHARED, **overrides}), loaded=default_model)


def engine_flags(**overrides: Any) -> list[str]:
    """The shared sizes (and `overrides`) as `jserve serve` / `jserve generate` flags."""
    return [f"--{k.replace('_', '-')}={v}" for k, v in {**SHARED, **overrides}.items()]


def run_to_completion(engine: LLMEngine, max_steps: int = 100_000) -> dict:
    """Step until idle; returns request id -> final RequestOutput."""
    final = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return final
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    raise AssertionError(f"engine still busy after {max_steps} steps")


def assert_no_blocks_held(engine: LLMEngine) -> None:
    """Every KV block is free or an evictable prefix-cache entry once nothing runs."""
    assert not engine.has_unfinished_requests(), f"unfinished requests: {sorted(engine._states)}"
    stats = engine.scheduler.stats()
    assert stats.kv_cache_usage == 0.0, stats


def abort_all(engine: LLMEngine) -> None:
    """Abort every unfinished request (what a failed test may leave behind)."""
    for request_id in list(engine._states):
        engine.abort_request(request_id)


def _shadowed_methods(obj: object) -> list[str]:
    """Instance attributes that hide a method of the class with something else: a patch
    nobody undid. (An undone monkeypatch leaves the original bound method there.)"""
    return sorted(
        name
        for name, value in vars(obj).items()
        if callable(method := getattr(type(obj), name, None))
        and getattr(value, "__func__", None) is not method
    )


@dataclasses.dataclass(frozen=True)
class EngineState:
    """What a test on the shared engine must give back as it found it: its settings (those
    run-time control changes, tenant weights and the decision log included), its step
    observers, its parts unpatched and a live KV pool."""

    args: EngineArgs
    scheduler_config: SchedulerConfig
    control_settings: dict
    observers: tuple
    patched: dict[str, list[str]]
    pool_deleted: bool

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineState:
        parts = {
            "engine": engine, "scheduler": engine.scheduler, "runner": engine.runner,
            "sampler": engine.sampler, "inputs_builder": engine.inputs_builder,
            "structured": engine.structured,
        }  # fmt: skip
        settings = engine.scheduler_settings()
        settings.pop("fair_share_counters")  # what serving counts, not a setting
        return cls(
            args=engine.args,
            scheduler_config=engine.scheduler.config,
            control_settings=settings,
            observers=tuple(engine._step_observers),
            patched={name: _shadowed_methods(part) for name, part in parts.items()},
            pool_deleted=any(pool.is_deleted() for pool in engine.runner.kv_cache),
        )


def assert_left_as_found(engine: LLMEngine, before: EngineState) -> None:
    """The test left the shared engine idle (no request, no block held) and unchanged."""
    assert_no_blocks_held(engine)
    assert not engine._children, sorted(engine._children)
    after = EngineState.of(engine)
    changed = [f.name for f in dataclasses.fields(EngineState)
               if getattr(after, f.name) != getattr(before, f.name)]  # fmt: skip
    assert not changed, f"the test left the shared engine changed: {changed}\n{after}"
