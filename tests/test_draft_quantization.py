"""Draft copies hold stored weights the kernels read, and run through the decoder stack."""

from __future__ import annotations

import pytest
import torch

from engine.attention import SequenceSlice, build_attention_metadata
from engine.kv_cache import KVCache
from engine.models.draft_copies import draft_copy
from engine.models.draft_quantization import quantize_int4, quantize_int8, to_bfloat16
from engine.models.quantized_linear import QuantizedLinear
from engine.models.weight_formats import dequantize_torch
from tests.test_decoder_stack import gguf_model, stack_runs  # noqa: F401  (fixture)
from tests.tiny_models import TINY_VOCAB


def weight(n: int = 24, k: int = 96) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.05


def test_int8_blocks_of_16_round_to_within_half_a_step():
    w = weight()
    q = quantize_int8(w)
    assert q.layout == "int8x16-float16-nomin" and q.shape == w.shape
    step = q.scales.float().repeat_interleave(16, dim=1)
    assert ((dequantize_torch(q) - w).abs() <= step / 2 + 1e-6).all()


def test_int4_blocks_of_32_round_to_within_half_a_step():
    w = weight()
    q = quantize_int4(w)
    assert q.layout == "uint8-float16-min" and q.shape == w.shape
    step = q.scales.float().repeat_interleave(32, dim=1)
    # half a step, plus the float16 rounding of the block's min
    assert ((dequantize_torch(q) - w).abs() <= step / 2 + 1e-3 * w.abs().max()).all()
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_int4(weight(k=48))


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_int4])
def test_small_weights_keep_their_size(quantize):
    # Block scales in float16's subnormal range: codes must be computed with the stored scale.
    w = weight() * 0.04  # std 0.002, amax about 0.008
    q = quantize(w)
    err = (dequantize_torch(q) - w).abs().max()
    assert err <= 0.1 * w.abs().max()


def test_bfloat16_copy_is_the_rounded_weight():
    w = weight()
    assert torch.equal(dequantize_torch(to_bfloat16(w)), w.to(torch.bfloat16).float())


@pytest.mark.parametrize("quantization", ["int8", "int4", "bfloat16"])
def test_truncated_draft_copy_runs_through_its_stack_on_the_targets_cache(gguf_model, quantization):  # noqa: F811
    copy = draft_copy(gguf_model, quantization, num_layers=1)
    assert isinstance(copy.layers[0].gate_up, QuantizedLinear)
    assert isinstance(copy.lm_head, QuantizedLinear)
    assert copy.stack is not None
    a = gguf_model.arch
    cache = KVCache(a.num_layers, 64, 16, a.num_kv_heads, a.head_dim, torch.float32, "cpu")
    table = list(range(63, 0, -1))
    tokens = torch.randint(0, TINY_VOCAB, (9,), generator=torch.Generator().manual_seed(1))
    with stack_runs(copy) as ran, torch.inference_mode():
        for start, n in ((0, 8), (8, 1)):  # prefill (Python layers), then one decode step
            meta = build_attention_metadata([SequenceSlice(start, n, table)], 16, a.head_dim, "cpu")
            ids, positions = tokens[start : start + n], torch.arange(start, start + n)
            logits = copy(ids, positions, cache.layers, meta).logits
            assert torch.isfinite(logits).all()
    assert ran == [False, True]
