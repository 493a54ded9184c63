"""Stored formats dequantize exactly as gguf-py does, and every product equals x @ dequant(W).T.

Per stored format: our layout dequantizes bit-for-bit to gguf-py's float32 (what transformers
loads), and each product (every kernel instruction set, dequant-then-BLAS, plain PyTorch)
matches the float64 product within float32 rounding, for odd shapes and 1..33 rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from engine.kernels.build import available_isas, load_kernels
from engine.models.products import candidates, dequantize_rows, product_by_name
from engine.models.quantized_linear import QuantizedLinear, StackedLinear
from engine.models.weight_formats import FORMATS, cat_rows, dequantize_torch, read_stored
from tests.quant_blocks import random_blocks

# (rows, inputs): odd row counts, inputs that are block multiples but not vector multiples.
SHAPES = {"Q4_K": (37, 512), "Q5_K": (19, 256), "Q6_K": (23, 768), "F16": (29, 72)}
DEFAULT_SHAPE = (41, 96)


def stored(fmt: str, seed: int = 0):
    rows, cols = SHAPES.get(fmt, DEFAULT_SHAPE)
    raw = random_blocks(fmt, rows, cols, seed)
    reference = gguf_dequantize(raw, GGMLQuantizationType[fmt]).astype(np.float32)
    return read_stored(fmt, raw, rows), torch.from_numpy(reference.reshape(rows, cols))


def kernel_names() -> list[str]:
    return [f"kernel-{isa}" for isa in available_isas()]


def test_kernels_build_on_this_machine():
    # CI has a compiler; a failure to build would silently slow everything down.
    assert load_kernels()
    assert "portable" in available_isas()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_layout_dequantizes_exactly_as_gguf(fmt):
    w, reference = stored(fmt)
    assert w.shape == tuple(reference.shape)
    assert torch.equal(dequantize_torch(w), reference)
    for isa in available_isas():
        got = torch.ops.specserve.dequantize(w.codes, w.scales, w.mins, isa)
        assert torch.equal(got, reference), isa
        # An embedding lookup: picked rows, repeated and out of order.
        rows = torch.tensor([w.shape[0] - 1, 0, 1, 0])
        got = torch.ops.specserve.dequantize_rows(w.codes, w.scales, w.mins, rows, isa)
        assert torch.equal(got, reference[rows]), isa
    assert torch.equal(dequantize_rows(w, torch.tensor([1, 1])), reference[[1, 1]])
    if load_kernels():
        with pytest.raises(RuntimeError, match="out of range"):
            dequantize_rows(w, torch.tensor([w.shape[0]]))


def assert_product_close(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor):
    exact = x.double() @ weight.double().T
    bound = x.abs().double() @ weight.abs().double().T  # float32 rounding scales with this
    assert ((got.double() - exact).abs() <= 1e-6 * bound + 1e-6).all()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_product_matches_the_dequantized_product(fmt):
    w, reference = stored(fmt, seed=1)
    names = ["torch", "dequant-blas", *kernel_names()]
    g = torch.Generator().manual_seed(2)
    for rows in [1, 2, 3, 4, 5, 7, 8, 16, 33]:
        x = torch.randn(rows, w.shape[1], generator=g)
        for name in names:
            assert_product_close(product_by_name(name)(x, w), x, reference)


def test_quantized_linear_uses_its_plan_by_row_count():
    w, reference = stored("Q4_1")
    bias = torch.randn(w.shape[0])
    layer = QuantizedLinear(w, bias)
    fallback = "torch"
    fast = next(iter(candidates(torch.device("cpu"))))
    layer.set_plan([(2, fast), (1 << 62, fallback)])
    assert layer.product_for(1) == fast and layer.product_for(2) == fast
    assert layer.product_for(3) == fallback and layer.product_for(500) == fallback
    for rows in (1, 3):
        x = torch.randn(rows, w.shape[1])
        assert_product_close(layer(x) - bias, x, reference)
    assert layer.nbytes == w.nbytes
    assert torch.equal(layer.dense_weight(), reference)


def test_fused_rows_stack_same_layouts_and_split_different_ones():
    a, ra = stored("Q4_1", seed=3)
    b, rb = stored("Q4_1", seed=4)
    fused = cat_rows([a, b])
    assert torch.equal(dequantize_torch(fused), torch.cat([ra, rb]))
    c, rc = stored("Q8_0", seed=5)
    assert cat_rows([a, c]) is None  # 4-bit and 8-bit codes cannot share one weight
    stacked = StackedLinear([QuantizedLinear(a), QuantizedLinear(c)])
    x = torch.randn(3, a.shape[1])
    assert_product_close(stacked(x), x, torch.cat([ra, rc]))


def test_unknown_format_is_refused_by_name():
    with pytest.raises(ValueError, match="IQ2_XXS"):
        read_stored("IQ2_XXS", np.zeros((1, 66), np.uint8), 1)


@pytest.mark.skipif("amx" not in available_isas(), reason="this CPU has no AMX")
@pytest.mark.parametrize("with_mins", [False, True])
def test_amx_product_covers_half_chunks_and_partial_tiles(with_mins):
    # 8-bit codes in blocks of 16 with 48 inputs: the last 32-input piece of x is half empty;
    # 21 weight rows and 1..40 rows of x leave partial 16-row tiles on both sides.
    g = torch.Generator().manual_seed(7)
    n, k = 21, 48
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    scales = (torch.rand(n, k // 16, generator=g) * 0.02).half()
    mins = (torch.randn(n, k // 16, generator=g) * 0.1).half() if with_mins else torch.empty(0)
    weight = codes.float() * scales.float().repeat_interleave(16, dim=1)
    if with_mins:
        weight += mins.float().repeat_interleave(16, dim=1)
    for rows in (1, 16, 17, 40):
        x = torch.randn(rows, k, generator=g)
        got = torch.ops.specserve.dequant_matmul(x, codes, scales, mins, "amx")
        assert_product_close(got, x, weight)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("with_mins", [False, True])
def test_one_row_products_cover_odd_block_counts_and_row_tails(scale_dtype, with_mins):
    # The one-row (decode) kernels take weight rows four at a time and 8-bit blocks two at a
    # time: 7 weight rows and 3 or 5 blocks per row leave a tail of each.
    g = torch.Generator().manual_seed(11)
    for n, k, kind in ((7, 48, "int8"), (7, 80, "int8"), (7, 96, "uint8"), (6, 160, "uint8")):
        block = 16 if kind == "int8" else 32
        if kind == "int8":
            codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
            values = codes.float()
        else:
            codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
            # byte j of a block holds weights j (low nibble) and j + 16 (high nibble)
            nib = codes.view(n, k // 32, 16)
            values = torch.cat([nib & 15, nib >> 4], dim=2).reshape(n, k).float()
        scales = (torch.rand(n, k // block, generator=g) * 0.02).to(scale_dtype)
        mins = torch.randn(n, k // block, generator=g).mul(0.1).to(scale_dtype)
        if kind == "uint8" or with_mins:
            weight = values * scales.float().repeat_interleave(block, dim=1)
            weight += mins.float().repeat_interleave(block, dim=1)
        else:
            mins = torch.empty(0, dtype=scale_dtype)
            weight = values * scales.float().repeat_interleave(block, dim=1)
        x = torch.randn(1, k, generator=g)
        for isa in available_isas():
            got = torch.ops.specserve.dequant_matmul(x, codes, scales, mins, isa)
            assert_product_close(got, x, weight)
