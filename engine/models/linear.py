"""Linear layers laid out for the fastest correct product on the device at hand.

On the CPU, torch's default BLAS (MKL) runs the small-batch products of decoding far below
memory bandwidth on the AMD machines we measured: a one-row product against SmolLM2's LM head
reached about 16 GB/s, a 4-row one about 11 ms per call. oneDNN with the weight reordered once
into its blocked layout (what inductor's CPU freezing uses) reads the same weights at 30-70
GB/s and keeps multi-row products (draft verification, batches) near the one-row cost; results
equal ``F.linear`` to float32 rounding. Where oneDNN is unavailable (CUDA, other builds, other
dtypes) the weight stays ``[out, in]`` and ``F.linear`` runs. docs/benchmarks.md has the numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# oneDNN picks its blocked layout for this batch-size hint; 16 measured fastest for 1..16 rows.
ONEDNN_BATCH_HINT = 16


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class Linear(nn.Module):
    """``y = x @ W.T + b`` for 2-D ``x``, with ``W`` ([out, in]) prepacked when possible."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pack: bool):
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.nbytes = weight.numel() * weight.element_size()
        self.packed = pack and onednn_available(weight.device, weight.dtype)
        if self.packed:
            weight = torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_BATCH_HINT)
        # Plain attributes, not parameters: a packed oneDNN tensor is opaque to state_dict.
        self.weight = weight
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), self.weight, self.bias, "none", [], ""
            )
        return F.linear(x, self.weight, self.bias)


def dense_weight(linear: Linear) -> torch.Tensor:
    """A linear's weight as a plain float [out, in] tensor (unpacking a oneDNN-packed one,
    dequantizing a stored one)."""
    if hasattr(linear, "dense_weight"):  # QuantizedLinear, StackedLinear
        return linear.dense_weight()
    if not linear.packed:
        return linear.weight
    eye = torch.eye(linear.in_features, dtype=torch.float32, device="cpu")
    # x @ W.T with x = I gives W.T: the product itself undoes the opaque packing.
    bias, linear.bias = linear.bias, None
    try:
        return linear(eye).t().contiguous()
    finally:
        linear.bias = bias
