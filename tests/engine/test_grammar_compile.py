"""Compiling constraints (jserve.structured.grammar) on the default model's tokenizer, no
engine: limits refuse what would fail at a step, errors are short, concurrent requests for
one constraint compile it once, and a compile in the pool does not stall Python threads."""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import wait

import pytest

from jserve.config import regex_size
from jserve.sampling_params import StructuredOutputsParams
from jserve.structured import grammar as grammar_module
from jserve.structured.grammar import (
    ERROR_CHARS,
    MAX_CHOICES,
    MAX_CONSTRAINT_CHARS,
    GrammarCache,
    GrammarError,
)


@pytest.fixture(scope="module")
def grammars(default_model):
    return GrammarCache(default_model.tokenizer, default_model.config.vocab_size)


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def many_properties(count: int, required: bool = True) -> dict:
    """A large schema (about 75 characters a property)."""
    pattern = "^[a-z]+[0-9]{2,4}$"
    properties = {f"key_{i}": {"type": "string", "pattern": pattern} for i in range(count)}
    names = list(properties) if required else []
    return {"type": "object", "properties": properties, "required": names}


ALTERNATIVES = " | ".join(f'"w{i}"' for i in range(3_000))


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        # would compile, then fail at the first token (lexer past its fuel): probed at compile
        # (a second line: StructuredOutputsParams refuses these two first, unless the test
        # lifts jserve.config.regex_size's bound, as below)
        (dict(regex="a{1000000}"), "invalid regex: lexer error: too many expressions"),
        (dict(grammar='start: "x" /a{1000000}/'), "invalid grammar: lexer error"),
        # a rule of more alternatives than a parser row holds, reached at the first token
        (dict(grammar=f"start: c\nc: {ALTERNATIVES}"), "Current row has 3001 items; max is"),
        # optional properties: llguidance's parser row holds a few items for each
        (
            dict(json=many_properties(600, required=False)),
            r"Current row has \d+ items; max is 2000",
        ),
        # over the documented caps, refused before the compiler
        (dict(choice=[f"option {i}" for i in range(10_000)]), "10000 options; at most 1000"),
        (dict(json=many_properties(2_000)), "at most 100,000 are served"),
        (dict(regex="a" * (MAX_CONSTRAINT_CHARS + 1)), "the regex is 100,001 characters"),
        (dict(json=nested(200)), "invalid JSON schema: recursion limit exceeded"),
        (dict(regex="[a-"), "unclosed character class"),  # the reason, from a later line
    ],
)
def test_what_would_fail_at_a_step_is_refused_with_a_short_error(
    grammars, spec, words, monkeypatch
):
    monkeypatch.setattr(regex_size, "MAX_REGEX_SIZE", 10**9)
    with pytest.raises(GrammarError, match=words) as info:
        grammars.template(StructuredOutputsParams(**spec))
    message = str(info.value)
    assert len(message) <= ERROR_CHARS + 60 and "\n" not in message, message
    assert "<state>" not in message and "<non-verbose/>" not in message  # no compiler dump
    assert "w2999" not in message and "aaaa" not in message  # nor the grammar itself


def test_the_largest_served_constraints_compile_and_work(default_model, grammars):
    options = tuple(f"option {i}" for i in range(MAX_CHOICES))
    matcher = grammars.template(StructuredOutputsParams(choice=options)).deep_copy()
    assert matcher.consume_tokens(default_model.tokenizer.encode("option 999"))
    assert matcher.is_accepting() and matcher.is_stopped()
    schema = many_properties(1_000)  # under MAX_CONSTRAINT_CHARS
    matcher = grammars.template(StructuredOutputsParams(json=schema)).deep_copy()
    assert matcher.consume_tokens(default_model.tokenizer.encode('{"key_0":"ab12","key_1":"x'))
    assert not matcher.is_error()


def test_concurrent_requests_for_one_constraint_compile_it_once(grammars, monkeypatch):
    compiles = []
    compile_ = grammars._compile

    def counted(kind, text):
        compiles.append(threading.current_thread().name)
        time.sleep(0.2)  # still compiling when the others ask
        return compile_(kind, text)

    monkeypatch.setattr(grammars, "_compile", counted)
    spec = StructuredOutputsParams(json=nested(3))
    futures = [grammars.submit(spec) for _ in range(6)]
    done, _ = wait(futures, timeout=60)
    assert len(done) == 6
    assert len({id(f.result()) for f in futures}) == 1  # one template for all
    assert len(compiles) == 1 and compiles[0].startswith("jserve-grammar")
    assert grammars.template(spec) is futures[0].result()  # the synchronous path: cached
    bad = StructuredOutputsParams(regex="(unclosed")
    for _ in range(3):  # a refusal is cached too
        with pytest.raises(GrammarError):
            grammars.submit(bad).result()
    assert len(compiles) == 2


def test_an_unexpected_compile_failure_is_not_remembered(grammars, monkeypatch):
    compile_, calls = grammars._compile, []

    def fails_once(kind, text):
        calls.append(kind)
        if len(calls) == 1:
            raise MemoryError("out of memory")
        return compile_(kind, text)

    monkeypatch.setattr(grammars, "_compile", fails_once)
    spec = StructuredOutputsParams(json=nested(4))
    with pytest.raises(MemoryError):
        grammars.template(spec)
    assert grammars.template(spec).is_error() is False  # compiled again, and it worked
    assert len(calls) == 2


def test_a_compile_in_the_pool_does_not_stall_the_calling_thread(grammars, monkeypatch):
    """llguidance releases the GIL while it compiles: a Python loop here keeps running. (If
    it held the GIL, the loop's longest pause would be about the whole compile.) The schema
    doubles until its compile is long enough for a stall to show on this CPU."""
    assert grammars.llg_tokenizer is not None  # built once, before the measurement
    monkeypatch.setattr(grammar_module, "MAX_CONSTRAINT_CHARS", 10**6)
    for properties in (2_000, 4_000, 6_000):  # 8,000 is past max_grammar_size
        longest_pause, compile_seconds = _poll_while_compiling(
            grammars, StructuredOutputsParams(json=many_properties(properties))
        )
        if compile_seconds > 0.2:
            break
    assert compile_seconds > 0.2, compile_seconds
    assert longest_pause < compile_seconds / 4, (longest_pause, compile_seconds)


def _poll_while_compiling(grammars, spec: StructuredOutputsParams) -> tuple[float, float]:
    """(the loop's longest pause, the compile's wall time) for one compile in the pool."""
    start = last = time.perf_counter()
    longest_pause = 0.0
    future = grammars.submit(spec)
    while not future.done():
        now = time.perf_counter()
        longest_pause, last = max(longest_pause, now - last), now
    future.result()
    return longest_pause, time.perf_counter() - start


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread priority is Linux's")
def test_compiles_run_below_the_engine_threads_priority(grammars, monkeypatch):
    """A storm of compiles must take the cores the step leaves idle, not the step's."""

    def priority_of_the_compiling_thread(spec: StructuredOutputsParams) -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    monkeypatch.setattr(grammars, "template", priority_of_the_compiling_thread)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    compiling = grammars.submit(StructuredOutputsParams(regex="[ab]+")).result()
    assert compiling == min(19, mine + grammar_module.COMPILE_NICENESS)
