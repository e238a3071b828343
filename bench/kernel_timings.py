"""Ragged paged attention benchmark: every implementation available on this backend.

Cases (SmolLM2-135M attention: 9 query heads, 3 KV heads, head_dim 64, block size 16): decode
at 8 and 32 sequences x 512 and 2,048 context, decode 32 x 4,096, and a mixed 512-token batch
(28 decodes + 4 prefill chunks). Each implementation is jitted as one program calling it
CALLS_PER_PROGRAM times (on alternating layers), warmed up, then timed as the median of several
runs, per call: a lone call's time is the host's dispatch on a GPU. "Bytes" is what attention
must move at least: the live K/V positions plus q and the output; bandwidth = bytes / median
time. On CUDA a device-to-device copy is timed in the same run and bandwidth is also given as a
fraction of it.

    python -m bench.kernel_timings                 # full run, markdown table on stdout
    python -m bench.kernel_timings --json out.json # also write the figures as JSON
    python -m bench.kernel_timings --smoke         # tiny shapes, seconds (CI)

It also times the layers' projections (`layer_matmul`, each implementation on the weight laid
out as it reads it) on SmolLM2's four weight shapes at 1 to 512 tokens, stacked over 30 layers
and run under `lax.scan` as the model runs them, so the weights come from memory and not from
cache: "bytes" is then the weights read (at a few tokens the bound; from about 16 tokens on the
products are bound by arithmetic instead).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bench.report_writer import markdown_table, write_json
from jserve.pallas import choose_impl, kv_cache_shape, ragged_paged_attention
from jserve.pallas.layer_matmul import MATMUL_IMPLS, layer_matmul, pack_layer_weight

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_LAYERS = 9, 3, 64, 16, 2
# Attention calls timed inside one program, per call: a lone call measured the host's dispatch
# on a GPU (0.15-0.36 ms for every case on an H200, CPU time equal to wall time).
CALLS_PER_PROGRAM = 8
IMPLS_BY_BACKEND = {
    "cpu": ("reference", "interpret", "xla", "native"),
    "gpu": ("reference", "triton"),
    "tpu": ("reference", "mosaic"),
}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    seqs: tuple[tuple[int, int], ...]  # (q_len, kv_len) per sequence
    # Leading pages every sequence takes from one shared list, as far as it fills them whole
    # (a cached prompt prefix); the bytes a kernel must move count them once.
    shared_blocks: int = 0


def _mixed(decodes: int, decode_ctx: int, chunks: int, chunk_len: int, chunk_ctx: int) -> Case:
    seqs = [(1, decode_ctx - 97 * i % (decode_ctx // 2)) for i in range(decodes)]
    seqs += [(chunk_len, chunk_ctx * (i + 1) // chunks) for i in range(chunks)]
    name = f"mixed {decodes} decodes + {chunks} x {chunk_len}-token chunks"
    return Case(name, tuple(seqs))


FULL_CASES = [
    Case("decode 8 x 512", ((1, 512),) * 8),
    Case("decode 8 x 2048", ((1, 2048),) * 8),
    Case("decode 32 x 512", ((1, 512),) * 32),
    Case("decode 32 x 2048", ((1, 2048),) * 32),
    Case("decode 32 x 4096", ((1, 4096),) * 32),
    _mixed(28, 2048, 4, 121, 2048),
    Case("prefill 1 x 512", ((512, 512),)),
    Case("prefill 16 x 32 after a 384-token prefix", ((32, 416),) * 16),
    Case("decode 32 x 448 sharing a 384-token prefix", ((1, 448),) * 32, shared_blocks=24),
]
SMOKE_CASES = [Case("decode 2 x 64", ((1, 64),) * 2), _mixed(2, 64, 1, 8, 40)]
# name, K, N of each projection of SmolLM2-135M (fused as jserve.models.llama fuses them)
PROJECTIONS = (
    ("wqkv", 576, 960),
    ("wo", 576, 576),
    ("w_gate_up", 576, 3072),
    ("w_down", 1536, 576),
)
MATMUL_TOKENS, MATMUL_LAYERS = (1, 4, 16, 32, 64, 128, 512), 30
SMOKE_PROJECTIONS, SMOKE_MATMUL_TOKENS, SMOKE_MATMUL_LAYERS = (("w", 64, 40),), (1, 3), 2


def make_inputs(case: Case, dtype, seed: int = 0) -> tuple[jax.Array, ...]:
    """Device arrays for one call: random pools, pages scattered over the pool, layer 1."""
    rng = np.random.default_rng(seed)
    needed = [-(-kv // BLOCK_SIZE) for _, kv in case.seqs]
    shared = [min(case.shared_blocks, kv // BLOCK_SIZE) for _, kv in case.seqs]
    num_blocks = 1 + max(shared) + sum(needed) - sum(shared)
    shape = kv_cache_shape(
        NUM_LAYERS, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, impl="reference"
    )  # the canonical layout; `laid_out` gives each implementation its own
    k_pool = rng.standard_normal(shape, np.float32)
    v_pool = rng.standard_normal(shape, np.float32)
    free = 1 + rng.permutation(num_blocks - 1)
    prefix, free = free[: max(shared)], free[max(shared) :]
    tables = np.zeros((len(case.seqs), max(needed)), np.int32)
    for s, n in enumerate(needed):
        tables[s, : shared[s]] = prefix[: shared[s]]
        tables[s, shared[s] : n], free = free[: n - shared[s]], free[n - shared[s] :]
    cu = np.concatenate([[0], np.cumsum([q for q, _ in case.seqs])]).astype(np.int32)
    kv_lens = np.array([kv for _, kv in case.seqs], np.int32)
    q = rng.standard_normal((int(cu[-1]), NUM_Q_HEADS, HEAD_DIM), np.float32)
    host = (q, k_pool, v_pool)
    return (
        *(jnp.asarray(x, dtype) for x in host),
        *(jnp.asarray(x) for x in (tables, cu, kv_lens)),
        jnp.asarray(len(case.seqs), jnp.int32),
        jnp.asarray(1, jnp.int32),
    )


def bytes_moved(case: Case, itemsize: int) -> int:
    """Live K and V positions read plus q read and output written."""
    shared = [min(case.shared_blocks, kv // BLOCK_SIZE) * BLOCK_SIZE for _, kv in case.seqs]
    positions = sum(kv for _, kv in case.seqs) - sum(shared) + max(shared)
    kv = positions * NUM_KV_HEADS * HEAD_DIM * 2
    tokens = sum(q for q, _ in case.seqs) * NUM_Q_HEADS * HEAD_DIM * 2
    return (kv + tokens) * itemsize


def median_seconds(fn, args, reps: int, warmup: int = 2) -> tuple[float, float]:
    """Median wall and CPU seconds (this process, all threads) of one call."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    wall, cpu = [], []
    for _ in range(reps):
        start, start_cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(fn(*args))
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


