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
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")


class RotaryEmbedding:
    """cos/sin for every position up to ``max_positions``, looked up per token."""

    def __init__(self, config, head_dim: int, max_positions: int, dtype, device):
        inv_freq, scaling = inverse_frequencies(config, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float)
        freqs = torch.outer(positions, inv_freq.float())
        self.cos = (freqs.cos() * scaling).to(dtype=dtype, device=device)
        self.sin = (freqs.sin() * scaling).to(dtype=dtype, device=device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D/2] for the tokens' positions [T]; once per forward pass."""
        cos = self.cos.index_select(0, positions).unsqueeze(1)
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        return cos, sin


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate heads x [T, heads, D] by per-token cos/sin from ``RotaryEmbedding.lookup``."""
    # The "rotate half" convention of Llama checkpoints: pairs are (i, i + D/2).
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
