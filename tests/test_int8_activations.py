"""The int8_activations opt-in: products that round activations to 8 bits per block of 32.

The kernel equals the exact product of the 8-bit-rounded activations with the dequantized
weight (within float32 rounding), for every stored format it takes; a row's result never
depends on the other rows of the batch (bitwise), which is what keeps speculative decoding
lossless against these numerics; and greedy speculative decoding on the real model with the
opt-in gives the tokens that plain decoding with the opt-in gives.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.models.int8_activations import int8_activation_products, use_int8_activations
from engine.models.quantized_linear import QuantizedLinear
from engine.models.weight_formats import FORMATS
from engine.speculative_options import SpeculativeOptions
from tests.test_quantized_products import stored

INTEGER_FORMATS = sorted(f for f in FORMATS if f not in ("F16", "BF16", "F32"))

pytestmark = pytest.mark.skipif(
    not int8_activation_products(), reason="the C++ kernels could not be built here"
)


def rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: per block of 32, codes round(x / dx) with dx = max|x| / 127."""
    rows, k = x.shape
    blocks = x.view(rows, k // 32, 32)
    dx = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    codes = torch.round(blocks * inverse).clamp(-127, 127)  # ties to even, as the kernel
    return (codes.double() * dx.double()).view(rows, k)


@pytest.mark.parametrize("fmt", INTEGER_FORMATS)
def test_product_equals_the_rounded_activations_times_the_dequantized_weight(fmt):
    w, weight = stored(fmt, seed=3)
    g = torch.Generator().manual_seed(4)
    for rows in [1, 2, 3, 5, 8, 17, 33]:
        x = torch.randn(rows, w.shape[1], generator=g)
        xq = rounded_activations(x)
        exact = xq @ weight.double().T
        bound = xq.abs() @ weight.double().abs().T
        for product in int8_activation_products():
            isa = product.removeprefix("kernel-")
            got = torch.ops.specserve.dequant_matmul(x, w.codes, w.scales, w.mins, isa).double()
            assert ((got - exact).abs() <= 1e-6 * bound + 1e-6).all(), (fmt, rows, isa)


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q6_K"])
def test_a_rows_result_does_not_depend_on_the_other_rows(fmt):
    # Verification multiplies k + 1 rows where decoding multiplies one: each row must come out
    # bit for bit as it would alone, or a speculative step could pick another greedy token.
    w, _ = stored(fmt, seed=5)
    g = torch.Generator().manual_seed(6)
    for product in int8_activation_products():
        isa = product.removeprefix("kernel-")
        for rows in [2, 4, 7, 16]:
            x = torch.randn(rows, w.shape[1], generator=g)
            together = torch.ops.specserve.dequant_matmul(x, w.codes, w.scales, w.mins, isa)
            for r in range(rows):
                alone = torch.ops.specserve.dequant_matmul(
                    x[r : r + 1], w.codes, w.scales, w.mins, isa
                )
                assert torch.equal(alone[0], together[r]), (fmt, isa, rows, r)


def test_the_portable_product_agrees_with_the_vector_one():
    w, _ = stored("Q4_K", seed=7)
    x = torch.randn(9, w.shape[1])
    results = [
        torch.ops.specserve.dequant_matmul(x, w.codes, w.scales, w.mins, p.removeprefix("kernel-"))
        for p in int8_activation_products()
    ]
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], rtol=1e-5, atol=1e-5)


def test_the_opt_in_is_cpu_only():
    with pytest.raises(ValueError, match="int8_activations: only on the CPU"):
        EngineConfig(int8_activations=True, device="cuda")


def test_a_model_without_quantized_weights_is_refused(tiny_model_dir):
    # A float checkpoint has nothing to switch: the user asked for numerics they would not get.
    with pytest.raises(ValueError, match="no weights stored in 4- or 8-bit codes"):
        LLM(model=str(tiny_model_dir), int8_activations=True)


@pytest.fixture(scope="module")
def int8_llm(smollm2_path):
    decoder = {
        "method": "autoregressive",
        "extra_methods": ["ngram", "draft"],
        "num_speculative_tokens": 4,
        "draft_policy": "fixed",
        "prompt_lookup_min": 1,
    }
    return LLM(model=str(smollm2_path), int8_activations=True, decoder=decoder)


def test_every_quantized_projection_runs_the_int8_product(int8_llm):
    layers = [m for m in int8_llm.engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(
        layer.plan == [(1 << 62, int8_activation_products()[0])] for layer in layers
    )
    assert use_int8_activations(int8_llm.engine.runner.model) == len(layers)


def test_speculative_greedy_output_equals_plain_output_under_the_opt_in(int8_llm):
    conversations = [
        [
            {
                "role": "user",
                "content": "Repeat after me: the quick brown fox jumps over the lazy dog.",
            }
        ],
        [{"role": "user", "content": "Write a short story about a robot who learns to paint."}],
    ]
    params = SamplingParams(temperature=0, max_tokens=48)
    plain = [o.token_ids for o in int8_llm.chat(conversations, params)]
    for method in ("ngram", "draft"):
        spec = int8_llm.chat(conversations, params, SpeculativeOptions(method))
        assert [o.token_ids for o in spec] == plain, method
    assert all(len(t) > 8 for t in plain)


def test_the_opt_in_changes_the_products(int8_llm):
    # What the label says: a projection's output is no longer the exact product.
    layer = next(
        m for m in int8_llm.engine.runner.model.modules() if isinstance(m, QuantizedLinear)
    )
    x = torch.randn(3, layer.in_features)
    exact = x.double() @ layer.dense_weight().double().T
    got = layer(x).double()
    assert not torch.allclose(got, exact, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, exact, rtol=0.05, atol=0.05 * exact.abs().max().item())
