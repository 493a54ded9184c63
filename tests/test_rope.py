"""Rope in the interleaved layout equals transformers' rotate-half rope, in both code paths."""

from __future__ import annotations

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from engine.models.rope import RotaryEmbedding, interleave_rope_rows, rotate

HEADS, DIM = 3, 16


def to_interleaved(x: torch.Tensor) -> torch.Tensor:
    """[T, heads, D] in rotate-half layout -> the same values in our interleaved layout."""
    t, heads, dim = x.shape
    rows = x.permute(1, 2, 0).reshape(heads * dim, t)  # as projection output rows
    return interleave_rope_rows(rows, heads).reshape(heads, dim, t).permute(2, 0, 1)


def test_interleaved_rotation_matches_rotate_half_up_to_the_permutation():
    config = LlamaConfig(hidden_size=HEADS * DIM, num_attention_heads=HEADS, rope_theta=1000.0)
    positions = torch.tensor([0, 5, 17, 63])
    x = torch.randn(len(positions), HEADS, DIM, generator=torch.Generator().manual_seed(0))
    cos, sin = LlamaRotaryEmbedding(config)(x, positions[None])
    heads_first = x.transpose(0, 1)[None]
    expected, _ = apply_rotary_pos_emb(heads_first, heads_first, cos, sin)
    expected = to_interleaved(expected[0].transpose(0, 1))
    # float32 takes the complex product, float64 the (cos, sin) pair path.
    for dtype in (torch.float32, torch.float64):
        rope = RotaryEmbedding(config, DIM, 64, dtype, "cpu")
        got = rotate(to_interleaved(x).to(dtype), rope.lookup(positions))
        torch.testing.assert_close(got.float(), expected, rtol=1e-5, atol=1e-5)


def test_dot_products_survive_the_permutation():
    q = torch.randn(HEADS * DIM, 4)
    k = torch.randn(HEADS * DIM, 4)
    per_head = lambda t: t.reshape(HEADS, DIM, -1)  # noqa: E731
    before = torch.einsum("hdi,hdj->hij", per_head(q), per_head(k))
    after = torch.einsum(
        "hdi,hdj->hij",
        per_head(interleave_rope_rows(q, HEADS)),
        per_head(interleave_rope_rows(k, HEADS)),
    )
    torch.testing.assert_close(before, after)
