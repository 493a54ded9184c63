"""Linear layers over weights kept in their stored form (GGUF quantized or half precision).

``QuantizedLinear`` holds a ``StoredWeight`` and a *plan*: for each range of row counts, the
product (``engine.models.products``) that measured fastest for its shape on this machine.
Activations stay float32 and products accumulate in float32, so a quantized model computes
what its float32-dequantized copy computes, up to summation order.
"""

from __future__ import annotations

import bisect

import torch
from torch import nn

from engine.models.linear import dense_weight
from engine.models.products import default_product, dequantize, product_by_name
from engine.models.weight_formats import StoredWeight

# Bumped whenever a layer's plan changes, so holders of compiled plans (the C++ decoder
# stack) know to rebuild.
_plan_changes = [0]


def plans_version() -> int:
    return _plan_changes[0]


class QuantizedLinear(nn.Module):
    """``y = x @ dequant(W).T + b`` for 2-D ``x`` with ``W`` in a stored format."""

    def __init__(self, weight: StoredWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.stored = weight
        self.out_features, self.in_features = weight.shape
        self.nbytes = weight.nbytes
        self.bias = bias
        self.set_plan([(1 << 62, default_product(weight.codes.device))])

    @property
    def tune_key(self) -> str:
        """Layers with the same key share one autotuned plan."""
        return f"{self.stored.layout}-{self.out_features}x{self.in_features}"

    def set_plan(self, plan: list[tuple[int, str]]) -> None:
        """``plan``: (largest row count, product name), sorted by row count."""
        self.plan = list(plan)
        _plan_changes[0] += 1
        self._limits = [rows for rows, _ in plan]
        self._products = [product_by_name(name) for _, name in plan]

    def product_for(self, rows: int) -> str:
        i = min(bisect.bisect_left(self._limits, rows), len(self._limits) - 1)
        return self.plan[i][1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        i = min(bisect.bisect_left(self._limits, x.shape[0]), len(self._limits) - 1)
        y = self._products[i](x.float().contiguous(), self.stored).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def dense_weight(self) -> torch.Tensor:
        return dequantize(self.stored)


class StackedLinear(nn.Module):
    """Several linears over the same input whose outputs are concatenated: a fused q/k/v or
    gate/up whose parts are stored in formats that cannot share one weight."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.nbytes = sum(p.nbytes for p in parts)

    @property
    def bias(self) -> torch.Tensor | None:
        """The parts' biases as one vector (zeros for parts without); None if none has one.
        ``forward`` adds each part's own; this is for copies that rebuild the layer."""
        if all(p.bias is None for p in self.parts):
            return None
        return torch.cat(
            [p.bias if p.bias is not None else torch.zeros(p.out_features) for p in self.parts]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def dense_weight(self) -> torch.Tensor:
        return torch.cat([dense_weight(p) for p in self.parts])
