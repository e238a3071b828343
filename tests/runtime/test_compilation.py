"""After warm-up every compile is a logged warning and a counted metric, never silent."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest

from jserve.runtime.compilation import (
    COMPILE_COUNTER,
    RecompilationError,
    compilation_count,
    expect_compilation,
    forbid_compilation,
    serving_compilation_count,
)


@pytest.fixture
def serving(monkeypatch):
    """The process as it is once an engine has warmed up (restored after the test)."""
    monkeypatch.setattr(COMPILE_COUNTER, "serving", True)


def _fresh_function():
    def stray_step_function(x):
        return x * 3 + 1

    return jax.jit(stray_step_function)


def test_compile_after_warm_up_warns_with_name_and_shapes(serving, caplog):
    before = serving_compilation_count()
    with caplog.at_level(logging.WARNING, logger="jserve.runtime.compilation"):
        _fresh_function()(np.ones((3, 7), np.float32)).block_until_ready()
    assert serving_compilation_count() == before + 1
    (warning,) = [r for r in caplog.records if r.name == "jserve.runtime.compilation"]
    assert warning.levelno == logging.WARNING
    assert "stray_step_function" in warning.getMessage()
    assert "float32[3,7]" in warning.getMessage()


def test_compile_expected_during_warm_up_is_quiet(serving, caplog):
    before = serving_compilation_count()
    with (
        caplog.at_level(logging.WARNING, logger="jserve.runtime.compilation"),
        expect_compilation(),
    ):
        with expect_compilation():  # nested blocks: the outer one still covers what follows
            pass
        _fresh_function()(np.ones((2, 5), np.float32)).block_until_ready()
    assert serving_compilation_count() == before
    assert not [r for r in caplog.records if r.name == "jserve.runtime.compilation"]


def test_no_warning_before_warm_up(caplog, monkeypatch):
    monkeypatch.setattr(COMPILE_COUNTER, "serving", False)
    before = serving_compilation_count()
    with caplog.at_level(logging.WARNING, logger="jserve.runtime.compilation"):
        _fresh_function()(np.ones((4, 1), np.float32)).block_until_ready()
    assert serving_compilation_count() == before
    assert not caplog.records


def test_forbid_compilation_raises_and_names_the_function():
    with pytest.raises(RecompilationError, match="stray_step_function"), forbid_compilation():
        _fresh_function()(np.ones((6, 2), np.float32))


def test_jax_debug_records_stay_hidden(capsys, serving):
    """The DEBUG lowering records the counter reads are not printed by a root handler."""
    root = logging.getLogger()
    handler = logging.StreamHandler()
    root.addHandler(handler)
    try:
        _fresh_function()(np.ones((5, 5), np.float32)).block_until_ready()
    finally:
        root.removeHandler(handler)
    assert "Compiling" not in capsys.readouterr().err


def test_each_executable_is_counted_once_through_jax_monitoring():
    """One `backend_compile_duration` event per executable, none for a call that reuses it."""
    events = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(kwargs["fun_name"])

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        before = compilation_count()
        f = _fresh_function()
        f(np.ones((2, 3), np.float32)).block_until_ready()
        f(np.ones((2, 3), np.float32)).block_until_ready()
        f(np.ones((4, 3), np.float32)).block_until_ready()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert events == ["jit(stray_step_function)"] * 2
    assert compilation_count() == before + 2


def test_shapes_are_matched_to_the_function_compiled_not_the_last_lowered(serving, caplog):
    def other_function(x):
        return x - 1

    first = _fresh_function().lower(np.ones((3, 2), np.float32))
    second = jax.jit(other_function).lower(np.ones((9,), np.int32))
    with caplog.at_level(logging.WARNING, logger="jserve.runtime.compilation"):
        first.compile()
        second.compile()
    messages = [r.getMessage() for r in caplog.records if r.name == "jserve.runtime.compilation"]
    assert len(messages) == 2
    assert "jit(stray_step_function)" in messages[0] and "float32[3,2]" in messages[0]
    assert "jit(other_function)" in messages[1] and "int32[9]" in messages[1]
    assert "float32[3,2]" not in messages[1]
