"""The Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) on a paged KV cache.

One implementation with small switches read from the Hugging Face config: qkv bias (Qwen2),
tied embeddings, rope theta and scaling, grouped-query attention. It runs a flattened,
variable-length batch: ``input_ids`` and ``positions`` are 1-D over all tokens of all
sequences, and attention finds each sequence's keys through the block tables in
``AttentionMetadata``.

Weights of every projection are stored transposed (``[in, out]``) and applied as ``x @ w``:
on the CPU BLAS we measured, a one-row product against the transposed layout reads the
weights about 1.7x faster than ``F.linear`` against ``[out, in]`` (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, paged_attention
from engine.models.rope import RotaryEmbedding


@dataclass(frozen=True)
class ModelArchitecture:
    """The switches of the Llama family, read once from a Hugging Face config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int

    @classmethod
    def from_hf_config(cls, config) -> ModelArchitecture:
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        # Qwen2 has biases on q/k/v without an ``attention_bias`` flag in its config.
        qkv_bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=qkv_bias,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=config.max_position_embeddings,
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same arithmetic as transformers' LlamaRMSNorm: normalise in float32, scale in model dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class DecoderLayer(nn.Module):
    """Attention and SwiGLU MLP with fused q/k/v and gate/up projections."""

    def __init__(self, arch: ModelArchitecture, layer_index: int):
        super().__init__()
        self.arch = arch
        self.layer_index = layer_index
        h, d = arch.hidden_size, arch.head_dim
        self.q_size = arch.num_heads * d
        self.kv_size = arch.num_kv_heads * d
        self.input_norm = nn.Parameter(torch.ones(h))
        self.qkv_t = nn.Parameter(torch.empty(h, self.q_size + 2 * self.kv_size))
        self.qkv_bias = (
            nn.Parameter(torch.zeros(self.q_size + 2 * self.kv_size)) if arch.qkv_bias else None
        )
        self.o_t = nn.Parameter(torch.empty(self.q_size, h))
        self.post_attention_norm = nn.Parameter(torch.ones(h))
        self.gate_up_t = nn.Parameter(torch.empty(h, 2 * arch.intermediate_size))
        self.down_t = nn.Parameter(torch.empty(arch.intermediate_size, h))

    def forward(
        self,
        hidden: torch.Tensor,
        rope: RotaryEmbedding,
        positions: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        arch = self.arch
        x = rms_norm(hidden, self.input_norm, arch.rms_norm_eps)
        qkv = x @ self.qkv_t
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, arch.num_heads, arch.head_dim)
        k = k.view(-1, arch.num_kv_heads, arch.head_dim)
        v = v.view(-1, arch.num_kv_heads, arch.head_dim)
        q, k = rope.apply(q, k, positions)
        out = paged_attention(q, k, v, kv_cache, attn)
        hidden = hidden + out.reshape(-1, self.q_size) @ self.o_t
        x = rms_norm(hidden, self.post_attention_norm, arch.rms_norm_eps)
        gate, up = (x @ self.gate_up_t).chunk(2, dim=-1)
        return hidden + (F.silu(gate) * up) @ self.down_t


@dataclass
class ModelOutput:
    logits: torch.Tensor | None
    hidden_states: torch.Tensor | None = None


class LlamaModel(nn.Module):
    """The whole decoder, exposed in pieces (embed, layers, head) for speculative decoders."""

    def __init__(self, arch: ModelArchitecture, rope: RotaryEmbedding):
        super().__init__()
        self.arch = arch
        self.rope = rope
        # Stored transposed ([hidden, vocab]); with tied embeddings the same tensor serves
        # the embedding lookup (a column gather) and the LM head.
        self.embed_t = nn.Parameter(torch.empty(arch.hidden_size, arch.vocab_size))
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.final_norm = nn.Parameter(torch.ones(arch.hidden_size))
        self.lm_head_t = (
            None
            if arch.tie_word_embeddings
            else nn.Parameter(torch.empty(arch.hidden_size, arch.vocab_size))
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_t.index_select(1, input_ids).t()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head; logits are returned in float32."""
        x = rms_norm(hidden, self.final_norm, self.arch.rms_norm_eps)
        head = self.embed_t if self.lm_head_t is None else self.lm_head_t
        return (x @ head).float()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionMetadata,
        logits_indices: torch.Tensor | None = None,
        layer_ids: Sequence[int] | None = None,
        hidden_layer: int | None = None,
    ) -> ModelOutput:
        """Run a flattened batch.

        ``logits_indices`` selects the token rows that need logits (None: all rows).
        ``layer_ids`` runs only a subset of layers (layer skipping); ``hidden_layer`` also
        returns the hidden states after that layer (for early exit and draft heads), for the
        rows selected by ``logits_indices``.
        """
        layer_ids = range(self.arch.num_layers) if layer_ids is None else layer_ids
        hidden = self.embed(input_ids)
        captured = None
        for i in layer_ids:
            hidden = self.layers[i](hidden, self.rope, positions, kv_caches[i], attn)
            if i == hidden_layer:
                captured = hidden
        if logits_indices is not None:
            hidden = hidden.index_select(0, logits_indices)
            if captured is not None:
                captured = captured.index_select(0, logits_indices)
        return ModelOutput(logits=self.logits(hidden), hidden_states=captured)
