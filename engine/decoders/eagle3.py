"""EAGLE-3 (Li et al. 2025): EAGLE's one-layer drafter over features fused from a low, a
middle and a high layer of the target, with a head of its own over a draft vocabulary.

An entry at position p reads the token there and, one position earlier, ``h_{p-1}``: the
target's three layers' outputs side by side through ``fc`` [3d -> d] where the target has run,
else the drafter's own previous output (its guess). The layer's attention reads
``[norm(embedding); norm(h)]`` [2d] and adds its output to h (the residual), then the SwiGLU
MLP; the drafter's own final norm and ``lm_head`` [draft vocabulary, d] give the draft logits.
Everything else is EAGLE's (``engine.decoders.eagle``): its K/V on a one-layer paged cache over
the target's blocks, entries recomputed once the target's features are known, chains or
EAGLE-2's dynamic trees, drafts drawn from q and verified by rejection sampling (lossless).

Which layers: the outputs of layers 1, L/2 - 1 and L - 4 of L (0-based), the inputs of layers
2, L/2 and L - 3, which is how vLLM and SGLang pick them for public EAGLE-3 checkpoints; a
drafter names its own (``feature_layers``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.attention import paged_attention
from engine.decoders.draft_chain import NORMED_PAIR, DraftChainInCpp
from engine.decoders.drafter_files import drafter_projection
from engine.decoders.drafter_loading import load_drafter
from engine.decoders.drafting import ModelDrafter
from engine.decoders.eagle import EagleDecoder, EagleDrafter, trainable_layer
from engine.decoders.windows import build_window
from engine.models.decoder_stack import DecoderStack
from engine.models.llama import DecoderLayer, rms_norm, rms_norm_rows

if TYPE_CHECKING:
    from engine.config import DecoderConfig
    from engine.decoders.base import TargetContext


def default_feature_layers(num_layers: int) -> list[int]:
    """The target layers whose outputs EAGLE-3 fuses (0-based): low, middle, high."""
    return [1, num_layers // 2 - 1, num_layers - 4]


class Eagle3Network(nn.Module):
    """The drafter's weights. ``entry`` / ``attention_inputs`` / ``finish`` are the layer in
    the pieces training unrolls with autograd (as ``EagleNetwork``'s); ``fuse`` is ``fc`` over
    the target's layers, ``logits`` the drafter's own head over the draft vocabulary."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        intermediate_size: int,
        rms_norm_eps: float,
        draft_vocab_size: int,
        feature_layers: list[int],
    ):
        super().__init__()
        d = hidden_size
        self.shape = {
            "hidden_size": hidden_size,
            "num_heads": num_heads,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "intermediate_size": intermediate_size,
            "rms_norm_eps": rms_norm_eps,
            "draft_vocab_size": draft_vocab_size,
            "feature_layers": list(feature_layers),
        }
        self.fc = nn.Linear(len(feature_layers) * d, d, bias=False)
        self.embed_norm = nn.Parameter(torch.ones(d))
        self.hidden_norm = nn.Parameter(torch.ones(d))
        self.qkv = nn.Linear(2 * d, (num_heads + 2 * num_kv_heads) * head_dim, bias=False)
        self.o = nn.Linear(num_heads * head_dim, d, bias=False)
        self.post_attention_norm = nn.Parameter(torch.ones(d))
        self.gate_up = nn.Linear(d, 2 * intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, d, bias=False)
        self.norm = nn.Parameter(torch.ones(d))
        self.lm_head = nn.Linear(d, draft_vocab_size, bias=False)

    @property
    def eps(self) -> float:
        return self.shape["rms_norm_eps"]

    def layer(self) -> DecoderLayer:
        """The layer over this network's own parameters, without an input norm: its
        attention reads ``entry``'s already-normed [2d] input (PyTorch ops: autograd flows)."""
        return trainable_layer(self, None)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's layers' outputs [..., layers * d] -> what depth 1 reads [..., d]."""
        return self.fc(features)

    def entry(self, embeddings: torch.Tensor, hidden: torch.Tensor):
        """(the attention's input [2d], the residual [d]) of entries reading these tokens and
        the fused feature or guess before them."""
        x = torch.cat(
            [rms_norm(embeddings, self.embed_norm, self.eps), rms_norm(hidden, self.hidden_norm,
                                                                        self.eps)], dim=-1
        )  # fmt: skip
        return x, hidden

    def attention_inputs(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, ...]:
        return self.layer().attention_inputs(x, rope)

    def finish(self, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        return self.layer().finish(residual, attended)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of the layer's outputs."""
        return self.lm_head(rms_norm(out, self.norm, self.eps))


class _NormedHead(nn.Module):
    """The drafter's final norm and head, as the engine runs them (int8 head on the CPU)."""

    def __init__(self, norm: torch.Tensor, head: nn.Module, eps: float):
        super().__init__()
        self.norm, self.head, self.eps = norm, head, eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(rms_norm_rows(hidden, self.norm, self.eps))


class Eagle3Drafter(EagleDrafter):
    """``EagleDrafter`` with EAGLE-3's entry, fused features and head: the target's layers
    are fused as they arrive, so the feature log holds what depth 1 reads."""

    def __init__(self, network: Eagle3Network, draft_vocab: torch.Tensor, target: TargetContext,
                 window, quantization: str = "int8"):  # fmt: skip
        ModelDrafter.__init__(self, None, target.eos_token_ids, window, shares_target_cache=False)
        self.model = target.model
        arch = self.model.arch
        self.feature_layers = tuple(network.shape["feature_layers"])
        if max(self.feature_layers) >= arch.num_layers or min(self.feature_layers) < 0:
            raise ValueError(
                f"eagle3 drafter reads layers {list(self.feature_layers)}; the target has "
                f"{arch.num_layers}"
            )
        self.attach(network, draft_vocab, target)
        dtype, device = self.model.dtype, self.device

        def projection(linear: nn.Linear) -> nn.Module:
            return drafter_projection(linear.weight, linear.bias, quantization, self.model)

        def norm(weight: torch.Tensor) -> torch.Tensor:
            return weight.detach().to(device=device, dtype=dtype)

        self.eps = network.eps
        self.fc = projection(network.fc)
        self.embed_norm, self.hidden_norm = norm(network.embed_norm), norm(network.hidden_norm)
        self.layer = DecoderLayer(
            arch, None, projection(network.qkv), projection(network.o),
            norm(network.post_attention_norm), projection(network.gate_up),
            projection(network.down),
        )  # fmt: skip
        # The layer in one C++ call, its q/k/v read from ``entry`` (as EAGLE's layer does).
        entry_given = DecoderStack.usable([self.layer], entry_given=True)
        self.stack = DecoderStack([self.layer]) if entry_given else None
        # The head's rows follow the drafter's vocabulary as trained; the drafting loop keeps
        # it ascending (``set_draft_vocabulary``), so the rows are put in that order too.
        order = draft_vocab.argsort().to(network.lm_head.weight.device)
        head = drafter_projection(network.lm_head.weight[order], None, quantization, self.model)
        self.readout = _NormedHead(norm(network.norm), head, self.eps)
        self.chain = (
            DraftChainInCpp(self, NORMED_PAIR, head=head, head_norm=self.readout.norm)
            if DraftChainInCpp.applies_to(self, None, head) else None
        )  # fmt: skip

    def observe(self, seq, first_position: int, features: torch.Tensor) -> None:
        super().observe(seq, first_position, self.fc(features.to(self.device, self.model.dtype)))

    def _final_norm(self, features: torch.Tensor) -> torch.Tensor:
        return features  # the log holds fused features, read as they are

    def entry(self, embeddings: torch.Tensor, features: torch.Tensor):
        x = torch.cat(
            [rms_norm_rows(embeddings, self.embed_norm, self.eps),
             rms_norm_rows(features, self.hidden_norm, self.eps)], dim=-1,
        )  # fmt: skip
        return x, features

    def run_layer(self, embeddings, features, rope, attn) -> torch.Tensor:
        x, residual = self.entry(embeddings, features)
        if self.stack is not None:
            hidden = residual.clone()  # the stack updates it in place; the log keeps its own
            no_skips = frozenset()
            ran, _ = self.stack.run(hidden, rope, self.kv_cache.layers, attn, None, None,
                                    no_skips, no_skips, qkv_input=x)  # fmt: skip
            if ran:
                return hidden
        q, k, v = self.layer.attention_inputs(x, rope)
        return self.layer.finish(residual, paged_attention(q, k, v, self.kv_cache.layers[0], attn))


class Eagle3Decoder(EagleDecoder):
    """EAGLE's decoder over the fused features of ``feature_layers``."""

    def feature_layers(self, num_layers: int) -> tuple[int, ...]:
        return self.drafter.feature_layers


def build_eagle3_decoder(config: DecoderConfig, target: TargetContext) -> Eagle3Decoder:
    drafter = load_drafter(config.eagle3.drafter, "eagle3", Eagle3Network, target.model)
    options = config.eagle3
    return Eagle3Decoder(
        Eagle3Drafter(drafter.network, drafter.draft_vocab, target,
                      build_window(config.window), options.quantization),
        options.tree_top_k,
        options.tree_depth,
        name="eagle3",
    )  # fmt: skip
