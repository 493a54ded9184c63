"""The products that can multiply activations by a stored weight, and the choice among them.

Every candidate computes ``x @ dequant(W).T`` in float32 for a ``StoredWeight``:

- ``kernel-<isa>``: the C++ kernel (``engine/kernels``) with that instruction set (avx512,
  avx2; portable only where neither exists); one pass over the stored bytes serves every row
  of ``x``, up to eight rows per in-register dequantization (decode, verification);
- ``kernel-avx512-tiled``, ``kernel-avx2-tiled``: the same with a register tile (four weight
  rows by four or three rows of x) over dequantized rows (batches);
- ``kernel-avx2-rows``: the AVX2 kernel one weight row at a time instead of four (decode and
  verification; neither form won every shape on an AVX2-only AMD EPYC);
- ``dequant-blas``: dequantize the weight to float32 (the kernel's fastest dequantizer, in
  slices of rows), then torch's BLAS product: wins once enough rows share the weight (prefill);
- ``torch``: dequantize in plain PyTorch, then ``F.linear``. It runs on any device and is the
  fallback when no kernel could be built.

Which one runs for a given number of rows is measured at load on the machine at hand
(``engine.models.autotune``), never assumed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.kernels.build import available_isas
from engine.models.int8_activations import int8_product
from engine.models.weight_formats import StoredWeight, dequantize_torch

Product = Callable[[torch.Tensor, StoredWeight], torch.Tensor]

# Rows of the weight dequantized at once by ``dequant-blas``: bounds the float32 temporary
# (an LM head of 49152 x 576 would otherwise be a 113 MB buffer).
DEQUANT_SLICE_ROWS = 4096


def _kernel(isa: str) -> Product:
    def product(x: torch.Tensor, w: StoredWeight) -> torch.Tensor:
        return torch.ops.specserve.dequant_matmul(x, w.codes, w.scales, w.mins, isa)

    return product


def dequantize(w: StoredWeight) -> torch.Tensor:
    """Float32 [N, K] with the fastest dequantizer available for the weight's device."""
    isas = available_isas() if w.codes.device.type == "cpu" else []
    if isas:
        return torch.ops.specserve.dequantize(w.codes, w.scales, w.mins, isas[0])
    return dequantize_torch(w)


def dequantize_rows(w: StoredWeight, rows: torch.Tensor) -> torch.Tensor:
    """Float32 [len(rows), K]: rows ``rows`` of ``w`` (an embedding lookup), in one kernel
    call where there are kernels."""
    isas = available_isas() if w.codes.device.type == "cpu" else []
    if isas and rows.dtype == torch.long and rows.dim() == 1:
        return torch.ops.specserve.dequantize_rows(w.codes, w.scales, w.mins, rows, isas[0])
    return dequantize(w.select_rows(rows))


def _dequant_blas(x: torch.Tensor, w: StoredWeight) -> torch.Tensor:
    n = w.shape[0]
    if n <= DEQUANT_SLICE_ROWS:
        return F.linear(x, dequantize(w))
    rows = torch.arange(n, device=w.codes.device)
    parts = [
        F.linear(x, dequantize(w.select_rows(rows[i : i + DEQUANT_SLICE_ROWS])))
        for i in range(0, n, DEQUANT_SLICE_ROWS)
    ]
    return torch.cat(parts, dim=-1)


def _torch(x: torch.Tensor, w: StoredWeight) -> torch.Tensor:
    return F.linear(x, dequantize_torch(w))


def candidates(device: torch.device) -> dict[str, Product]:
    """Products available for weights on ``device``, by name."""
    if device.type != "cpu":
        return {"torch": _torch}
    isas = available_isas()
    if not isas:
        return {"torch": _torch}
    # The portable kernel is the reference for CPUs without a vector path; where one exists it
    # never wins, so it is not measured.
    vector = [isa for isa in isas if isa != "portable"] or isas
    found: dict[str, Product] = {f"kernel-{isa}": _kernel(isa) for isa in vector}
    found["dequant-blas"] = _dequant_blas
    return found


def default_product(device: torch.device) -> str:
    """What runs before (or without) autotuning: the first kernel, else plain PyTorch."""
    return next(iter(candidates(device)))


def product_by_name(name: str) -> Product:
    if name == "torch":
        return _torch
    if name == "dequant-blas":
        return _dequant_blas
    if name.startswith("kernel-int8-"):  # 8-bit activations: chosen by config, never autotuned
        return int8_product(name.removeprefix("kernel-int8-"))
    if name.startswith("kernel-"):
        return _kernel(name.removeprefix("kernel-"))
    raise ValueError(f"unknown product {name!r}")