def copy_bandwidth(num_bytes: int, reps: int) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second)."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 0.0)
    return 2 * num_bytes / median_seconds(copy, (x,), reps)[0]


def laid_out(args: tuple[jax.Array, ...], impl: str) -> tuple[jax.Array, ...]:
    """`make_inputs`'s arguments with the pools in `impl`'s layout (a row-major reshape)."""
    _, num_blocks, _, _, _ = args[1].shape
    shape = kv_cache_shape(NUM_LAYERS, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, impl=impl)
    return (args[0], args[1].reshape(shape), args[2].reshape(shape), *args[3:])


def repeated_attention(impl: str) -> Callable[..., jax.Array]:
    """One jitted program calling attention CALLS_PER_PROGRAM times on `make_inputs`'s
    arguments, alternating layers so that no call repeats another (none can be hoisted), and
    returning the outputs' sum."""
    attend = functools.partial(ragged_paged_attention, sm_scale=HEAD_DIM**-0.5, impl=impl)

    def program(*args: jax.Array) -> jax.Array:
        *inputs, layer = args

        def one(i, total):
            out = attend(*inputs, (layer + i) % NUM_LAYERS)
            return total + out.astype(jnp.float32).sum()

        return lax.fori_loop(0, CALLS_PER_PROGRAM, one, jnp.float32(0))

    return jax.jit(program)


def run(cases: list[Case], impls: tuple[str, ...], dtype, reps: int) -> list[dict]:
    rows = []
    for case in cases:
        args = make_inputs(case, dtype)
        moved = bytes_moved(case, jnp.dtype(dtype).itemsize)
        for impl in impls:
            fn = repeated_attention(impl)
            seconds, cpu_seconds = (
                t / CALLS_PER_PROGRAM for t in median_seconds(fn, laid_out(args, impl), reps)
            )
            rows.append(
                dict(
                    case=case.name,
                    impl=impl,
                    tokens=int(args[0].shape[0]),
                    ms=seconds * 1e3,
                    cpu_ms=cpu_seconds * 1e3,
                    mbytes=moved / 1e6,
                    gbps=moved / seconds / 1e9,
                )
            )
        del args
    return rows


