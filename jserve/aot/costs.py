"""FLOPs and bytes of a compiled executable, per device, from XLA's own cost analysis.

Three corrections make XLA's figures a step's:
- XLA's HloCostAnalysis counts a while loop's body once. The model's layers run in one
  `lax.scan`, so the body (one layer) is analysed on its own and counted trip-count times:
  cost = whole module + (trips - 1) x body, for each top-level loop of `trips` iterations.
- A kernel (a Pallas or native custom call) is opaque to XLA, which counts it as nothing.
  `attention_cost` is the attention kernels' own count at a stated context, added on top.
- A scatter fusion that updates the KV pool in place (XLA's GPU KV write) is counted as reading
  and writing the whole pool; it moves only the step's new rows, so those two pools are taken
  out.

The analysis is XLA's CPU HloCostAnalysis run on the target's optimized module (the only one
that can analyse a loop body apart; on a compile-only GPU there is no other).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import jax
from jax._src.lib import _jax
from jaxlib import _hlo

from jserve.models.config import ModelConfig

# Attention implementations that are one custom call XLA cannot see into.
KERNEL_IMPLS = ("native", "mosaic", "triton")


@dataclass(frozen=True)
class Cost:
    flops: float
    bytes: float

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.bytes + other.bytes)

    def __mul__(self, n: float) -> Cost:
        return Cost(self.flops * n, self.bytes * n)


def _analyse(module: object) -> Cost:
    stats = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
    return Cost(float(stats.get("flops", 0.0)), float(stats.get("bytes accessed", 0.0)))


_WHILE = re.compile(r"\bwhile\(.*?condition=%?([\w.\-]+), body=%?([\w.\-]+)")
_CONSTANT = re.compile(r"s32\[\](?:\{[^}]*\})? constant\((\d+)\)")  # with or without a layout


def _computations(text: str) -> dict[str, list[str]]:
    """Each computation's lines by name (the entry's under "ENTRY")."""
    out: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        header = re.match(r"(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header and not line.startswith(" "):
            name = "ENTRY" if header.group(1) else header.group(2)
            out[name] = []
        elif name is not None:
            out[name].append(line)
    return out


def _constants(computations: dict[str, list[str]], name: str) -> set[int]:
    """The s32 scalar constants of a computation and of those it calls (a loop's bound sits in
    its condition, or on GPU in a fusion the condition calls)."""
    lines = computations.get(name, [])
    found = {int(c) for line in lines for c in _CONSTANT.findall(line)}
    for line in lines:
        for called in re.findall(r"calls=%?([\w.\-]+)", line):
            found |= _constants(computations, called)
    return found


def _as_entry(text: str, body: str) -> str:
    """The module's text with computation `body` as its entry (the old entry left unused)."""
    lines = []
    for line in text.splitlines():
        if line.startswith("ENTRY "):
            line = line.removeprefix("ENTRY ")
        elif re.match(rf"%?{re.escape(body)} ", line):
            line = "ENTRY " + line
        lines.append(line)
    return "\n".join(lines)


# XLA's HLO names of the KV pools' element types (every --kv-cache-dtype's)
_HLO_TYPES = {
    "float32": "f32",
    "bfloat16": "bf16",
    "float16": "f16",
    "int8": "s8",
    "float8_e4m3fn": "f8e4m3fn",
    "float8_e5m2": "f8e5m2",
}


def _pool_fusions(
    computations: dict[str, list[str]], name: str, pool: jax.ShapeDtypeStruct | None
) -> int:
    """How many scatter fusions in computation `name` produce a whole KV pool (XLA counts
    their operand and result whole; an in-place dynamic-update-slice it counts right)."""
    if pool is None:
        return 0
    shape = pool.sharding.shard_shape(pool.shape) if pool.sharding is not None else pool.shape
    result = f"= {_HLO_TYPES[jax.numpy.dtype(pool.dtype).name]}[{','.join(map(str, shape))}]"
    count = 0
    for line in computations.get(name, []):
        called = re.search(r"calls=%?([\w.\-]+)", line)
        if result in line and " fusion(" in line and called:
            roots = [x for x in computations.get(called.group(1), []) if "ROOT " in x]
            count += any(" scatter(" in root for root in roots)
    return count


def loop_corrected_cost(
    compiled: jax.stages.Compiled, trips: int, pool: jax.ShapeDtypeStruct | None = None
) -> Cost:
    """Per-device FLOPs and bytes of `compiled`, each top-level loop of `trips` iterations (the
    layer scan) counted `trips` times (other loops as XLA counts them), without the whole-pool
    traffic XLA charges an in-place update of a KV pool shaped as `pool`."""
    module = compiled.runtime_executable().hlo_modules()[0]
    text = module.to_string()
    cost = _analyse(module)
    computations = _computations(text)
    entry = computations.get("ENTRY", [])
    pool_bytes = 0.0 if pool is None else 2.0 * _shard_bytes(pool)
    cost += Cost(0.0, -pool_bytes * _pool_fusions(computations, "ENTRY", pool))
    for line in entry:
        match = _WHILE.search(line)
        if match is None:
            continue
        condition, body = match.groups()
        if trips > 1 and trips in _constants(computations, condition):
            body_cost = _analyse(_hlo.hlo_module_from_text(_as_entry(text, body)))
            cost += body_cost * (trips - 1)
            cost += Cost(0.0, -pool_bytes * trips * _pool_fusions(computations, body, pool))
    return cost


def _shard_bytes(x: jax.ShapeDtypeStruct) -> float:
    shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    return float(math.prod(shape) * jax.numpy.dtype(x.dtype).itemsize)


def attention_cost(
    cfg: ModelConfig, tokens: int, seqs: int, context: int, itemsize: int, shards: int
) -> Cost:
    """Per-device FLOPs and bytes of the attention kernels of one step (all layers) when every
    one of `seqs` sequences has `context` positions and each of the `tokens` queries sees all
    of them: QK and PV products, and each sequence's K and V read once per layer (a lower
    bound: a prefill chunk's query blocks each read it). Heads split over `shards` devices."""
    q_heads, kv_heads = cfg.num_heads / shards, cfg.num_kv_heads / shards
    flops = 4.0 * tokens * q_heads * cfg.head_dim * context
    kv_read = 2.0 * seqs * context * kv_heads * cfg.head_dim * itemsize
    return Cost(flops, kv_read) * cfg.num_layers
