"""The compile report: each executable's compile time, cost and memory, each chip's fit,
where the executables were written (jserve.aot.cache) and the host's scheduler cost beside
the decode step (jserve.aot.host).

All figures are per device (one chip), as XLA reports them for an SPMD program. Memory on a
chip while serving is the parameters' shard, the KV pool's shard, the largest scratch any one
executable needs (one runs at a time) and the code of all of them (all stay loaded).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jserve.aot.targets import Chip, Target
from jserve.config.engine_args import EngineArgs
from jserve.models.config import ModelConfig

GOAL_SHARE = 0.2  # the host keeps the chip busy when an iteration takes under this of a step
CONTEXTS = (
    2048,
    8192,
    32768,
    131072,
)  # context lengths the capacity table lists (and max_model_len)


@dataclass
class ExecutableReport:
    name: str  # "decode step", "mixed step", "sample", "kv pool init"
    tokens: int | None = None  # the step's token bucket
    seqs: int | None = None  # its sequence bucket (the sampler's rows)
    compile_s: float = 0.0
    flops: float = 0.0  # XLA's count, the layer scan counted once per layer
    bytes: float = 0.0
    attention_flops: float = 0.0  # the attention kernels' own count, at max_model_len context
    attention_bytes: float = 0.0
    roofline_ms: float | None = None  # max(FLOPs / peak, bytes / HBM bandwidth)
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0  # scratch
    code_bytes: int = 0
    error: str | None = None
    cache: str | None = None  # what became of it in the compilation cache (a CacheOutcome)
    cache_entry: str | None = None  # the file it wrote there


@dataclass
class MemoryFit:
    hbm_bytes: int | None  # one device's HBM (None: a CPU target)
    weights_bytes: int
    kv_pool_bytes: int
    scratch_bytes: int  # the largest temp of any executable
    step_scratch_bytes: int  # the largest temp of a model step: what attention adds to the pool
    code_bytes: int  # all executables' code
    kv_token_bytes: float  # one token's K and V, all layers, on this device
    capacity: dict[int, int] = field(default_factory=dict)  # context -> sequences that fit

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_pool_bytes + self.scratch_bytes + self.code_bytes

    @property
    def fits(self) -> bool:
        return self.hbm_bytes is None or self.total_bytes <= self.hbm_bytes


def memory_per_chip(
    rows: list[ExecutableReport],
    weights_bytes: int,
    kv_pool_bytes: int,
    target: Target,
    args: EngineArgs,
    shapes: Any,
    cfg: ModelConfig,
) -> MemoryFit:
    """One device's memory, and how many sequences of each context its HBM could hold with
    the pool taking everything the weights, scratch and code leave."""
    steps = [r.temp_bytes for r in rows if r.name.endswith("step")]
    chip = target.chip
    hbm = None if chip is None else int(chip.hbm_bytes * target.num_chips / len(target.devices))
    fit = MemoryFit(
        hbm_bytes=hbm,
        weights_bytes=weights_bytes,
        kv_pool_bytes=kv_pool_bytes,
        scratch_bytes=max((r.temp_bytes for r in rows), default=0),
        step_scratch_bytes=max(steps, default=0),
        code_bytes=sum(r.code_bytes for r in rows),
        kv_token_bytes=shapes.block_bytes / args.block_size / args.tensor_parallel_size,
    )
    if hbm is not None:
        free = hbm - fit.weights_bytes - fit.scratch_bytes - fit.code_bytes
        tokens = max(0, int(free // fit.kv_token_bytes))
        contexts = {
            shapes.max_model_len,
            *(c for c in CONTEXTS if c <= cfg.max_position_embeddings),
        }
        for context in sorted(contexts):
            blocks = math.ceil(context / args.block_size) * args.block_size
            fit.capacity[context] = tokens // blocks
    return fit


@dataclass
class HostLoad:
    """The host's scheduler iteration cost at one synthetic load (jserve.simulate.host_cost)."""

    running: int
    waiting: int
    iterations: int
    p50_ms: float
    p99_ms: float
    cpu_p50_ms: float


