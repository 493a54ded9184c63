"""The fused C++ layer ops equal the plain PyTorch layer they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.build import load_kernels
from engine.models.llama import rms_norm
from engine.models.loader import load_model
from tests.test_model_reference import chunked_forward

pytestmark = pytest.mark.skipif(not load_kernels(), reason="no C++ kernels on this machine")
ops = torch.ops.specserve if load_kernels() else None


def test_norms_and_gate_match_pytorch():
    g = torch.Generator().manual_seed(0)
    x, delta = torch.randn(5, 72, generator=g) * 3, torch.randn(5, 72, generator=g)
    weight = torch.randn(72, generator=g)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), rms_norm(x, weight, 1e-5))
    residual = x.clone()
    normed = ops.add_rms_norm(residual, delta, weight, 1e-5)
    torch.testing.assert_close(residual, x + delta)  # updated in place
    torch.testing.assert_close(normed, rms_norm(x + delta, weight, 1e-5))
    gate_up = torch.randn(5, 2 * 40, generator=g) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up)


def test_rope_write_kv_rotates_and_writes_the_slots():
    heads, kv_heads, d, t = 4, 2, 8, 3
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g)
    angles = torch.rand(t, 1, d // 2, generator=g) * 6
    factors = torch.polar(torch.ones_like(angles), angles)
    k_cache, v_cache = torch.zeros(10, kv_heads, d), torch.zeros(10, kv_heads, d)
    slots = torch.tensor([7, 2, 5])
    q, k, v = ops.rope_write_kv(
        qkv, torch.view_as_real(factors), slots, k_cache, v_cache, heads, kv_heads
    )

    def rotated(x):  # the model's reference: complex multiplication of adjacent pairs
        pairs = torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous())
        return torch.view_as_real(pairs * factors).flatten(-2)

    q_ref = rotated(qkv[:, : heads * d].unflatten(1, (heads, d)))
    k_ref = rotated(qkv[:, heads * d : (heads + kv_heads) * d].unflatten(1, (kv_heads, d)))
    v_ref = qkv[:, (heads + kv_heads) * d :].unflatten(1, (kv_heads, d))
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(k, k_ref)
    torch.testing.assert_close(v, v_ref)
    torch.testing.assert_close(k_cache[slots], k_ref)
    torch.testing.assert_close(v_cache[slots], v_ref)
    assert k_cache[[0, 1, 3, 4, 6, 8, 9]].abs().sum() == 0  # nothing else written


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_fused_layers_compute_the_plain_layers(tiny_model_dir, tmp_path, model_type):
    from tests.tiny_models import save_tiny_model

    path = tiny_model_dir if model_type == "llama" else save_tiny_model(tmp_path, "qwen2")
    model, _ = load_model(path, torch.float32, "cpu", None)
    tokens = torch.randint(0, 300, (21,), generator=torch.Generator().manual_seed(2))
    assert all(layer.fused_ops for layer in model.layers)
    fused = chunked_forward(model, tokens, [13, 1, 7])
    for layer in model.layers:
        layer.fused_ops = False
    plain = chunked_forward(model, tokens, [13, 1, 7])
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
