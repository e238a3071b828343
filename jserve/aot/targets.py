"""Compile targets: TPU slices and NVIDIA GPUs this machine lacks, as compile-only devices.

libtpu's compiler and XLA's GPU compiler both run on a CPU-only machine: JAX's topology API
(`jax.experimental.topologies`) hands out devices that can be compiled for but never run on.
A TPU topology is described by its name ("v5e:2x2"); a GPU by XLA's GpuTargetConfig, shipped
in `gpu_targets/` for the chips listed in GPUS. Each target comes with its chip's public peak
figures (`jserve.aot.chips`), which the report's roofline and fit columns use.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import jax
from jax.experimental import topologies

from jserve.aot.chips import CHIPS, GPUS, TPU_TOPOLOGIES, Chip, Platform


@dataclass(frozen=True)
class _TpuGeneration:
    accelerator_type: str  # TPU_ACCELERATOR_TYPE for n chips, "{cores}" = TensorCores
    cores_per_chip: int
    # libtpu's chip configuration: a v4's "default" shows each of its two TensorCores as a
    # device, where JAX serves (and meshes need) one device per chip: "megacore".
    chip_config: str = "default"


_TPU_GENERATIONS = {
    "v4": _TpuGeneration("v4-{cores}", 2, "megacore"),
    "v5e": _TpuGeneration("v5litepod-{cores}", 1),
    "v5p": _TpuGeneration("v5p-{cores}", 2),
    "v6e": _TpuGeneration("v6e-{cores}", 1),
}


@dataclass(frozen=True)
class Target:
    """Compile-only devices of one target and the chip they are (None for the host CPU)."""

    platform: Platform
    name: str  # "v5e:2x2", "2 x h200", "cpu"
    devices: tuple[jax.Device, ...]
    chip: Chip | None

    @property
    def num_chips(self) -> int:
        """Chips: distinct TPU coordinates (one device each here), else devices."""
        return len({tuple(d.coords) if hasattr(d, "coords") else d.id for d in self.devices})


def tpu_target(topology: str) -> Target:
    """The devices of a single-host TPU slice, e.g. "v5e:2x2"; ValueError naming the accepted
    names for any other."""
    if topology not in TPU_TOPOLOGIES:
        raise ValueError(
            f"unknown TPU topology {topology!r}; jserve compile accepts the single-host "
            f"slices {list(TPU_TOPOLOGIES)}"
        )
    generation, dims = topology.split(":")
    spec = _TPU_GENERATIONS[generation]
    bounds = tuple(int(d) for d in dims.split("x"))
    bounds = (*bounds, 1) if len(bounds) == 2 else bounds
    chips = math.prod(bounds)
    # libtpu reads these when it makes the topology: no metadata server, one local host, and
    # no claim on a TPU (compile-only devices run nothing), so several compiles, or a compile
    # beside a server on a TPU VM, do not lock each other out.
    os.environ.update(
        ALLOW_MULTIPLE_LIBTPU_LOAD="1",
        TPU_SKIP_MDS_QUERY="1",
        TPU_WORKER_HOSTNAMES="localhost",
        TPU_ACCELERATOR_TYPE=spec.accelerator_type.format(cores=chips * spec.cores_per_chip),
    )
    topo = topologies.get_topology_desc(
        platform="tpu",
        topology_name=topology,
        chip_config_name=spec.chip_config,
        chips_per_host_bounds=bounds,
        num_slices=1,
        wrap=(False, False, False),
    )
    return Target(Platform.TPU, topology, tuple(topo.devices), CHIPS[generation])


def cuda_target(gpu: str, count: int) -> Target:
    """`count` compile-only NVIDIA GPUs of one host (gpu: one of GPUS)."""
    if gpu not in GPUS:
        raise ValueError(f"unknown GPU {gpu!r}; jserve compile knows {list(GPUS)}")
    if count < 1:
        raise ValueError(f"a GPU target needs at least 1 GPU, got {count}")
    config = (Path(__file__).parent / "gpu_targets" / f"{gpu}.txtpb").read_text()
    topo = topologies.get_topology_desc(
        platform="cuda", target_config=config, topology=f"1x1x{count}"
    )
    return Target(Platform.CUDA, f"{count} x {gpu}", tuple(topo.devices), CHIPS[gpu])


def cpu_target() -> Target:
    """This process's CPU devices (no chip figures: the report gives no roofline or fit)."""
    devices = tuple(jax.devices("cpu"))
    return Target(Platform.CPU, "cpu", devices, None)