@dataclass
class HostCost:
    cpu: str  # the model name of the CPU it was measured on
    load_average: float  # 1-minute load average before the measurement
    loads: list[HostLoad]


@dataclass
class Report:
    model: str
    target: str
    chip: Chip | None
    dtype: str
    kv_cache_dtype: str  # the KV pool's elements: "auto" (dtype), or "int8", "fp8_e4m3"...
    quantization: str  # the weights' --quantization: "int8", or "none" (a GGUF dequantized)
    attention_impl: str
    tensor_parallel_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    token_buckets: list[int]
    seq_buckets: list[int]
    executables: list[ExecutableReport]
    memory: MemoryFit
    serve_flags: str  # the engine flags a server needs to run these executables
    compilation_cache_dir: str | None = None  # where the executables were written
    host: HostCost | None = None

    @property
    def errors(self) -> list[str]:
        """Why the report is not clean: each failed compile, and HBM overcommitted."""
        out = [f"{_label(r)} failed to compile: {r.error}" for r in self.executables if r.error]
        m = self.memory
        if not m.fits:
            assert m.hbm_bytes is not None
            fix = "lower --kv-cache-memory / --kv-cache-fraction or raise --tensor-parallel-size"
            if m.weights_bytes >= m.hbm_bytes:
                fix = (
                    "the weights alone do not fit: split them over more chips (a larger "
                    "--tensor-parallel-size, on a larger slice) or chips with more HBM"
                )
            out.append(
                f"does not fit: {_gib(m.total_bytes)} needed per chip (weights "
                f"{_gib(m.weights_bytes)}, KV pool {_gib(m.kv_pool_bytes)}, scratch "
                f"{_gib(m.scratch_bytes)}, code {_gib(m.code_bytes)}) > {_gib(m.hbm_bytes)} HBM; "
                f"{fix}"
            )
        return out

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["memory"]["total_bytes"] = self.memory.total_bytes
        out["memory"]["fits"] = self.memory.fits
        out["errors"] = self.errors
        return out

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    def table(self) -> str:
        """The report as Markdown: a header, the executables, the memory and the capacity."""
        chip = self.chip.name if self.chip else "no chip figures"
        lines = [
            f"{self.model} on {self.target} ({chip}), {self.dtype}, weights "
            f"{self.quantization}, attention "
            f"{self.attention_impl}, TP {self.tensor_parallel_size}, max_model_len "
            f"{self.max_model_len}, {self.num_blocks} KV blocks of {self.block_size} tokens "
            f"(KV cache {self.kv_cache_dtype})",
            "",
            "| executable | tokens | seqs | compile s | GFLOP | MB | attn GFLOP | attn MB "
            "| roofline ms | scratch MiB | code MiB |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        lines += [_row(r) for r in self.executables]
        lines += ["", *self._memory_lines(), *self._cache_lines(), *self._host_lines()]
        return "\n".join(lines) + "\n"

    def _cache_lines(self) -> list[str]:
        if self.compilation_cache_dir is None:
            return []
        outcomes = collections.Counter(r.cache for r in self.executables if r.cache)
        counts = ", ".join(f"{outcome} {n}" for outcome, n in sorted(outcomes.items()))
        return [
            "",
            f"Compilation cache {self.compilation_cache_dir}: {counts} (each row's cache and "
            "cache_entry in the JSON; a loaded row's compile s is the load's). `jserve serve` "
            "with this directory as --compilation-cache-dir and these engine flags loads them "
            "instead of compiling, on a machine with the same jax, jaxlib and libtpu (or CUDA "
            "plugin) versions, XLA_FLAGS and LIBTPU_INIT_ARGS, and the same slice "
            f"(docs/tpu.md): {self.serve_flags}",
        ]

    def _host_lines(self) -> list[str]:
        if self.host is None:
            return []
        decodes = [
            r
            for r in self.executables
            if r.name == "decode step" and r.roofline_ms is not None and r.seqs is not None
        ]
        lines = [
            "",
            f"Host: one scheduler iteration (schedule + update_from_output, "
            f"jserve.simulate.host_cost) on {self.host.cpu}, 1-minute load "
            f"{self.host.load_average:.1f}, beside the estimated decode step. The host keeps "
            f"the chip busy when an iteration takes under {GOAL_SHARE:.0%} of the step.",
            "",
            "| running | waiting | iterations | p50 ms | p99 ms | CPU p50 ms | decode step "
            "| keeps the chip busy |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for load in self.host.loads:
            step, verdict = _host_verdict(load, decodes)
            lines.append(
                f"| {load.running} | {load.waiting} | {load.iterations} | {load.p50_ms:.3f} "
                f"| {load.p99_ms:.3f} | {load.cpu_p50_ms:.3f} | {step} | {verdict} |"
            )
        return lines

    def _memory_lines(self) -> list[str]:
        m = self.memory
        pool = max(m.kv_pool_bytes, 1)
        lines = [
            "| per chip | bytes | GiB |",
            "|---|---|---|",
            *(
                f"| {name} | {value} | {value / 2**30:.3f} |"
                for name, value in (
                    ("weights", m.weights_bytes),
                    ("KV pool", m.kv_pool_bytes),
                    ("scratch (largest)", m.scratch_bytes),
                    ("code (all)", m.code_bytes),
                    ("total", m.total_bytes),
                )
            ),
            f"| HBM | {m.hbm_bytes or '-'} | {_gib(m.hbm_bytes)} |",
            "",
            f"A model step's scratch is {100 * m.step_scratch_bytes / pool:.2f}% of the KV pool.",
        ]
        if m.capacity:
            lines += ["", "| context | sequences that fit |", "|---|---|"]
            lines += [f"| {c} | {n} |" for c, n in m.capacity.items()]
        return lines


def _host_verdict(load: HostLoad, decodes: list[ExecutableReport]) -> tuple[str, str]:
    """(the decode step compared with, whether the host keeps the chip busy at `load`): the
    decode step of `load.running` sequences, or the largest one compiled below it (a step of
    more sequences reads more, so it is no shorter: a "yes" still holds, a "no" is unknown)."""
    below = [r for r in decodes if r.seqs is not None and r.seqs <= load.running]
    if not below:
        return "-", "no roofline (a CPU target) or no decode step compiled"
    row = max(below, key=lambda r: r.seqs or 0)
    assert row.roofline_ms is not None
    step = f"{row.roofline_ms:.3f} ms ({row.seqs} seqs)"
    share = load.p50_ms / row.roofline_ms
    if share < GOAL_SHARE:
        return step, f"yes: the p50 is {share:.1%} of it"
    if row.seqs == load.running:
        return step, f"no: the p50 is {share:.0%} of it"
    return step, (
        f"not known: the p50 is {share:.0%} of a step of {row.seqs} sequences; compile a "
        f"decode step of {load.running} (--max-num-seqs {load.running} --steps "
        f"{load.running}x{load.running})"
    )


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def _label(r: ExecutableReport) -> str:
    shape = ", ".join(f"{k}={v}" for k, v in (("tokens", r.tokens), ("seqs", r.seqs)) if v)
    return f"{r.name} ({shape})" if shape else r.name


def _row(r: ExecutableReport) -> str:
    if r.error:
        cells = f"| {r.name} | {r.tokens or ''} | {r.seqs or ''} | {r.compile_s:.1f} | error |"
        return cells + " |" * 6
    roof = "" if r.roofline_ms is None else f"{r.roofline_ms:.3f}"
    return (
        f"| {r.name} | {r.tokens or ''} | {r.seqs or ''} | {r.compile_s:.1f} | {r.flops / 1e9:.2f} "
        f"| {r.bytes / 1e6:.1f} | {r.attention_flops / 1e9:.2f} | {r.attention_bytes / 1e6:.1f} "
        f"| {roof} | {r.temp_bytes / 2**20:.2f} | {r.code_bytes / 2**20:.2f} |"
    )
