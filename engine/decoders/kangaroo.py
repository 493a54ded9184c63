"""Kangaroo (Liu et al. 2024): self-speculative decoding with a double early exit.

The draft model is the target's own first ``exit_layer`` layers (the shallow sub-network, the
target's weights as they are) followed by a trained adapter: one attention sublayer of its own
and a norm, read out through the target's LM head cut to the draft vocabulary
(``engine.decoders.drafter_files``). The second exit stops drafting once the drafter's top-1
probability falls below ``exit_threshold`` (Kangaroo's eta): its K/V are already computed for
nothing more than the shallow layers, and a doubtful draft is seldom accepted.

The draft runs as a separate draft model over the target's block ids with its own small cache
(the shallow layers' K/V and the adapter's: ``exit_layer + 1`` of the target's layers' worth),
so it never writes the target's cache for verified positions, and it catches up on accepted
tokens lazily (``ModelDrafter``'s own-cache mode). The shallow layers run as one C++ stack
where the target's do (``KangarooRunner``). Drafts are drawn from its processed q (the
argmax for greedy requests): verification is the general rejection rule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.decoders.base import TargetContext
from engine.decoders.drafter_files import build_readout, drafter_projection
from engine.decoders.drafter_loading import load_drafter
from engine.decoders.drafting import ModelDrafter
from engine.decoders.model_draft import ModelDraftDecoder
from engine.kv_cache import KVCache
from engine.model_runner import ModelRunner
from engine.models.llama import DecoderLayer, LlamaModel, ModelOutput, rms_norm
from engine.models.rope import rotate

if TYPE_CHECKING:
    from engine.config import DecoderConfig


class KangarooAdapter(nn.Module):
    """The adapter's weights, and its training-time form: x + o(attention(norm(x))) over the
    hidden states after the target's layer ``exit_layer - 1``, then its own output norm. The
    output projection starts at zero and the output norm at the target's final norm, so the
    adapter starts as a plain early exit."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rms_norm_eps: float,
        exit_layer: int,
    ):
        super().__init__()
        d = hidden_size
        self.shape = {
            "hidden_size": hidden_size,
            "num_heads": num_heads,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "rms_norm_eps": rms_norm_eps,
            "exit_layer": exit_layer,
        }
        self.input_norm = nn.Parameter(torch.ones(d))
        self.qkv = nn.Linear(d, (num_heads + 2 * num_kv_heads) * head_dim, bias=False)
        self.o = nn.Linear(num_heads * head_dim, d, bias=False)
        nn.init.zeros_(self.o.weight)
        self.output_norm = nn.Parameter(torch.ones(d))

    def forward_train(self, hidden: torch.Tensor, rope) -> torch.Tensor:
        """[B, T, d] shallow hidden states (positions 0..T-1 each) -> [B, T, d] normed outputs
        for the readout; causal attention within each sequence."""
        s = self.shape
        batch, width, d = hidden.shape
        x = hidden.reshape(batch * width, d)
        qkv = self.qkv(rms_norm(x, self.input_norm, s["rms_norm_eps"]))
        q_size, kv_size = s["num_heads"] * s["head_dim"], s["num_kv_heads"] * s["head_dim"]
        q = rotate(qkv[:, :q_size].unflatten(1, (-1, s["head_dim"])), rope)
        k = rotate(qkv[:, q_size : q_size + kv_size].unflatten(1, (-1, s["head_dim"])), rope)
        v = qkv[:, q_size + kv_size :].unflatten(1, (-1, s["head_dim"]))

        def heads_first(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(batch, width, -1, s["head_dim"]).transpose(1, 2)

        attended = torch.nn.functional.scaled_dot_product_attention(
            heads_first(q), heads_first(k), heads_first(v), is_causal=True, enable_gqa=True
        )
        out = x + self.o(attended.transpose(1, 2).reshape(batch * width, -1))
        return rms_norm(out, self.output_norm, s["rms_norm_eps"]).reshape(batch, width, d)


class DraftVocabularyHead(nn.Module):
    """Logits over the whole vocabulary from a readout of the draft vocabulary's rows: -inf
    outside it (the drafter can never propose those tokens)."""

    def __init__(self, readout: nn.Module, draft_vocab: torch.Tensor, vocab_size: int):
        super().__init__()
        self.readout = readout
        self.draft_vocab = draft_vocab
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.readout(x).float()
        logits = torch.full(
            (x.shape[0], self.vocab_size), float("-inf"), dtype=torch.float32, device=x.device
        )
        logits[:, self.draft_vocab] = scores
        return logits


class KangarooRunner(ModelRunner):
    """The draft model's forward pass over its own cache (``exit_layer + 1`` layers): the
    target's first layers as a model of their own (so they run as one C++ stack where the
    target's do), then the adapter's attention sublayer on every row (its K/V for every new
    token), then its output norm and the draft-vocabulary head on the rows that want logits."""

    def __init__(self, adapter: KangarooAdapter, draft_vocab, target, quantization: str):
        model = target.model
        arch = model.arch
        self.exit_layer = adapter.shape["exit_layer"]
        if not 1 <= self.exit_layer < arch.num_layers:
            raise ValueError(f"kangaroo exit_layer {self.exit_layer} is not inside the target")
        dtype, device = model.dtype, torch.device(target.device)

        def projection(linear: nn.Linear) -> nn.Module:
            return drafter_projection(linear.weight, None, quantization, model)

        def norm(weight: torch.Tensor) -> torch.Tensor:
            return weight.detach().to(device=device, dtype=dtype)

        shallow = LlamaModel(
            arch, model.rope, model.embed_tokens, list(model.layers)[: self.exit_layer],
            model.final_norm, model.lm_head,
        )  # fmt: skip
        cache = target.kv_cache
        own_cache = KVCache(
            self.exit_layer + 1, cache.num_blocks, cache.block_size, arch.num_kv_heads,
            arch.head_dim, dtype, device,
        )  # fmt: skip
        super().__init__(shallow, own_cache, device)
        # No MLP: the adapter is an attention sublayer (``mlp=False`` below), so the layer
        # has neither its norm nor its weights.
        self.adapter = DecoderLayer(
            arch, norm(adapter.input_norm), projection(adapter.qkv), projection(adapter.o),
            None, None, None,
        )  # fmt: skip
        self.output_norm = norm(adapter.output_norm)
        # Ascending ids, the order ModelDrafter keeps: compact scores index the same columns.
        draft_vocab = draft_vocab.sort().values.to(device)
        self.head = DraftVocabularyHead(
            build_readout(model, draft_vocab), draft_vocab, arch.vocab_size
        )

    @torch.inference_mode()
    def forward(self, items, compact: bool = False, **model_options) -> ModelOutput:
        """``compact``: logits over the draft vocabulary's columns only (``ModelDrafter``)."""
        batch = self.flatten(items)
        layers = self.kv_cache.layers
        shallow = self.model(
            batch.input_ids, batch.positions, layers[: self.exit_layer], batch.attn,
            hidden_layer=self.exit_layer - 1, compute_logits=False, all_hidden=True,
        )  # fmt: skip
        rope = self.model.rope.lookup(batch.positions)
        hidden = self.adapter(
            shallow.hidden_states, rope, layers[self.exit_layer], batch.attn, mlp=False
        )
        rows = hidden.index_select(0, batch.logits_rows)
        eps = self.model.arch.rms_norm_eps
        normed = rms_norm(rows, self.output_norm, eps)
        return ModelOutput(
            logits=self.head.readout(normed).float() if compact else self.head(normed)
        )


class KangarooDecoder(ModelDraftDecoder):
    def __init__(self, drafter: ModelDrafter):
        super().__init__("kangaroo", drafter)


class ConfidenceExit:
    """Kangaroo's second exit: draft on while the drafter's top-1 probability is at least
    ``threshold``."""

    name = "confidence"

    def __init__(self, threshold: float):
        self.threshold = threshold

    def keep_drafting(self, confidence: float, entropy: float) -> bool:
        return confidence >= self.threshold

    def on_verified(self, proposal, num_accepted: int) -> None:
        pass


def build_kangaroo_decoder(config: DecoderConfig, target: TargetContext) -> KangarooDecoder:
    spec = config.kangaroo
    drafter = load_drafter(spec.drafter, "kangaroo", KangarooAdapter, target.model)
    runner = KangarooRunner(drafter.network, drafter.draft_vocab, target, spec.quantization)
    window = ConfidenceExit(spec.exit_threshold)
    model_drafter = ModelDrafter(runner, target.eos_token_ids, window, shares_target_cache=False)
    # The head reads out the draft vocabulary alone: unprocessed steps draft over its columns.
    model_drafter.set_draft_vocabulary(runner.head.draft_vocab, runner.head.vocab_size)
    return KangarooDecoder(model_drafter)
