"""Time to a ready model (parameters on device): from the GGUF file vs from jserve's cache.

Each path runs in a fresh subprocess (nothing warm in memory), alternating, `--repeats` times;
prints the medians and their ratio.

    python bench/model_load.py [--repeats 3] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile

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
        times: dict[str, list[float]] = {"gguf": [], "cache": []}
        for _ in range(repeats):
            for mode in times:
                times[mode].append(run(mode, cache_dir)["load_s"])
    gguf, cache = (statistics.median(times[m]) for m in ("gguf", "cache"))
    print("| path | median s to parameters on device |")
    print("|---|---|")
    print(f"| GGUF (read + dequantize + tokenizer) | {gguf:.2f} |")
    print(f"| jserve cache (orbax + tokenizer.json) | {cache:.2f} |")
    print(f"speedup from cache: {gguf / cache:.2f}x over {repeats} run(s) each")


if __name__ == "__main__":
    main()
