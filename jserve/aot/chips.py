"""The chips `jserve compile` targets, by name, and their public peak figures (no JAX here:
the command line lists these names before JAX starts)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Platform(StrEnum):
    TPU = "tpu"
    CUDA = "cuda"
    CPU = "cpu"


@dataclass(frozen=True)
class Chip:
    """One chip's public peak figures: what the roofline and the fit are measured against."""

    name: str
    peak_flops: float  # dense bfloat16 FLOP/s
    hbm_bandwidth: float  # bytes/s
    hbm_bytes: int


# Dense bfloat16 peak FLOP/s, HBM bandwidth and HBM capacity as each vendor publishes them:
# TPUs from Google Cloud's system architecture pages (cloud.google.com/tpu/docs/v4, /v5e, /v5p,
# /v6e); GPUs from NVIDIA's datasheets (nvidia.com/en-us/data-center/h100 and /h200: 989
# TFLOP/s dense BF16 for the SXM parts, half the "with sparsity" figure), their HBM bytes as
# XLA's target configs give them (gpu_targets/*.txtpb, device_memory_size).
CHIPS = {
    "v4": Chip("TPU v4", 275e12, 1200e9, 32 * 2**30),
    "v5e": Chip("TPU v5e", 197e12, 819e9, 16 * 2**30),
    "v5p": Chip("TPU v5p", 459e12, 2765e9, 95 * 2**30),
    "v6e": Chip("TPU v6e", 918e12, 1640e9, 32 * 2**30),
    "h100": Chip("NVIDIA H100 SXM", 989e12, 3.35e12, 84942979072),
    "h200": Chip("NVIDIA H200 SXM", 989e12, 4.8e12, 151397597184),
}
GPUS = ("h100", "h200")


# Single-host slices, as JAX spells them: the compile-only devices of one host.
TPU_TOPOLOGIES = (
    "v4:1x1x1", "v4:2x2x1",
    "v5e:1x1", "v5e:2x2", "v5e:2x4",
    "v5p:1x1x1", "v5p:2x2x1",
    "v6e:1x1", "v6e:2x2", "v6e:2x4",
)  # fmt: skip
