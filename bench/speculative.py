"""Speculative decoding (n-gram), one request at a time: time per output token with and without
`--speculative-config` on input-grounded prompts (a list to copy, code to continue, a passage
to quote), greedy, with the outputs checked token for token equal.

One engine serves both sides: speculation is switched by its scheduler's config (a verify step
uses the same precompiled step shapes), and the sides alternate prompt by prompt through the
A/B driver (bench.ab_driver), so a shared machine's drift hits both alike; the 1-minute load
average around the run is recorded with the result.

    python -m bench.speculative --json bench/results/speculative_cpu.json

Not yet here (issue 35): an open workload (stories, chat) and concurrency 4 and 32.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time

from bench.ab_driver import alternate, describe, ratio_stats
from bench.report_writer import write_json
from jserve.config.engine_args import EngineArgs
from jserve.engine.llm_engine import LLMEngine
from jserve.sampling_params import SamplingParams

PROMPTS = {
    "copy": "Copy this list exactly, one item per line:\n"
    + "".join(f"- item {i}: apple, banana, cherry, {i * 7} grams\n" for i in range(12)),
    "code": "Rename the function add to plus and repeat the code:\n\n"
    + "".join(
        f"def add{i}(a, b):\n    # adds two numbers\n    return a + b + {i}\n\n" for i in range(6)
    ),
    "quote": "Quote the first sentence of this passage word for word.\n\n"
    + "The history of computing is a story of ideas meeting machines. Early calculators were "
    "mechanical, then electrical, and finally electronic; each step made arithmetic faster.",
}


def _generate(engine: LLMEngine, prompt: str, max_tokens: int) -> tuple[list[int], float]:
    """One request alone, chat-templated and greedy: its tokens and seconds to finish."""
    tokenizer = engine.tokenizer
    template = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    ids = tokenizer.encode(template, add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    started = time.perf_counter()
    engine.add_request("r", {"prompt_token_ids": ids}, params)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
    return tokens, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speculative-config", default='{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}')  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=2, help="A/B pairs per prompt")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    # The test suite's sizes (tests/shared_engine.py): its compiled steps are reused.
    sizes = dict(max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=49, max_model_len=512)
    engine = LLMEngine(EngineArgs(**sizes))
    plain = engine.scheduler.config
    spec = dataclasses.replace(plain, speculative_config=args.speculative_config)

    def side(config, prompt):
        def run():
            engine.scheduler.reconfigure(config)
            engine.reset()  # no prefix-cache hits from the other side's run
            before = engine.stats()
            tokens, seconds = _generate(engine, prompt, args.max_tokens)
            after = engine.stats()
            drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
            accepted = (
                after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
            )
            return {"tokens": tokens, "tpot_ms": 1000 * seconds / len(tokens),
                    "drafted": drafted, "accepted": accepted}  # fmt: skip

        return run

    _generate(engine, "Hello", 8)  # first-use costs (native kernels, caches) out of the way
    rows = {}
    for name, prompt in PROMPTS.items():
        ab = alternate(side(plain, prompt), side(spec, prompt), args.pairs, abba=True)
        assert all(a["tokens"] == b["tokens"] for a, b in zip(ab.a, ab.b, strict=True)), name
        speedup = ratio_stats(ab.ratios(lambda a, b: a["tpot_ms"] / b["tpot_ms"]))
        drafted = sum(b["drafted"] for b in ab.b)
        rows[name] = {
            "output_tokens": len(ab.a[0]["tokens"]),
            "tpot_ms_off": [a["tpot_ms"] for a in ab.a],
            "tpot_ms_on": [b["tpot_ms"] for b in ab.b],
            "speedup": speedup,
            "acceptance": sum(b["accepted"] for b in ab.b) / drafted if drafted else None,
            "loadavg_1min": ab.loadavg_1min,
        }
        print(
            f"{name}: {rows[name]['output_tokens']} tokens, TPOT speedup {describe(speedup)}, "
            f"acceptance {rows[name]['acceptance']}, load {ab.loadavg_1min}"
        )
    result = {
        "speculative_config": json.loads(args.speculative_config),
        "machine": platform.processor() or platform.machine(),
        "prompts": rows,
    }
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
