"""The prepacked (oneDNN) linear path equals F.linear; the fallback is F.linear itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.linear import Linear, onednn_available


@pytest.mark.parametrize("rows", [1, 3, 16, 77])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=g)
    bias = torch.randn(96, generator=g) if with_bias else None
    x = torch.randn(rows, 40, generator=g)
    packed = Linear(weight, bias, pack=True)
    assert packed.packed == onednn_available(torch.device("cpu"), torch.float32)
    assert packed.nbytes == 96 * 40 * 4
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
        # Non-contiguous input (a column slice) is accepted too.
        wide = torch.randn(rows, 80, generator=g)[:, ::2]
        torch.testing.assert_close(packed(wide), F.linear(wide, weight, bias), rtol=1e-5, atol=1e-5)


def test_unpacked_linear_keeps_the_weight_as_is():
    weight = torch.randn(8, 4)
    layer = Linear(weight, None, pack=False)
    assert not layer.packed and layer.weight is weight
    x = torch.randn(2, 4)
    assert torch.equal(layer(x), F.linear(x, weight))
