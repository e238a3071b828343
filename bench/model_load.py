"""Time to a ready model (parameters on device): from the GGUF file vs from jserve's cache.

Each path runs in a fresh subprocess (nothing warm in memory), alternating (bench.ab_driver),
`--repeats` times; prints the medians, their ratio, and each pair's ratio (min, median, max).

    python -m bench.model_load [--repeats 3] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile

from bench.ab_driver import alternate, describe, ratio_stats
from bench.report_writer import markdown_table

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import jax, jax.numpy as jnp
from jserve.loaders.model_source import load_model
from jserve.runtime.params import make_mesh, place_model
t_import = time.perf_counter()
loaded = load_model(None, cache_dir=sys.argv[2], use_cache=sys.argv[1] == "cache")
_, state = place_model(loaded.config, loaded.params, jnp.float32, make_mesh())
jax.block_until_ready(state)
t_ready = time.perf_counter()
print(json.dumps({"import_s": t_import - t0, "load_s": t_ready - t_import}))
"""


def run(mode: str, cache_dir: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, cache_dir], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="one repeat (CI)")
    args = parser.parse_args()
    repeats = 1 if args.smoke else args.repeats
    with tempfile.TemporaryDirectory() as cache_dir:
        run("cache", cache_dir)  # fill the cache once
        pairs = alternate(
            lambda: run("gguf", cache_dir)["load_s"], lambda: run("cache", cache_dir)["load_s"],
            repeats,
        )  # fmt: skip
    gguf, cache = statistics.median(pairs.a), statistics.median(pairs.b)
    print(markdown_table(["path", "median s to parameters on device"], [
        ["GGUF (read + dequantize + tokenizer)", f"{gguf:.2f}"],
        ["jserve cache (orbax + tokenizer.json)", f"{cache:.2f}"],
    ]))  # fmt: skip
    by_pair = describe(ratio_stats(pairs.ratios(lambda g, c: g / c)))
    print(
        f"speedup from cache: {gguf / cache:.2f}x over {repeats} run(s) each (by pair: "
        f"{by_pair}); 1-minute load {pairs.load_before:.2f} -> {pairs.load_after:.2f}"
    )


if __name__ == "__main__":
    main()
