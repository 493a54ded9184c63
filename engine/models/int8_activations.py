"""8-bit activations with integer dot products: llama.cpp's CPU numerics, as an opt-in.

With ``int8_activations`` on, a stored weight's product rounds each row of x to 8 bits in
blocks of 32 (ggml's Q8 activations) and multiplies the codes with integer dot products
(``engine/kernels/int8_matmul.cpp``). That is a slightly different model from the exact
float32 one (llama.cpp runs this one), and far less arithmetic: where the exact products are
bound by dequantizing, these run near the speed of reading the weights, and extra rows
(verification) cost little. Every row is computed alone, so speculative decoding stays
greedy-identical to plain decoding under these numerics; the engine turns on
``batch_invariant`` with it, so attention and every other product are row-invariant too.

Weights are repacked once, at their first product (the engine's load-time check), into the
kernel's "x16" layout (16 output rows side by side; see the C++ file), next to the stored
weight, which the embedding lookups and dequantizing callers keep using: the quantized
weights' memory about doubles (SmolLM2: 96 MB more), what a step reads does not.

Supported: 4-bit and 8-bit codes in blocks of 32 with float16 or float32 scales (Q4_0, Q4_1,
Q4_K, Q5_K, Q8_0), at least 16 output rows in groups of 16. Other weights (Q6_K's blocks of
16, half-precision rows) keep the exact products.
"""

from __future__ import annotations

import torch

from engine.kernels.build import load_kernels
from engine.models.weight_formats import StoredWeight, dequantize_torch

LANES = 16  # output rows side by side in the packed layout
BLOCK = 32  # inputs per scale


def int8_isas() -> list[str]:
    """Instruction sets of the int8 product here, best first (empty: no kernels)."""
    if not load_kernels():
        return []
    return torch.ops.specserve.int8_isas().split(",")


def unsupported_reason(w: StoredWeight) -> str | None:
    """Why ``w`` cannot take 8-bit activations (None: it can)."""
    n, k = w.shape
    if w.codes.device.type != "cpu":
        return "8-bit activations run on the CPU"
    if w.codes.dtype not in (torch.uint8, torch.int8):
        return f"{w.format} rows are half precision, not integer codes"
    if k % BLOCK or w.scales.shape[1] != k // BLOCK:
        return f"{w.format} has blocks of {k // max(1, w.scales.shape[1])} inputs, not {BLOCK}"
    if n % LANES:
        return f"{n} output rows are not a multiple of {LANES}"
    if w.scales.dtype not in (torch.float16, torch.float32):
        return f"scales of type {w.scales.dtype}"
    return None


def pack(w: StoredWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` in the x16 layout: (codes [N/16, K/32, 256 or 512], scales, mins [N/16, K/32, 16]).

    4-bit blocks keep their bytes (byte j holds inputs j and j + 16), moved so that a block's
    bytes 4t .. 4t + 3 of the 16 rows lie side by side; 8-bit codes are offset by 128 to the
    unsigned bytes the dot-product instruction takes (undone exactly in the kernel)."""
    reason = unsupported_reason(w)
    if reason is not None:
        raise ValueError(f"cannot pack for 8-bit activations: {reason}")
    n, k = w.shape
    groups, blocks = n // LANES, k // BLOCK
    if w.codes.dtype == torch.uint8:  # [N, K/2]: 16 bytes a block
        codes = w.codes.reshape(groups, LANES, blocks, 4, 4).permute(0, 2, 3, 1, 4)
    else:  # int8 [N, K]: 32 codes a block, as unsigned bytes code + 128
        unsigned = (w.codes.view(torch.uint8) ^ 0x80).reshape(groups, LANES, blocks, 8, 4)
        codes = unsigned.permute(0, 2, 3, 1, 4)
    codes = codes.reshape(groups, blocks, -1).contiguous()

    def lanes(t: torch.Tensor) -> torch.Tensor:
        if not t.numel():
            return t
        return t.reshape(groups, LANES, blocks).permute(0, 2, 1).contiguous()

    return codes, lanes(w.scales), lanes(w.mins)


def packed(w: StoredWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pack(w)``, made once per stored weight (kept on it, so it lives as long as ``w``)."""
    found = w.__dict__.get("_int8_packed")
    if found is None:
        found = w.__dict__["_int8_packed"] = pack(w)
    return found


def int8_product(isa: str):
    """The product (x, StoredWeight) -> y with 8-bit activations on instruction set ``isa``."""
    load_kernels()

    def product(x: torch.Tensor, w: StoredWeight) -> torch.Tensor:
        return torch.ops.specserve.int8_matmul(x, *packed(w), isa)

    return product


def reference(x: torch.Tensor, w: StoredWeight) -> torch.Tensor:
    """What the int8 product computes, in PyTorch from the stored weight (tests): x rounded to
    8 bits per block of 32, then the exact product with the dequantized weight. Equal to the
    kernel up to float32 summation order."""
    m, k = x.shape
    blocks = x.reshape(m, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inv).clamp(-127, 127)
    rounded = (codes * (amax / 127.0)).reshape(m, k)
    return rounded.double() @ dequantize_torch(w).double().T
