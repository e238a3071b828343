"""GGUF's quantized blocks re-laid out once, at load time, as the native CPU kernel reads them.

A GGUF weight [K, N] (the model's orientation: K input features, N outputs) is stored as N rows
of K / B blocks (B = 16, 32 or 256 values), each block its scales and quants (`BlockMatrix`).
`pack_weight` re-lays the blocks of a stack of layers into one self-describing uint8 array,
which `jserve.pallas.layer_matmul.layer_matmul` multiplies with `native/quant_matmul_cpu.cc`:

    header  int64[4]: MAGIC, L (layers), P = ceil(N / 16) (panels), K
    table   int64[L * P]: panel (l, j)'s byte offset << 8 | its format's code
    panels  16 columns each, one format each, offsets 64-byte aligned

Within a panel the blocks of its 16 columns are interleaved, group of k by group of k: a
group's scales as 16 lanes, then its quants with the 16 columns of each k side by side (4-bit
quants two k to a byte, Q6_K's high 2 bits four k to a byte), so the kernel loads one k's 16
columns at once and turns them into float32 in registers. Nothing is dequantized here: the
values, scales and their bits are GGUF's own, only moved (the layouts are written out in the
kernel's format structs). A zero block is the weight 0 in every format, which pads the last
panel's columns.

Formats may differ between the panels of one weight (a Q4_K_M file keeps some layers' `attn_v`
in Q6_K, fused here with Q4_K queries and keys) but never within a panel.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

PANEL = 16  # columns per panel (the kernel's vector of 16 lanes)
MAGIC = 0x3142515645534A  # b"JSEVQB1": the layout's version; a change of layout changes it
HEADER_WORDS = 4
ALIGN = 64


class BlockFormat(StrEnum):
    """The block types the packed kernel reads: GGUF's, named as GGUF names them, and INT8,
    jserve's own (not a GGUF type): blocks of 16 int8 quants with a float32 scale, how
    --quantization int8 keeps its int8 weights (jserve.models.int8_weights)."""

    Q4_0 = "Q4_0"
    Q4_1 = "Q4_1"
    Q8_0 = "Q8_0"
    Q4_K = "Q4_K"
    Q6_K = "Q6_K"
    INT8 = "INT8"


GGUF_FORMATS = tuple(f for f in BlockFormat if f != BlockFormat.INT8)


@dataclass(frozen=True)
class _Layout:
    code: int  # the kernel's format code (quant_matmul_cpu.cc's kCode)
    block: int  # values per GGUF block, and per unit of a panel (its super-block)
    block_bytes: int  # a GGUF block's bytes
    panel_unit_bytes: int  # one block of all 16 columns of a panel


LAYOUTS = {
    BlockFormat.Q4_0: _Layout(1, 32, 18, 32 + 256),
    BlockFormat.Q4_1: _Layout(2, 32, 20, 64 + 256),
    BlockFormat.Q8_0: _Layout(3, 32, 34, 32 + 512),
    BlockFormat.Q4_K: _Layout(4, 256, 144, 64 + 256 + 2048),
    BlockFormat.Q6_K: _Layout(5, 256, 210, 32 + 256 + 2048 + 1024),
    BlockFormat.INT8: _Layout(6, 16, 4 + 16, 64 + 256),  # a block: its f32 scale, 16 int8
}
INT8_GROUP = LAYOUTS[BlockFormat.INT8].block  # k sharing a scale in --quantization int8


@dataclass(frozen=True)
class BlockMatrix:
    """A weight [K, N] in GGUF blocks: `rows` [N, K / block * block_bytes] uint8, row n the
    blocks of output column n along K (GGUF's rows are output features)."""

    format: BlockFormat
    rows: np.ndarray
    k: int

    def __post_init__(self) -> None:
        layout = LAYOUTS[self.format]
        if self.k % layout.block or self.rows.shape[1:] != (
            self.k // layout.block * layout.block_bytes,
        ):
            raise ValueError(
                f"{self.format} rows of K={self.k} must be [N, {self.k} / {layout.block} * "
                f"{layout.block_bytes}] bytes; got {self.rows.shape}"
            )

    @property
    def n(self) -> int:
        return self.rows.shape[0]


def panel_bytes(fmt: BlockFormat, k: int) -> int:
    layout = LAYOUTS[fmt]
    return k // layout.block * layout.panel_unit_bytes


def take_columns(sources: Sequence[BlockMatrix], order: np.ndarray) -> list[BlockMatrix]:
    """The columns `order` (indices into the sources' columns laid end to end) as runs of one
    format each, in order: how a fused projection is built from its GGUF tensors."""
    starts = np.cumsum([0, *(s.n for s in sources)])
    which = np.searchsorted(starts, order, side="right") - 1
    formats = np.array([list(BlockFormat).index(s.format) for s in sources])[which]
    cuts = [0, *(np.flatnonzero(np.diff(formats)) + 1).tolist(), len(order)]
    pools: dict[BlockFormat, tuple[np.ndarray, np.ndarray]] = {}
    runs = []
    for a, b in itertools.pairwise(cuts):
        fmt = sources[which[a]].format
        if fmt not in pools:  # this format's sources' rows, and where each source starts
            same = [i for i, s in enumerate(sources) if s.format == fmt]
            first = np.zeros(len(sources), np.int64)
            first[same] = np.cumsum([0, *(sources[i].n for i in same[:-1])])
            pools[fmt] = (np.concatenate([sources[i].rows for i in same]), first)
        rows, first = pools[fmt]
        index = first[which[a:b]] + order[a:b] - starts[which[a:b]]
        runs.append(BlockMatrix(fmt, rows[index], sources[0].k))
    return runs


def pack_weight(layers: Sequence[Sequence[BlockMatrix]]) -> np.ndarray:
    """Layers (each its [K, N] weight as runs of columns, in order: `take_columns`) as one
    array in the kernel's layout (module docstring). Every run but a layer's last must cover
    whole panels (16 columns), so that no panel mixes formats; raises ValueError otherwise."""
    k = layers[0][0].k
    n = sum(run.n for run in layers[0])
    num_panels = -(-n // PANEL)
    packed: list[list[tuple[BlockFormat, np.ndarray]]] = []
    for index, runs in enumerate(layers):
        if sum(run.n for run in runs) != n or any(run.k != k for run in runs):
            raise ValueError(f"layer {index} is not [K={k}, N={n}] like layer 0")
        for run in runs[:-1]:
            if run.n % PANEL:
                raise ValueError(
                    f"layer {index}: a run of {run.n} {run.format} columns ends inside a panel "
                    f"of {PANEL}, which would mix formats"
                )
        packed.append([(run.format, _panels(run)) for run in runs])
    table = np.zeros(HEADER_WORDS + len(layers) * num_panels, np.int64)
    table[:HEADER_WORDS] = (MAGIC, len(layers), num_panels, k)
    offset, entry = _aligned(table.nbytes), HEADER_WORDS
    placed = []  # (offset, stride, panels) of each run
    for runs in packed:
        for fmt, panels in runs:
            count, stride = panels.shape[0], _aligned(panels.shape[1])
            starts = offset + stride * np.arange(count, dtype=np.int64)
            table[entry : entry + count] = starts << 8 | LAYOUTS[fmt].code
            placed.append((offset, stride, panels))
            entry, offset = entry + count, offset + stride * count
    out = np.zeros(offset, np.uint8)
    out[: table.nbytes] = table.view(np.uint8)
    for start, stride, panels in placed:
        view = out[start : start + stride * panels.shape[0]].reshape(panels.shape[0], stride)
        view[:, : panels.shape[1]] = panels
    return out


def packed_bytes(fmt: BlockFormat, layers: int, k: int, n: int) -> int:
    """The size of `pack_weight`'s array for `layers` layers of [K, N] in one format."""
    entries = layers * -(-n // PANEL)
    return _aligned((HEADER_WORDS + entries) * 8) + entries * _aligned(panel_bytes(fmt, k))


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def weight_info(packed: np.ndarray) -> dict[str, int]:
    """(layers, panels, K) and the count of panels of each format of a packed weight."""
    words = np.asarray(packed[: HEADER_WORDS * 8]).view(np.int64)
    if words[0] != MAGIC:
        raise ValueError("not a packed weight (its header's magic differs)")
    layers, panels, k = (int(w) for w in words[1:])
    table = np.asarray(packed[HEADER_WORDS * 8 : (HEADER_WORDS + layers * panels) * 8])
    codes = table.view(np.int64) & 0xFF
    by_code = {layout.code: fmt for fmt, layout in LAYOUTS.items()}
    counts = {str(by_code[c]): int((codes == c).sum()) for c in np.unique(codes)}
    return {"layers": layers, "panels": panels, "k": k, **counts}


# ---- per format: GGUF blocks of 16 columns -> the panel layout -----------------------------
# Each takes blocks [P, 16, B, block_bytes] (B blocks along K of each of a panel's 16 columns)
# and returns [P, B, panel_unit_bytes].


def _f16_lanes(blocks: np.ndarray, at: int, width: int = 2) -> np.ndarray:
    """The f16 (or, `width` 4, the f32) at byte `at` of every block, its 16 columns side by
    side: [P, B, 16 * width] bytes."""
    lanes = np.moveaxis(blocks[..., at : at + width], 1, 2)  # [P, B, 16, width]
    return np.ascontiguousarray(lanes).reshape(*lanes.shape[:2], -1)


def _lanes(values: np.ndarray) -> np.ndarray:
    """Bytes [P, 16, B, n] (n per column per block) -> [P, B, n * 16]: for each of the n, the
    16 columns side by side."""
    lanes = np.moveaxis(values, 1, -1)  # [P, B, n, 16]
    return np.ascontiguousarray(lanes).reshape(*lanes.shape[:2], -1)


def _pairs(q: np.ndarray) -> np.ndarray:
    """4-bit quants [P, 16, B, n] (n even, in k order) -> [P, B, n / 2 * 16] bytes: k 2i in
    the low nibble and 2i + 1 in the high nibble of byte c of pair i."""
    return _lanes(q[..., 0::2] | q[..., 1::2] << 4)


def _nibbles(qs: np.ndarray, chunk: int) -> np.ndarray:
    """GGUF's 4-bit quants: each `chunk` bytes hold 2 * chunk values, the low nibbles first."""
    shape = qs.shape[:-1]
    qs = qs.reshape(*shape, -1, 1, chunk) >> np.array([0, 4], np.uint8).reshape(2, 1)
    return (qs & 0x0F).reshape(*shape, -1)


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    return np.concatenate([_f16_lanes(blocks, 0), _pairs(_nibbles(blocks[..., 2:], 16))], -1)


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    d, m = _f16_lanes(blocks, 0), _f16_lanes(blocks, 2)
    return np.concatenate([d, m, _pairs(_nibbles(blocks[..., 4:], 16))], -1)


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    return np.concatenate([_f16_lanes(blocks, 0), _lanes(blocks[..., 2:])], -1)


def _int8(blocks: np.ndarray) -> np.ndarray:
    return np.concatenate([_f16_lanes(blocks, 0, width=4), _lanes(blocks[..., 4:])], -1)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin = _f16_lanes(blocks, 0), _f16_lanes(blocks, 2)
    s = blocks[..., 4:16].reshape(*blocks.shape[:-1], 3, 4)  # GGUF's 6-bit scales and mins
    a, b, c = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    scales = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], -1)
    mins = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], -1)
    q = _nibbles(blocks[..., 16:], 32)
    return np.concatenate([d, dmin, _lanes(scales), _lanes(mins), _pairs(q)], -1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    shape = blocks.shape[:-1]
    ql, qh = blocks[..., :128], blocks[..., 128:192]
    scales, d = blocks[..., 192:208], _f16_lanes(blocks, 208)
    low = _nibbles(ql.reshape(*shape, 2, 64), 64).reshape(*shape, 2, 4, 32)  # 2 halves of 128
    high = qh.reshape(*shape, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    q = (low | ((high & 0x03) << 4)).reshape(*shape, 256)  # the 6-bit quants, in k order
    low4, high2 = q & 0x0F, q >> 4
    quads = high2[..., 0::4] | high2[..., 1::4] << 2 | high2[..., 2::4] << 4 | high2[..., 3::4] << 6
    return np.concatenate([d, _lanes(scales), _pairs(low4), _lanes(quads)], -1)


_PACKERS = {
    BlockFormat.Q4_0: _q4_0,
    BlockFormat.Q4_1: _q4_1,
    BlockFormat.Q8_0: _q8_0,
    BlockFormat.Q4_K: _q4_k,
    BlockFormat.Q6_K: _q6_k,
    BlockFormat.INT8: _int8,
}


def _panels(run: BlockMatrix) -> np.ndarray:
    """A run's columns as panels [ceil(n / 16), panel_bytes], zero columns padding the last."""
    layout = LAYOUTS[run.format]
    num = -(-run.n // PANEL)
    rows = np.zeros((num * PANEL, run.rows.shape[1]), np.uint8)
    rows[: run.n] = run.rows
    blocks = rows.reshape(num, PANEL, run.k // layout.block, layout.block_bytes)
    return _PACKERS[run.format](blocks).reshape(num, -1)
