"""Structured outputs: a JSON-schema workload constrained vs the same workload unconstrained.

One engine runs both, in ABBA order (constrained, free, free, constrained; bench.ab_driver) so
that drift in machine load hits both alike. The free run is the same prompts and the same
sampling, with each request's max_tokens set to the length its constrained output had and EOS
ignored, so both runs generate exactly the same number of tokens and only the grammar differs.
Reported: output tokens/s of each and their ratio (goal >= 0.85; also per CPU second of this
process, which other load moves less, and each pair's ratio: min, median, max), host time per
step in the grammar engine (matcher sync, bitmask fill, token consume), and the share of
constrained outputs that parse and validate against their schema (goal 100%). Any compile
during the runs fails it.

    python -m bench.structured_overhead                      # 64 requests, about 2-4 minutes
    python -m bench.structured_overhead --requests 8 --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time

import jsonschema

from bench.ab_driver import Alternation, alternate, describe
from bench.report_writer import write_json
from jserve.config.engine_args import EngineArgs
from jserve.engine.llm_engine import LLMEngine
from jserve.loaders.model_source import load_model
from jserve.runtime.compilation import forbid_compilation
from jserve.sampling_params import SamplingParams, StructuredOutputsParams

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "city": {
        "type": "object",
        "properties": {
            "city": NAME,
            "country": NAME,
            "sights": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3},
        },
        "required": ["city", "country", "sights"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "item": NAME,
            "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
            "express": {"type": "boolean"},
        },
        "required": ["item", "quantity", "express"],
        "additionalProperties": False,
    },
    "review": {
        "type": "object",
        "properties": {
            "stars": {"enum": [1, 2, 3, 4, 5]},
            "summary": {"type": "string", "maxLength": 60},
            "mood": {"enum": ["happy", "neutral", "angry"]},
        },
        "required": ["stars", "summary", "mood"],
        "additionalProperties": False,
    },
}
QUESTIONS = {
    "person": "Describe a famous scientist as JSON with name and age.",
    "city": "Describe a European capital as JSON: city, country and some sights.",
    "order": "Turn this into a JSON order: two large pizzas, delivered fast.",
    "review": "Write a short restaurant review as JSON with stars, summary and mood.",
}
ENGINE = dict(max_num_seqs=32, max_num_batched_tokens=256, max_model_len=1024)


def requests(tokenizer, n: int) -> list[tuple[str, list[int], SamplingParams, dict]]:
    """(id, prompt ids, constrained params, schema) for n requests over the schemas."""
    names = list(SCHEMAS)
    out = []
    for i in range(n):
        name = names[i % len(names)]
        messages = [{"role": "user", "content": f"{QUESTIONS[name]} (Example {i}.)"}]
        ids = tokenizer.apply_chat_template(messages, tokenize=True)
        params = SamplingParams(
            temperature=0.0 if i % 2 else 0.7, seed=i, max_tokens=256,
            structured_outputs=StructuredOutputsParams(json=SCHEMAS[name]),
        )  # fmt: skip
        out.append((f"{name}-{i}", ids, params, SCHEMAS[name]))
    return out


def run(engine: LLMEngine, batch: list[tuple[str, list[int], SamplingParams]]) -> dict:
    """All of `batch` at once; wall time, steps, outputs and grammar host time."""
    host0, masked0 = engine.structured.host_seconds, engine.structured.num_masked_steps
    for rid, ids, params in batch:
        engine.add_request(rid, ids, params)
    final, steps = {}, 0
    start, cpu_start = time.perf_counter(), time.process_time()
    with forbid_compilation():
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out.outputs[0]
            steps += 1
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    tokens = sum(len(o.token_ids) for o in final.values())
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "steps": steps,
        "output_tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "grammar_host_s": engine.structured.host_seconds - host0,
        "masked_steps": engine.structured.num_masked_steps - masked0,
        "outputs": final,
    }


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def abba(engine: LLMEngine, constrained: list) -> Alternation:
    """Constrained, free, free, constrained; the free runs ask for the lengths the first
    constrained run produced. Request ids are the run's tag ("c1-", "u1-", ...) and the id."""
    lengths: dict[str, int] = {}
    c_tags, u_tags = itertools.count(1), itertools.count(1)

    def constrained_run() -> dict:
        tag = f"c{next(c_tags)}"
        result = run(engine, [(f"{tag}-{r}", i, p) for r, i, p in constrained])
        if not lengths:
            lengths.update({rid[3:]: len(o.token_ids) for rid, o in result["outputs"].items()})
        return result

    def free_run() -> dict:
        tag = f"u{next(u_tags)}"
        return run(engine, [
            (f"{tag}-{rid}", ids, SamplingParams(
                temperature=params.temperature, seed=params.seed, max_tokens=lengths[rid],
                ignore_eos=True,
            ))
            for rid, ids, params in constrained
        ])  # fmt: skip

    return alternate(constrained_run, free_run, 2, abba=True)


