"""Medusa heads (Cai et al. 2024): small heads on the target's last hidden state, head j
guessing the token j + 1 places after the next one; their top candidates form a token tree that
the target verifies in one pass.

Each head is Medusa's residual block, h + SiLU(W h + b), on the target's final-normed hidden
state, read out through the target's LM head cut to the draft vocabulary
(``engine.decoders.trained_heads``, which also ranks the tree). Drafts are deterministic (top-k
picks), so the verifier's one-hot tree rule applies: lossless under every sampling parameter.
Medusa's typical acceptance (lossy) is not offered.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.decoders.base import Decoder, TargetContext
from engine.decoders.drafter_files import build_readout
from engine.decoders.drafter_loading import load_drafter
from engine.decoders.trained_heads import ResidualBlocks, TrainedHeadsDecoder

if TYPE_CHECKING:
    from engine.config import DecoderConfig


class MedusaHeads(ResidualBlocks):
    """Head j maps h to h + SiLU(W_j h + b_j). W starts at zero (Medusa's initialisation):
    every head starts as the target's own next-token guess."""

    def forward(self, normed: torch.Tensor) -> torch.Tensor:
        """[B, d] final-normed hidden states -> [heads, B, d]."""
        z = torch.einsum("bd,hed->hbe", normed, self.weight) + self.bias[:, None, :]
        return normed[None] + nn.functional.silu(z)

    def forward_train(self, normed: torch.Tensor, next_embeddings: torch.Tensor) -> torch.Tensor:
        """Training: every head on its row (Medusa's heads do not read the tokens after it)."""
        return self(normed)


class MedusaDecoder(TrainedHeadsDecoder, Decoder):
    name = "medusa"

    @torch.inference_mode()
    def propose(self, seqs, num_drafts: dict) -> dict:
        seqs = [s for s in seqs if s in self._hidden]
        if not seqs:
            return {}
        normed = self.normed_features(seqs)
        # Only the heads the granted tree reaches (one draft: head 1 alone).
        num_paths = max(num_drafts[s] for s in seqs)
        depth = max(len(path) for path in self.tree[:num_paths])
        guesses = torch.stack(
            [self.heads.block(j, normed, block) for j, block in enumerate(self.blocks[:depth])]
        )  # [heads used, B, d]
        heads, batch, width = guesses.shape
        count = max(self.ranks_used(num_paths, d) for d in range(1, depth + 1))
        # [h * B + b][i]: head h's i-th token for sequence b, and its probability
        top, chances = self.ranked_candidates(guesses.reshape(heads * batch, width), count)
        return self.proposals(
            seqs, num_drafts,
            lambda b, p: top[(len(p) - 1) * batch + b][p[-1]],
            lambda b, p: chances[(len(p) - 1) * batch + b][p[-1]],
        )  # fmt: skip


def build_medusa_decoder(config: DecoderConfig, target: TargetContext) -> MedusaDecoder:
    drafter = load_drafter(config.medusa.drafter, "medusa", MedusaHeads, target.model)
    readout = build_readout(target.model, drafter.draft_vocab, config.medusa.quantization)
    return MedusaDecoder(drafter, target, readout, config.medusa.quantization)
