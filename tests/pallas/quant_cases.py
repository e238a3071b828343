"""Random GGUF weights for the packed-block tests: any bytes are valid quants in every format,
so a matrix is random bytes with finite, small f16 scales where the format keeps them (f32
ones for INT8, jserve's own format)."""

from __future__ import annotations

import gguf
import numpy as np

from jserve.pallas.quant_blocks import LAYOUTS, BlockFormat, BlockMatrix

# Byte offsets of each format's f16 scales in a GGUF block (d, and Q4_1's m, Q4_K's dmin).
F16_AT = {
    BlockFormat.Q4_0: (0,),
    BlockFormat.Q4_1: (0, 2),
    BlockFormat.Q8_0: (0,),
    BlockFormat.Q4_K: (0, 2),
    BlockFormat.Q6_K: (208,),
    BlockFormat.INT8: (),  # its f32 scale at 0
}


def random_blocks(fmt: BlockFormat, n: int, k: int, rng: np.random.Generator) -> BlockMatrix:
    """A [K, N] weight of random `fmt` blocks (N rows of K / block blocks, as GGUF keeps it)."""
    layout = LAYOUTS[fmt]
    blocks = rng.integers(0, 256, (n, k // layout.block, layout.block_bytes), dtype=np.uint8)
    for at in F16_AT[fmt]:
        scales = rng.standard_normal((n, k // layout.block, 1)) * 0.02
        blocks[..., at : at + 2] = scales.astype(np.float16).view(np.uint8)
    if fmt == BlockFormat.INT8:
        scales = rng.standard_normal((n, k // layout.block, 1)) * 0.02
        blocks[..., :4] = scales.astype(np.float32).view(np.uint8)
    return BlockMatrix(fmt, blocks.reshape(n, -1), k)


def dequantized(m: BlockMatrix) -> np.ndarray:
    """gguf's own float32 dequantization of `m`, as the model's [K, N] (INT8, which gguf does
    not have: its float32 scale times its quants, in float32)."""
    if m.format == BlockFormat.INT8:
        blocks = m.rows.reshape(m.n, -1, LAYOUTS[m.format].block_bytes)
        scale = np.ascontiguousarray(blocks[..., :4]).view(np.float32)
        return (scale * blocks[..., 4:].view(np.int8).astype(np.float32)).reshape(m.n, m.k).T
    kind = gguf.GGMLQuantizationType[m.format]
    return gguf.quants.dequantize(m.rows, kind).reshape(m.n, m.k).T
