"""The opt-in that changes the model's numerics: 8-bit activations in the quantized products.

By default every product is exact to the stored weights (float32 activations and
accumulation). With ``int8_activations`` the products of 4- and 8-bit weights round each row
of activations to 8-bit codes per block of 32 and sum integer products (the C++ kernel in
``engine/kernels/int8_activations.cpp``), as llama.cpp does: fewer instructions per weight,
which is what bounds a decode step on a CPU without AVX-512, at the price of outputs that are
no longer those of the weights as stored.

The product gives each row of activations the same result whatever the other rows, so a
verification pass scores each position exactly as a decode step would: speculative decoding
stays lossless against these numerics.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.build import load_kernels
from engine.models.quantized_linear import QuantizedLinear

# Inputs per activation scale: a layer whose input size is not a multiple keeps exact products.
BLOCK = 32


def int8_activation_products() -> list[str]:
    """The products with 8-bit activations usable on this CPU, fastest first."""
    if not load_kernels():
        return []
    names = torch.ops.specserve.int8_activation_products().split(",")
    return [f"kernel-{name}" for name in names if name]


def takes_int8_activations(layer: QuantizedLinear) -> bool:
    codes = layer.stored.codes
    return (
        codes.device.type == "cpu"
        and codes.dtype in (torch.uint8, torch.int8)
        and layer.in_features % BLOCK == 0
    )


def use_int8_activations(model: nn.Module) -> int:
    """Switch every quantized layer the product takes to 8-bit activations, for all row counts
    (one product per layer, so a batch never mixes numerics). Returns how many were switched."""
    products = int8_activation_products()
    if not products:
        raise RuntimeError(
            "int8_activations needs the C++ kernels, which could not be built here "
            "(see `python -m engine.kernels.build`)"
        )
    switched = 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear) and takes_int8_activations(module):
            module.set_plan([(1 << 62, products[0])])
            switched += 1
    return switched
