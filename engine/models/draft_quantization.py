"""Dense weights quantized into the stored layouts the C++ kernels read, for draft copies.

A self draft holds the target's projections at lower precision. In these layouts (the same
ones GGUF weights load into, ``engine.models.weight_formats``) a draft copy multiplies with the
kernels the target uses and runs its layers through the decoder stack, instead of through
PyTorch layers driven from Python. A draft's numerics only change how often its guesses are
accepted, never the output, so the quantization is chosen for the kernels:

- ``int8``: symmetric, one float16 scale per block of 16 inputs (the 8-bit layout);
- ``int4``: asymmetric, a float16 scale and min per block of 32 inputs (the 4-bit layout, as
  GGUF's Q4_1);
- ``bfloat16``: the weight rounded to bfloat16.
"""

from __future__ import annotations

import torch

from engine.models.weight_formats import StoredWeight


def quantize_int8(weight: torch.Tensor, block: int = 16) -> StoredWeight:
    """Symmetric 8-bit codes, one scale per ``block`` inputs (32 for a drafter of a target on
    8-bit activations, whose products take blocks of 32)."""
    n, k = weight.shape
    if k % block:
        raise ValueError(f"int8 needs in_features divisible by {block}, got {k}")
    blocks = weight.float().reshape(n, k // block, block)
    # Clamped before the float16 rounding, so codes are computed with exactly the stored scale
    # (a scale in float16's subnormal range would otherwise shrink the block).
    tiny = torch.finfo(torch.float16).tiny
    scales = (blocks.abs().amax(-1) / 127).clamp_min(tiny).to(torch.float16)
    codes = (
        (blocks / scales.float()[..., None]).round().clamp(-127, 127).to(torch.int8).reshape(n, k)
    )
    return StoredWeight("int8", codes, scales, torch.empty(0, dtype=torch.float16))


def quantize_int4(weight: torch.Tensor) -> StoredWeight:
    n, k = weight.shape
    if k % 32:
        raise ValueError(f"int4 needs in_features divisible by 32, got {k}")
    blocks = weight.float().reshape(n, k // 32, 32)
    low = blocks.amin(-1).to(torch.float16)
    tiny = torch.finfo(torch.float16).tiny  # as in quantize_int8
    scales = ((blocks.amax(-1) - low.float()) / 15).clamp_min(tiny).to(torch.float16)
    codes = ((blocks - low.float()[..., None]) / scales.float()[..., None]).round().clamp(0, 15)
    codes = codes.to(torch.uint8)
    # byte j of a block holds code j (low nibble) and code j + 16 (high nibble)
    packed = (codes[..., :16] | (codes[..., 16:] << 4)).reshape(n, k // 2)
    return StoredWeight("int4", packed, scales, low)


def to_bfloat16(weight: torch.Tensor) -> StoredWeight:
    empty = torch.empty(0, dtype=torch.float16)
    return StoredWeight("bfloat16", weight.to(torch.bfloat16).contiguous(), empty, empty)


STORED_QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int4, "bfloat16": to_bfloat16}
