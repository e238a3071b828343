"""Structured outputs on the real model: every constrained output parses and validates, with
many schemas in one continuous batch, preemption, n > 1, stop strings, aborts, and no compile.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading

import jsonschema
import pytest

from jserve.engine.async_engine import AsyncLLMEngine
from jserve.errors import RequestRejected
from jserve.runtime.compilation import forbid_compilation
from jserve.sampling_params import SamplingParams, StructuredOutputsParams
from jserve.structured.decoding import SequenceMatcher
from tests.shared_engine import run_to_completion

NAME = {"type": "string", "minLength": 1, "maxLength": 16}
SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 4},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {
        "type": "object",
        "properties": {
            "city": NAME,
            "tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3},
        },
        "required": ["city", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "kind": {"const": "point"},
            "x": {"type": "integer"},
            "y": {"type": "integer"},
        },
        "required": ["kind", "x", "y"],
        "additionalProperties": False,
    },
    {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 9}, {"type": "null"}]},
    {
        "type": "object",
        "properties": {"user": {"$ref": "#/$defs/user"}},
        "required": ["user"],
        "additionalProperties": False,
        "$defs": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}},
                "required": ["id"],
                "additionalProperties": False,
            }
        },
    },
]


def chat(engine, question: str) -> str:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])


def constrained(max_tokens: int = 160, **kwargs) -> SamplingParams:
    spec = StructuredOutputsParams(**kwargs)
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=spec)


@pytest.mark.parametrize("count", [8, pytest.param(64, marks=pytest.mark.slow)])
def test_requests_over_8_schemas_mixed_with_unconstrained_all_validate(engine, count, monkeypatch):
    """One continuous batch; the unconstrained neighbours' long prompts (~300 tokens each)
    overflow the 48-block pool, so sequences are preempted and resumed with their matchers.
    The 64-request case is `slow`: the 8-request one covers every schema by default."""
    before = engine.stats()
    grammars, compiled = engine.structured.grammars, []
    compile_ = grammars._compile
    monkeypatch.setattr(grammars, "_compile", lambda *key: compiled.append(key) or compile_(*key))
    expected = {}
    for i in range(4):  # first, so that they run together
        long_prompt = " ".join(f"item{i}-{k}" for k in range(60))
        free = SamplingParams(temperature=0.8, seed=i, max_tokens=40, ignore_eos=True)
        engine.add_request(f"free{i}", long_prompt, free)
    for i in range(count):
        schema = SCHEMAS[i % len(SCHEMAS)]
        temperature = 0.0 if i % 2 else 0.8
        params = SamplingParams(
            temperature=temperature, seed=i, max_tokens=160,
            structured_outputs=StructuredOutputsParams(json=schema),
        )  # fmt: skip
        engine.add_request(f"s{i}", chat(engine, f"Answer in JSON, example {i}."), params)
        expected[f"s{i}"] = schema
    with forbid_compilation():
        final = run_to_completion(engine)
    after = engine.stats()
    assert after.num_preemptions > before.num_preemptions  # the batch did not fit the KV pool
    assert after.prefix_cache_hits > before.prefix_cache_hits  # the shared chat preamble
    assert len(compiled) == len(set(compiled)) <= len(SCHEMAS)  # each compiled once at most
    for rid, schema in expected.items():
        out = final[rid].outputs[0]
        assert out.finish_reason == "stop", (rid, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    for i in range(4):
        assert len(final[f"free{i}"].outputs[0].token_ids) == 40


def test_regex_choice_n_and_json_object(engine):
    engine.add_request("re", chat(engine, "A phone number?"), constrained(regex=r"\d{3}-\d{4}"))
    colours = ["red", "green", "blue"]
    sampled = SamplingParams(
        n=3, temperature=1.0, seed=3, max_tokens=8,
        structured_outputs=StructuredOutputsParams(choice=colours),
    )  # fmt: skip
    engine.add_request("choice", chat(engine, "Pick a colour."), sampled)
    few_shot = 'x=1 as JSON: {"x":1}\ny=2 as JSON: {"y":2}\nz=3 as JSON:'
    engine.add_request("obj", few_shot, constrained(json_object=True))
    final = run_to_completion(engine)
    assert re.fullmatch(r"\d{3}-\d{4}", final["re"].outputs[0].text)
    assert all(o.text in colours for o in final["choice"].outputs)
    assert json.loads(final["obj"].outputs[0].text) == {"z": 3}


def test_stop_strings_and_abort_keep_working_with_a_matcher(engine):
    params = SamplingParams(
        temperature=0, max_tokens=60, stop=[","],
        structured_outputs=StructuredOutputsParams(json=SCHEMAS[0]),
    )  # fmt: skip
    engine.add_request("stop", chat(engine, "A person in JSON."), params)
    engine.add_request("gone", chat(engine, "A person in JSON."), constrained(json=SCHEMAS[0]))
    engine.step()
    engine.abort_request("gone")
    final = run_to_completion(engine)
    out = final["stop"].outputs[0]
    assert out.stop_reason == "," and "," not in out.text and out.text.startswith("{")
    assert "gone" not in final


def test_constrained_greedy_equals_unconstrained_when_the_model_already_complies(engine):
    prompt = chat(engine, "Say hello.")
    engine.add_request("free", prompt, SamplingParams(temperature=0, max_tokens=12))
    free = run_to_completion(engine)["free"].outputs[0]
    engine.add_request("same", prompt, constrained(max_tokens=12, regex=r"(.|\n)*"))
    same = run_to_completion(engine)["same"].outputs[0]
    assert same.token_ids == free.token_ids


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (dict(json='{"type": "object"'), "not valid JSON"),
        (dict(json="true"), "must be an object"),
        (dict(grammar="root ::= ("), "invalid grammar"),
        (dict(json={"type": "strin"}), "invalid JSON schema"),
        (dict(json={"type": "array", "uniqueItems": True}), "does not support"),
        (dict(regex="[a-"), "invalid regex"),
        (dict(grammar="start: missing_rule"), "invalid grammar"),
        (dict(choice=[f"option {i}" for i in range(10_000)]), "at most 1000 are served"),
    ],
)
def test_bad_constraints_are_refused_with_the_reason(engine, spec, words):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**spec))
    with pytest.raises(RequestRejected, match=words) as info:
        engine.add_request("bad", "x", params)
    assert (info.value.reason, info.value.param) == ("invalid", "structured_outputs")
    assert not engine.has_unfinished_requests()


def test_matcher_sync_rolls_back_and_replays_exactly(engine):
    template = engine.structured.grammars.template(StructuredOutputsParams(json=SCHEMAS[0]))
    ids = engine.tokenizer.encode('{"name":"Ann","age":41}')
    matcher, fresh = SequenceMatcher(template), SequenceMatcher(template)
    matcher.sync(ids)
    assert matcher.is_complete
    for prefix in (ids[:3], ids[:1], [], ids[:5]):  # a rollback, further, to nothing, a replay
        matcher.sync(prefix)
        fresh.sync(prefix)
        assert matcher.tokens == fresh.tokens == list(prefix)
        assert matcher.matcher.compute_bitmask() == fresh.matcher.compute_bitmask()
        fresh = SequenceMatcher(template)


def test_a_row_whose_output_left_the_grammar_fails_alone(engine):
    template = engine.structured.grammars.template(StructuredOutputsParams(choice=("yes", "no")))
    good, bad = engine.structured.new_matcher(template), engine.structured.new_matcher(template)
    outside = engine.tokenizer.encode("maybe")
    masks, failed = engine.structured.fill_masks([(0, bad, outside)])  # nothing left to mask
    assert masks == {} and "outside the grammar" in failed[0]
    masks, failed = engine.structured.fill_masks([(0, good, []), (1, bad, outside)])
    assert list(masks) == [0] and list(failed) == [1]


def test_a_grammar_past_its_limits_after_the_first_token_fails_only_its_request(engine):
    """The compile-time probe reaches the first token; a parser row too wide later (3,000
    alternatives, past max_items_in_row) fails that sequence alone, with a short message."""
    alternatives = " | ".join(f'"w{i}"' for i in range(3_000))
    spec = StructuredOutputsParams(grammar=f'start: /[a-z]/ ";" c\nc: {alternatives}')
    engine.add_request(
        "wide",
        chat(engine, "Hi"),
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=spec),
    )
    engine.add_request("fine", chat(engine, "Hi"), constrained(max_tokens=8, regex="[a-z]{3}"))
    final = run_to_completion(engine)
    wide = final["wide"]
    assert wide.outputs[0].finish_reason == "error" and len(wide.outputs[0].token_ids) == 2
    assert wide.error.startswith("GrammarError: the grammar failed at output token 2: Parser")
    assert "max is 2000" in wide.error and len(wide.error) < 300 and "w2999" not in wide.error
    assert re.fullmatch("[a-z]{3}", final["fine"].outputs[0].text)


def test_the_async_engine_compiles_before_queueing_and_never_on_the_step_thread(
    engine, monkeypatch
):
    grammars = engine.structured.grammars
    compiled_on, added = [], []
    compile_, add_request = grammars._compile, engine.add_request

    def compile_recorded(kind, text):
        compiled_on.append(threading.current_thread().name)
        return compile_(kind, text)

    def add_recorded(request_id, *args, **kwargs):
        added.append((request_id, kwargs["grammar"] is not None))
        return add_request(request_id, *args, **kwargs)

    monkeypatch.setattr(grammars, "_compile", compile_recorded)
    monkeypatch.setattr(engine, "add_request", add_recorded)
    schema = {**SCHEMAS[1], "title": "not compiled before"}  # a cache miss
    prompt = chat(engine, "OK?")

    async def serve() -> tuple[list, RequestRejected]:
        aengine = AsyncLLMEngine(engine)
        try:
            params = constrained(max_tokens=20, json=schema)
            outputs = [out async for out in aengine.generate(prompt, params, "good")]
            bad = constrained(regex="(unclosed, not compiled before")
            with pytest.raises(RequestRejected, match="invalid regex") as info:
                async for _ in aengine.generate(prompt, bad, "bad"):
                    pass
            return outputs, info.value
        finally:
            await aengine.shutdown()

    outputs, refusal = asyncio.run(asyncio.wait_for(serve(), timeout=120))
    jsonschema.validate(json.loads(outputs[-1].outputs[0].text), schema)
    assert (refusal.reason, refusal.param) == ("invalid", "structured_outputs")
    assert added == [("good", True)]  # compiled before "add"; the refused one never queued
    assert len(compiled_on) == 2 and all(t.startswith("jserve-grammar") for t in compiled_on)