def figures(runs: Alternation, reqs: list, num_requests: int) -> dict:
    (first, second), (free1, free2) = runs.a, runs.b
    schemas = {rid: schema for rid, _, _, schema in reqs}
    checked = [valid(o.text, schemas[rid[3:]]) for r in runs.a for rid, o in r["outputs"].items()]
    c_rate = statistics.mean([first["tokens_per_s"], second["tokens_per_s"]])
    u_rate = statistics.mean([free1["tokens_per_s"], free2["tokens_per_s"]])
    c_steps = first["steps"] + second["steps"]
    c_cpu = (first["cpu_seconds"] + second["cpu_seconds"]) / (2 * first["output_tokens"])
    u_cpu = (free1["cpu_seconds"] + free2["cpu_seconds"]) / (2 * first["output_tokens"])
    return {
        "requests": num_requests,
        "schemas": len(SCHEMAS),
        "engine": ENGINE,
        "constrained_tokens_per_s": round(c_rate, 1),
        "unconstrained_tokens_per_s": round(u_rate, 1),
        "throughput_ratio": round(c_rate / u_rate, 3),
        "ab": runs.summary(lambda c, u: c["tokens_per_s"] / u["tokens_per_s"]),
        # CPU seconds of this process per output token: less sensitive to other load
        "cpu_ms_per_token_constrained": round(1e3 * c_cpu, 2),
        "cpu_ms_per_token_unconstrained": round(1e3 * u_cpu, 2),
        "cpu_throughput_ratio": round(u_cpu / c_cpu, 3),
        "grammar_host_ms_per_step": round(
            1e3 * (first["grammar_host_s"] + second["grammar_host_s"]) / c_steps, 3
        ),
        "step_ms_constrained": round(1e3 * (first["seconds"] + second["seconds"]) / c_steps, 1),
        "step_ms_unconstrained": round(
            1e3 * (free1["seconds"] + free2["seconds"]) / (free1["steps"] + free2["steps"]), 1
        ),
        "output_tokens_per_run": first["output_tokens"],
        "valid_share": round(sum(checked) / len(checked), 4),
        "load_1min_before_after": [round(runs.load_before, 2), round(runs.load_after, 2)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    loaded = load_model(None)
    t0 = time.perf_counter()
    engine = LLMEngine(EngineArgs(**ENGINE), loaded=loaded)
    print(f"engine built in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    reqs = requests(engine.tokenizer, args.requests)
    constrained = [(rid, ids, params) for rid, ids, params, _ in reqs]
    run(engine, [(f"warm-{r}", i, p) for r, i, p in constrained[:4]])  # fills the grammar cache
    result = figures(abba(engine, constrained), reqs, args.requests)
    print(json.dumps({k: v for k, v in result.items() if k != "ab"}, indent=2))
    print(f"constrained / free output tok/s by pair: {describe(result['ab']['ratio'])}")
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
