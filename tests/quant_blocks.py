"""Random GGUF blocks of every stored format, for tests against gguf-py's own dequantizer.

Random bytes are valid blocks of any format once the float16 scale fields hold finite,
modest values; every code pattern then occurs.
"""

from __future__ import annotations

import numpy as np

from engine.models.weight_formats import FORMATS

# Byte offsets of the float16 fields (scales, mins) inside one block of each format.
_HALF_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def random_blocks(fmt: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw bytes [rows, bytes per row] of a random ``fmt`` tensor with ``cols`` inputs."""
    rng = np.random.default_rng(seed)
    spec = FORMATS[fmt]
    if fmt == "F16":
        return rng.standard_normal(rows * cols).astype(np.float16).view(np.uint8).reshape(rows, -1)
    if fmt == "BF16":
        bits = (rng.standard_normal(rows * cols).astype(np.float32).view(np.uint32) >> 16)
        return bits.astype(np.uint16).view(np.uint8).reshape(rows, -1)
    count = rows * cols // spec.block_weights
    raw = rng.integers(0, 256, size=(count, spec.block_bytes), dtype=np.uint8)
    for offset in _HALF_FIELDS[fmt]:
        halves = rng.uniform(-0.05, 0.05, count).astype(np.float16)
        raw[:, offset : offset + 2] = halves.view(np.uint8).reshape(count, 2)
    return raw.reshape(rows, -1)