def run_matmuls(
    projections: tuple,
    token_counts: tuple[int, ...],
    layers: int,
    impls: tuple[str, ...],
    reps: int,
) -> list[dict]:
    """Each projection over `layers` stacked weights under lax.scan, per implementation."""
    rows = []
    rng = np.random.default_rng(0)
    for name, k, n in projections:
        w = jnp.asarray(rng.standard_normal((layers, k, n), np.float32))
        for tokens in token_counts:
            x = jnp.asarray(rng.standard_normal((tokens, k), np.float32))
            for impl in impls:
                laid_out = pack_layer_weight(w, impl)

                def stack(x, w, impl=impl, n=n):
                    def one(total, layer):
                        return total + layer_matmul(x, w, layer, impl, n), None

                    zero = jnp.zeros((x.shape[0], n), x.dtype)
                    return jax.lax.scan(one, zero, jnp.arange(layers, dtype=jnp.int32))[0]

                seconds, cpu_seconds = median_seconds(jax.jit(stack), (x, laid_out), reps)
                del laid_out
                rows.append(
                    dict(
                        case=f"matmul {name} {k}x{n} x {layers} layers",
                        impl=impl,
                        tokens=tokens,
                        ms=seconds * 1e3,
                        cpu_ms=cpu_seconds * 1e3,
                        mbytes=w.nbytes / 1e6,
                        gbps=w.nbytes / seconds / 1e9,
                    )
                )
        del w
    return rows


def markdown(rows: list[dict], copy_gbps: float | None) -> str:
    header = ["case", "impl", "tokens", "median ms", "CPU ms", "MB moved", "GB/s"]
    cells = [
        [r["case"], r["impl"], str(r["tokens"]), f"{r['ms']:.2f}", f"{r['cpu_ms']:.2f}",
         f"{r['mbytes']:.1f}", f"{r['gbps']:.1f}"]
        + ([f"{r['gbps'] / copy_gbps:.0%}"] if copy_gbps else [])
        for r in rows
    ]  # fmt: skip
    if copy_gbps:
        header.append("of copy BW")
    table = markdown_table(header, cells, align="llrrrrr" + "r" * bool(copy_gbps))
    if copy_gbps:
        table += f"\n\nDevice-to-device copy: {copy_gbps:.0f} GB/s (read + write)."
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, for CI")
    parser.add_argument("--reps", type=int, default=None, help="timed runs per measurement")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--json", type=Path, default=None, help="also write rows as JSON")
    args = parser.parse_args(argv)
    backend = jax.default_backend()
    impls = IMPLS_BY_BACKEND.get(backend, ("reference",))
    if args.dtype != "float32":  # the native CPU kernel is float32 only
        impls = tuple(i for i in impls if i != "native")
    reps = args.reps or (2 if args.smoke else 10)
    cases = SMOKE_CASES if args.smoke else FULL_CASES
    copy_gbps = None
    if backend == "gpu":
        copy_gbps = copy_bandwidth(2**24 if args.smoke else 2**30, reps) / 1e9
    rows = run(cases, impls, jnp.dtype(args.dtype), reps)
    if backend == "cpu" and args.dtype == "float32":
        shapes = (
            (SMOKE_PROJECTIONS, SMOKE_MATMUL_TOKENS, SMOKE_MATMUL_LAYERS)
            if args.smoke
            else (PROJECTIONS, MATMUL_TOKENS, MATMUL_LAYERS)
        )
        rows += run_matmuls(*shapes, MATMUL_IMPLS, reps)
    print(
        f"backend {backend} ({jax.devices()[0].device_kind}), {args.dtype}, "
        f"auto impl = {choose_impl(dtype=jnp.dtype(args.dtype))}, median of {reps} runs\n"
    )
    print(markdown(rows, copy_gbps))
    if args.json:
        payload = dict(backend=backend, dtype=args.dtype, copy_gbps=copy_gbps, rows=rows)
        write_json(args.json, payload)


if __name__ == "__main__":
    main()
