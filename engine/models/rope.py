"""Rotary position embeddings with a precomputed cos/sin table.

The inverse frequencies come from transformers' own rope functions, so every rope type a
Hugging Face config can name (default, linear, dynamic, yarn, llama3, ...) matches the
reference implementation without being rewritten here.
"""

from __future__ import annotations

import torch


def _rope_parameters(config) -> dict:
    # transformers >= 5 keeps these in ``rope_parameters``; 4.x in rope_theta / rope_scaling.
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.get("type", "default"))
    scaling["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    return scaling


def inverse_frequencies(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [head_dim/2], attention_scaling) as transformers computes them."""
    params = _rope_parameters(config)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
        return 1.0 / (params["rope_theta"] ** exponent), 1.0
    # transformers: only for scaled ropes
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")


def interleave_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder each head's rows of a q or k projection from Llama's rotate-half layout
    (pairs i and i + D/2) to adjacent pairs (2i, 2i + 1).

    Attention only ever takes dot products of q with k, which a permutation of the head
    dimension applied to both leaves unchanged, so the model computes the same function; the
    adjacent layout lets ``rotate`` be one complex multiplication instead of seven kernels.
    """
    head_dim = weight.shape[0] // num_heads
    rest = weight.shape[1:]
    halves = weight.reshape(num_heads, 2, head_dim // 2, *rest)
    return halves.transpose(1, 2).reshape(weight.shape)


def deinterleave_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of ``interleave_rope_rows``: rows back in Llama's rotate-half layout (how
    checkpoints on disk have them: a drafter's q and k written out for other engines)."""
    head_dim = weight.shape[0] // num_heads
    rest = weight.shape[1:]
    pairs = weight.reshape(num_heads, head_dim // 2, 2, *rest)
    return pairs.transpose(1, 2).reshape(weight.shape)


RopeFactors = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class RotaryEmbedding:
    """Rotation factors for every position up to ``max_positions``, looked up per token:
    complex ``cos + i sin`` in float32, a (cos, sin) pair in other dtypes."""

    def __init__(self, config, head_dim: int, max_positions: int, dtype, device):
        inv_freq, scaling = inverse_frequencies(config, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float)
        freqs = torch.outer(positions, inv_freq.float())
        if dtype == torch.float32:
            magnitude = torch.full_like(freqs, float(scaling))
            self.table: RopeFactors = torch.polar(magnitude, freqs).to(device)
        else:
            cos = (freqs.cos() * scaling).to(dtype=dtype, device=device)
            sin = (freqs.sin() * scaling).to(dtype=dtype, device=device)
            self.table = (cos, sin)

    def lookup(self, positions: torch.Tensor) -> RopeFactors:
        """Factors [T, 1, D/2] for the tokens' positions [T]; once per forward pass."""
        if isinstance(self.table, torch.Tensor):
            return self.table.index_select(0, positions).unsqueeze(1)
        return tuple(t.index_select(0, positions).unsqueeze(1) for t in self.table)


def rotate(x: torch.Tensor, factors: RopeFactors) -> torch.Tensor:
    """Rotate heads x [T, heads, D], laid out by ``interleave_rope_rows``, by ``lookup``'s
    factors."""
    pairs = x.unflatten(-1, (-1, 2))
    if isinstance(factors, torch.Tensor):
        if pairs.stride(-1) != 1:
            pairs = pairs.contiguous()  # a complex view needs each pair adjacent in memory
        return torch.view_as_real(torch.view_as_complex(pairs) * factors).flatten(-2)
    cos, sin = factors
    x1, x2 = pairs.unbind(-1)
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
