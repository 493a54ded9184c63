"""Hydra heads (Ankner et al. 2024): Medusa's heads made sequentially dependent. Head j reads
the target's last hidden state and the embeddings of the tokens after it, the decode token and
the draft path so far, so its guess depends on the path it extends; a tree's candidates are
computed depth by depth, each node's children from its own path.

Head j: x = W_in_j [f; e_1; ...; e_{j+1}] (f the final-normed hidden state, e_i RMS-normalised
token embeddings of the target), then the residual block x + SiLU(W_j x + b_j), read out through
the target's LM head cut to the draft vocabulary (``engine.decoders.trained_heads``, which also
ranks the tree). Drafts are deterministic (top-k picks): the one-hot tree rule keeps every
sampling parameter exact.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from engine.decoders.base import Decoder, TargetContext
from engine.decoders.drafter_files import build_readout
from engine.decoders.drafter_loading import load_drafter
from engine.decoders.trained_heads import ResidualBlocks, TrainedHeadsDecoder, head_projection
from engine.models.llama import rms_norm_rows

if TYPE_CHECKING:
    from engine.config import DecoderConfig


def unit_rms(x: torch.Tensor) -> torch.Tensor:
    """``F.rms_norm`` without a weight over the last dimension (its default eps). In a draft the
    C++ norm (``rms_norm_rows``): PyTorch's op took 50-60 us of a one-draft step, its data
    evicted by the target's sweep. Elsewhere (training's autograd, a GPU) PyTorch's op."""
    d = x.shape[-1]
    eps = torch.finfo(x.dtype).eps
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.requires_grad:
        return F.rms_norm(x, (d,), eps=eps)
    return rms_norm_rows(x.reshape(-1, d), _ones(d), eps).reshape(x.shape)


@functools.cache
def _ones(d: int) -> torch.Tensor:
    return torch.ones(d)


class HydraHeads(ResidualBlocks):
    """Head j reads [f; e_1; ...; e_{j+1}]. Its input projection starts as the identity on f and
    zero on the embeddings, so every head starts as Medusa's initial guess."""

    def __init__(self, num_heads: int, hidden_size: int):
        super().__init__(num_heads, hidden_size)
        d = hidden_size
        self.inputs = nn.ParameterList(
            nn.Parameter(torch.cat([torch.eye(d), torch.zeros(d, (j + 1) * d)], dim=1))
            for j in range(num_heads)
        )

    def head(
        self, j: int, normed: torch.Tensor, embeddings: torch.Tensor, linears=(None, None)
    ) -> torch.Tensor:
        """[N, d] features and [N, j + 1, d] token embeddings -> [N, d] head j outputs.
        ``linears``: head j's input projection and block as the engine runs them (default:
        the trained parameters)."""
        e = unit_rms(embeddings)
        x = torch.cat([normed, e.flatten(1)], dim=1)
        inputs, block = linears
        x = inputs(x) if inputs is not None else x @ self.inputs[j].T
        return self.block(j, x, block)

    def forward_train(self, normed: torch.Tensor, next_embeddings: torch.Tensor) -> torch.Tensor:
        """[B, d] features, [B, heads, d] embeddings of the tokens after each -> [heads, B, d]:
        teacher forcing, head j reads the true tokens 1..j+1."""
        return torch.stack(
            [self.head(j, normed, next_embeddings[:, : j + 1]) for j in range(self.num_heads)]
        )


class HydraDecoder(TrainedHeadsDecoder, Decoder):
    name = "hydra"

    def __init__(self, drafter, target, readout, quantization: str):
        super().__init__(drafter, target, readout, quantization)
        self.inputs = [
            head_projection(self.heads.inputs[j], None, quantization, target.model)
            for j in range(self.heads.num_heads)
        ]

    @torch.inference_mode()
    def propose(self, seqs, num_drafts: dict) -> dict:
        seqs = [s for s in seqs if s in self._hidden]
        if not seqs:
            return {}
        num_paths = max(num_drafts[s] for s in seqs)
        tree = self.tree[:num_paths]
        features = self.normed_features(seqs)
        batch = len(seqs)
        embed = self.model.embed
        decode = embed(torch.tensor([s.token_ids[-1] for s in seqs])).float()  # [B, d]
        # candidates[path] = [b][i]: the top tokens after path's tokens, for each sequence.
        candidates: dict[tuple, list[list[int]]] = {}
        chances: dict[tuple, list[list[float]]] = {}  # ... and their heads' probabilities
        for depth in range(1, max(len(p) for p in tree) + 1):
            parents = list(dict.fromkeys(p[:-1] for p in tree if len(p) == depth))
            # Each parent's path tokens, per sequence: [parents * B] rows of depth - 1 tokens.
            path_tokens = [
                [candidates[parent[:i]][b][parent[i]] for i in range(depth - 1)]
                for parent in parents
                for b in range(batch)
            ]
            embeddings = (decode if len(parents) == 1 else decode.repeat(len(parents), 1))[:, None]
            if depth > 1:
                later = embed(torch.tensor(path_tokens).flatten()).float()
                later = later.reshape(len(path_tokens), depth - 1, -1)
                embeddings = torch.cat([embeddings, later], dim=1)
            j = depth - 1
            linears = (self.inputs[j], self.blocks[j])
            read = features if len(parents) == 1 else features.repeat(len(parents), 1)
            guesses = self.heads.head(j, read, embeddings, linears)
            top, probs = self.ranked_candidates(guesses, self.ranks_used(num_paths, depth))
            for k, parent in enumerate(parents):
                candidates[parent] = top[k * batch : (k + 1) * batch]
                chances[parent] = probs[k * batch : (k + 1) * batch]
        return self.proposals(
            seqs, num_drafts,
            lambda b, p: candidates[p[:-1]][b][p[-1]],
            lambda b, p: chances[p[:-1]][b][p[-1]],
        )  # fmt: skip


def build_hydra_decoder(config: DecoderConfig, target: TargetContext) -> HydraDecoder:
    drafter = load_drafter(config.hydra.drafter, "hydra", HydraHeads, target.model)
    readout = build_readout(target.model, drafter.draft_vocab, config.hydra.quantization)
    return HydraDecoder(drafter, target, readout, config.hydra.quantization)
