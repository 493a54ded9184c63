"""The Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) on a paged KV cache.

One implementation with small switches read from the Hugging Face config: qkv bias (Qwen2),
tied embeddings, rope theta and scaling, grouped-query attention. It runs a flattened,
variable-length batch: ``input_ids`` and ``positions`` are 1-D over all tokens of all
sequences, and attention finds each sequence's keys through the block tables in
``AttentionMetadata``.

Projections are ``engine.models.linear.Linear`` layers, prepacked for oneDNN on the CPU
(see that module for why).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, paged_attention
from engine.kernels.build import load_kernels
from engine.models.decoder_stack import DecoderStack
from engine.models.linear import Linear
from engine.models.products import dequantize_rows
from engine.models.rope import RopeFactors, RotaryEmbedding, rotate
from engine.models.weight_formats import StoredWeight


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
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_window: int | None  # Mistral: attend to the last W positions only

    @classmethod
    def from_hf_config(cls, config) -> ModelArchitecture:
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        # Qwen2 has biases on q/k/v without an ``attention_bias`` flag in its config.
        # Llama's attention_bias puts biases on q, k, v and o; Qwen2 has them on q, k, v only.
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attention_bias or config.model_type == "qwen2"
        sliding_window = None
        if config.model_type == "mistral":
            sliding_window = getattr(config, "sliding_window", None)
        elif getattr(config, "use_sliding_window", False):
            # Qwen2 slides only in some layers; one window for all layers would be wrong.
            raise ValueError(f"{config.model_type} with use_sliding_window is not supported")
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
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=config.max_position_embeddings,
            sliding_window=sliding_window,
        )

    @classmethod
    def of_layer(cls, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate_size: int, rms_norm_eps: float) -> ModelArchitecture:  # fmt: skip
        """The shape of one layer alone (a drafter's), for ``DecoderLayer``."""
        return cls(
            vocab_size=0, hidden_size=hidden_size, intermediate_size=intermediate_size,
            num_layers=1, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            rms_norm_eps=rms_norm_eps, qkv_bias=False, o_bias=False, mlp_bias=False,
            tie_word_embeddings=False, max_position_embeddings=0, sliding_window=None,
        )  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused op
    # Same arithmetic as transformers' LlamaRMSNorm: normalise in float32, scale in model dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm`` of [rows, d] activations outside the layers (drafters' reads of the
    target's features): the C++ norm on the CPU in float32, a fifth of the PyTorch op's time
    between two products, else ``rms_norm``."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and load_kernels():
        return torch.ops.specserve.rms_norm(x, weight, eps)
    return rms_norm(x, weight, eps)


class DecoderLayer(nn.Module):
    """Attention and SwiGLU MLP with fused q/k/v and gate/up projections.

    The one definition of the layer in Python: the target's layers, and the drafters' (EAGLE's
    layer, which drafts on the paged cache, through its tree drafter with its own attention in
    ``attention_inputs`` / ``finish``, and trains through the same two with autograd). The C++
    ops (``_forward_fused``) and the C++ stack are the fast paths of the same arithmetic, tested
    equal to it. ``input_norm`` None: no norm before attention (EAGLE-1's first layer)."""

    def __init__(
        self,
        arch: ModelArchitecture,
        input_norm: torch.Tensor | None,
        qkv: Linear,
        o: Linear,
        post_attention_norm: torch.Tensor,
        gate_up: Linear,
        down: Linear,
        fused: bool = True,
    ):
        super().__init__()
        self.arch = arch
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.input_norm = input_norm
        self.qkv = qkv  # q, k and v fused: one product instead of three
        self.o = o
        self.post_attention_norm = post_attention_norm
        self.gate_up = gate_up  # gate and up fused
        self.down = down
        # The fused C++ layer ops (engine/kernels/layer_ops.cpp) serve float32 on the CPU;
        # the PyTorch ops below are the reference and serve everything else (autograd too:
        # ``fused=False``).
        norm = input_norm if input_norm is not None else post_attention_norm
        self.fused_ops = (
            fused
            and input_norm is not None
            and norm.device.type == "cpu"
            and norm.dtype == torch.float32
            and load_kernels()
        )

    def forward(
        self,
        hidden: torch.Tensor,
        rope: RopeFactors,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionMetadata,
        attention: bool = True,
        mlp: bool = True,
    ) -> torch.Tensor:
        """``attention=False`` / ``mlp=False`` skip that sublayer (a layer-skip draft): the
        residual stream passes through unchanged, and no K/V is written for this layer."""
        if self.fused_ops:
            return self._forward_fused(hidden, rope, kv_cache, attn, attention, mlp)
        if attention:
            q, k, v = self.attention_inputs(hidden, rope)
            hidden = self.finish(hidden, paged_attention(q, k, v, kv_cache, attn), mlp=False)
        return self.mlp(hidden) if mlp else hidden

    def attention_inputs(self, hidden: torch.Tensor, rope: RopeFactors):
        """[N, d] -> rotated q [N, H, D], rotated k and v [N, KV, D]."""
        arch = self.arch
        x = hidden
        if self.input_norm is not None:
            x = rms_norm(hidden, self.input_norm, arch.rms_norm_eps)
        qkv = self.qkv(x)
        # q and k sit side by side in the fused output: rotate both with one set of ops.
        qk_size = self.q_size + self.kv_size
        qk = rotate(qkv[:, :qk_size].unflatten(1, (-1, arch.head_dim)), rope)
        q, k = qk.split([arch.num_heads, arch.num_kv_heads], dim=1)
        v = qkv[:, qk_size:].unflatten(1, (arch.num_kv_heads, arch.head_dim))
        return q, k, v

    def finish(self, hidden: torch.Tensor, attended: torch.Tensor, mlp: bool = True):
        """The rest of the layer after attention: output projection and residual (attended
        [N, H, D]), then the MLP."""
        hidden = hidden + self.o(attended.reshape(-1, self.q_size))
        return self.mlp(hidden) if mlp else hidden

    def mlp(self, hidden: torch.Tensor) -> torch.Tensor:
        x = rms_norm(hidden, self.post_attention_norm, self.arch.rms_norm_eps)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return hidden + self.down(F.silu(gate) * up)

    def _forward_fused(self, hidden, rope, kv_cache, attn, attention, mlp) -> torch.Tensor:
        """The same layer in a handful of fused ops; ``hidden`` is updated in place."""
        ops, eps = torch.ops.specserve, self.arch.rms_norm_eps
        delta = None
        if attention:
            qkv = self.qkv(ops.rms_norm(hidden, self.input_norm, eps))
            q, k, v = ops.rope_write_kv(
                qkv, torch.view_as_real(rope), attn.slot_mapping, *kv_cache,
                self.arch.num_heads, self.arch.num_kv_heads,
            )  # fmt: skip
            out = paged_attention(q, k, v, kv_cache, attn, write_cache=False, cpu_kernel=True)
            delta = self.o(out.reshape(-1, self.q_size))
        if not mlp:
            return hidden if delta is None else hidden.add_(delta)
        if delta is None:
            x = ops.rms_norm(hidden, self.post_attention_norm, eps)
        else:
            x = ops.add_rms_norm(hidden, delta, self.post_attention_norm, eps)
        return hidden.add_(self.down(ops.silu_mul(self.gate_up(x))))


@dataclass
class ModelOutput:
    logits: torch.Tensor | None
    hidden_states: torch.Tensor | None = None


class LlamaModel(nn.Module):
    """The whole decoder, exposed in pieces (embed, layers, head) for speculative decoders."""

    def __init__(
        self,
        arch: ModelArchitecture,
        rope: RotaryEmbedding,
        embed_tokens: torch.Tensor | StoredWeight,
        layers: Sequence[DecoderLayer],
        final_norm: torch.Tensor,
        lm_head: Linear,
    ):
        super().__init__()
        self.arch = arch
        self.rope = rope
        # A dense table, or a stored (quantized) one whose looked-up rows are dequantized. With
        # tied embeddings a dense LM head holds its own (packed) copy of the table, since the
        # lookup wants rows and the product oneDNN's layout; a stored one shares it.
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.final_norm = final_norm
        self.lm_head = lm_head
        # All layers in one C++ call where it applies (see engine/models/decoder_stack.py).
        self.stack = DecoderStack(self.layers) if DecoderStack.usable(self.layers) else None
        # The C++ norm before the LM head where the layers run the fused C++ ops (float32 on
        # the CPU), whether or not a step takes the stack: the same logits either way.
        self.fused_final_norm = len(layers) > 0 and all(
            getattr(layer, "fused_ops", False) for layer in layers
        )
        # Set by engine.batch_invariance.make_batch_invariant: the runner then plans attention
        # that computes each row on its own.
        self.batch_invariant = False
        # Set with it when its products take 8-bit activations (engine/models/int8_activations.py):
        # drafters built for this model then take them too.
        self.int8_activations = False

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (weights may be stored in other formats)."""
        return self.final_norm.dtype

    @property
    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads: every projection and the LM head."""
        return sum(getattr(m, "nbytes", 0) for m in self.modules() if m is not self)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        input_ids = input_ids.to(self.final_norm.device)  # drafters may look up CPU ids
        if isinstance(self.embed_tokens, StoredWeight):
            rows = dequantize_rows(self.embed_tokens, input_ids)
            return rows.to(self.dtype)
        return self.embed_tokens.index_select(0, input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head; logits are returned in float32."""
        if self.fused_final_norm:
            x = torch.ops.specserve.rms_norm(hidden, self.final_norm, self.arch.rms_norm_eps)
        else:
            x = rms_norm(hidden, self.final_norm, self.arch.rms_norm_eps)
        return self.lm_head(x).float()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionMetadata,
        logits_indices: torch.Tensor | None = None,
        layer_ids: Sequence[int] | None = None,
        hidden_layer: int | tuple[int, ...] | None = None,
        skip_attention: frozenset[int] = frozenset(),
        skip_mlp: frozenset[int] = frozenset(),
        compute_logits: bool = True,
        all_hidden: bool = False,
    ) -> ModelOutput:
        """Run a flattened batch.

        ``logits_indices`` selects the token rows that need logits (None: all rows).
        ``layer_ids`` runs only a subset of layers (layer skipping); ``hidden_layer`` also
        returns the hidden states after that layer (for early exit and draft heads), for the
        rows selected by ``logits_indices``; a tuple of layers returns theirs side by side
        ([rows, layers * d], EAGLE-3's inputs). ``skip_attention`` and ``skip_mlp`` name layers
        whose attention or MLP sublayer is skipped. ``compute_logits=False`` skips the LM head
        (drafter training reads only hidden states). ``all_hidden`` returns the hidden states
        of every token row instead (a feature-level drafter reads them all).
        """
        hidden = self.embed(input_ids)
        rope = self.rope.lookup(positions)
        if isinstance(hidden_layer, tuple) and len(hidden_layer) > 1:
            if layer_ids is not None or skip_attention or skip_mlp:
                raise ValueError("several captured layers take the whole stack")
            hidden, captured = self._run_capturing(hidden, rope, kv_caches, attn, hidden_layer)
            return self._output(hidden, captured, logits_indices, compute_logits, all_hidden)
        if isinstance(hidden_layer, tuple):
            hidden_layer = hidden_layer[0]
        ran, captured = False, None
        if self.stack is not None:
            ran, captured = self.stack.run(
                hidden, rope, kv_caches, attn, layer_ids, hidden_layer, skip_attention, skip_mlp
            )
        if not ran:
            for i in range(len(self.layers)) if layer_ids is None else layer_ids:
                hidden = self.layers[i](
                    hidden, rope, kv_caches[i], attn, i not in skip_attention, i not in skip_mlp
                )
                if i == hidden_layer:
                    captured = hidden.clone()  # later layers may update ``hidden`` in place
        return self._output(hidden, captured, logits_indices, compute_logits, all_hidden)

    def _run_capturing(self, hidden, rope, kv_caches, attn, layers: tuple[int, ...]):
        """All layers, keeping the output of each of ``layers`` (EAGLE-3 reads a low, a
        middle and a high one): [N, len(layers) * d], in the order ``layers`` names them.
        The C++ stack runs them all in one call, capturing as it goes, where it applies."""
        if self.stack is not None:  # every layer in one call, capturing inside it
            no_skips = frozenset()
            ran, captured = self.stack.run(
                hidden, rope, kv_caches, attn, None, tuple(layers), no_skips, no_skips
            )
            if ran:
                return hidden, captured
        kept: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, rope, kv_caches[i], attn)
            if i in layers:
                kept[i] = hidden.clone()  # later layers update ``hidden`` in place
        return hidden, torch.cat([kept[i] for i in layers], dim=-1)

    def _output(self, hidden, captured, logits_indices, compute_logits, all_hidden):
        if logits_indices is not None:
            hidden = hidden.index_select(0, logits_indices)
            if captured is not None and not all_hidden:
                captured = captured.index_select(0, logits_indices)
        logits = self.logits(hidden) if compute_logits else None
        return ModelOutput(logits=logits, hidden_states=captured)
