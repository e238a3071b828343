"""Time one sampler call per feature mix and sequence bucket, as the engine makes it.

Each call is `Sampler.sample` on logits already on the device: the host builds the batch's
sampling tensors, the bucket's precompiled executable runs, and its outputs come back to the
host. Logits are random with SmolLM2's vocabulary (49,152), every row of a call has the same
parameters; the figure is the minimum over the repetitions, in ms.

    python -m bench.sampler_timings
    python -m bench.sampler_timings --buckets 8 32 64 --reps 25
"""

from __future__ import annotations

import argparse
import time

import jax.numpy as jnp
import numpy as np

from bench.report_writer import markdown_table
from jserve.runtime.sampler import Sampler
from jserve.runtime.sampling_tensors import SamplingRow
from jserve.sampling_params import SamplingParams

VOCAB = 49_152
CASES = {
    "greedy": SamplingParams(temperature=0),
    "temperature 0.8": SamplingParams(temperature=0.8),
    "T 0.7, top_p 0.9, top_k 50": SamplingParams(temperature=0.7, top_p=0.9, top_k=50),
    "T 0.8 with three penalties": SamplingParams(
        temperature=0.8, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5
    ),
    "greedy with logprobs": SamplingParams(temperature=0, logprobs=5),
    "T 0.8, logit_bias on 50 ids": SamplingParams(
        temperature=0.8, logit_bias={i: 2.0 for i in range(0, 5000, 100)}
    ),
}


def time_calls(buckets: list[int], reps: int) -> dict[str, dict[int, float]]:
    """{case: {bucket: min ms per call}}."""
    sampler = Sampler(VOCAB, buckets, max_model_len=2048)
    sampler.precompile()
    rng = np.random.default_rng(0)
    out: dict[str, dict[int, float]] = {}
    for name, params in CASES.items():
        out[name] = {}
        for s in buckets:
            rows = [SamplingRow(params, 1, list(range(20)), list(range(5)), []) for _ in range(s)]
            logits = jnp.asarray(rng.standard_normal((s, VOCAB), np.float32) * 3)
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                sampler.sample(logits, rows)
                times.append(time.perf_counter() - start)
            out[name][s] = 1e3 * min(times)
    return out


def markdown(table: dict[str, dict[int, float]]) -> str:
    buckets = list(next(iter(table.values())))
    rows = [[name, *(f"{row[s]:.2f}" for s in buckets)] for name, row in table.items()]
    return markdown_table(["ms", *(f"S={s}" for s in buckets)], rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buckets", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--reps", type=int, default=25, help="calls per figure (minimum)")
    args = parser.parse_args(argv)
    print(markdown(time_calls(args.buckets, args.reps)))


if __name__ == "__main__":
    main()
