"""What the trained-head drafters (``medusa``, ``hydra``) share: their residual blocks, the tree
ranking, and the decoder side (each sequence's newest target hidden state, assembling proposals).

The tree: the candidate paths (i-th candidate of head 1, j-th of head 2, ...) are ranked by the
product of the heads' held-out top-i accuracies (Medusa's sparse tree). That ranking is the
proposal order, so the first n nodes (what a grant of n slots keeps) are the best n-node tree,
parents first.
"""

from __future__ import annotations

import heapq
import weakref

import torch
from torch import nn
from torch.nn import functional as F

from engine.decoders.base import Proposal
from engine.decoders.drafter_files import TrainedDrafter, drafter_projection
from engine.models.llama import rms_norm_rows
from engine.sampling import greedy_tokens

# Candidate paths kept in a tree ranking (more than any sensible k).
MAX_TREE_NODES = 64


class ResidualBlocks(nn.Module):
    """The part both kinds of heads share: per head j, Medusa's residual block
    x + SiLU(W_j x + b_j), with W starting at zero (the block starts as the identity)."""

    def __init__(self, num_heads: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_heads, hidden_size))

    def block(self, j: int, x: torch.Tensor, linear: nn.Module | None = None) -> torch.Tensor:
        """Head j's residual block on [N, d] ``x``; ``linear``: its projection as the engine
        runs it (default: the trained parameters)."""
        z = linear(x) if linear is not None else x @ self.weight[j].T + self.bias[j]
        return x + F.silu(z)

    @property
    def num_heads(self) -> int:
        return self.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1]

    @property
    def shape(self) -> dict:
        """What rebuilds the heads (a drafter directory's ``shape``)."""
        return {"num_heads": self.num_heads, "hidden_size": self.hidden_size}


def rank_tree(accuracies: list[list[float]], max_nodes: int = MAX_TREE_NODES) -> list[tuple]:
    """Candidate paths (i_1, ..., i_d: the i-th candidate of head 1, 2, ...) best first by the
    product of their accuracies. A path never outranks its prefix (accuracies are at most 1,
    and ties keep the shorter first), so every prefix of the ranking is a tree."""
    heap = [(-acc, (i,)) for i, acc in enumerate(accuracies[0])]
    heapq.heapify(heap)
    ranked = []
    while heap and len(ranked) < max_nodes:
        value, path = heapq.heappop(heap)
        ranked.append(path)
        if len(path) < len(accuracies):
            for i, acc in enumerate(accuracies[len(path)]):
                heapq.heappush(heap, (value * acc, (*path, i)))
    return ranked


def tree_parents(tree: list[tuple]) -> list[int]:
    """Each ranked path's parent index in the ranking (-1 for the first level)."""
    index = {path: i for i, path in enumerate(tree)}
    return [index[path[:-1]] if len(path) > 1 else -1 for path in tree]


class _HeadProjection(nn.Module):
    """A head's projection in the model's dtype, taking and returning the heads' float32."""

    def __init__(self, linear: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.linear, self.dtype = linear, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.to(self.dtype)).to(x.dtype)


def head_projection(
    weight: torch.Tensor, bias: torch.Tensor | None, quantization: str, model
) -> nn.Module:
    """A head's trained projection as the engine runs it (``drafter_projection``), taking
    and returning the heads' float32."""
    return _HeadProjection(drafter_projection(weight, bias, quantization, model), model.dtype)


class TrainedHeadsDecoder:
    """The decoder side both kinds share: each sequence's newest target hidden state (kept until
    the sequence is gone), the plan (a tree of up to k nodes for every sequence that has one),
    and assembling proposals from per-node candidates."""

    reads_target_hidden = True

    def __init__(self, drafter: TrainedDrafter, target, readout: nn.Module, quantization: str):
        device = target.model.final_norm.device  # the heads read the target's hidden states
        self.heads = drafter.network.to(device)
        # Each head's residual block as a linear at the configured precision: as float32
        # parameters multiplied by torch's BLAS, one row's products of the three heads took
        # a few hundred microseconds, most of a draft.
        self.blocks = [
            head_projection(self.heads.weight[j], self.heads.bias[j], quantization, target.model)
            for j in range(self.heads.num_heads)
        ]
        self.draft_vocab = drafter.draft_vocab.to(device)
        self.model = target.model
        self.readout = readout
        self.tree = rank_tree(drafter.accuracies)
        self.parents = tree_parents(self.tree)
        self.top_k = max(max(path) for path in self.tree) + 1
        self._hidden: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def observe_target_features(self, seq, first_position: int, features: torch.Tensor) -> None:
        # The heads read only the newest position: the one whose logits gave the last token.
        # Kept as handed over (a decode step's one row); of a prefill chunk's, the last row
        # as a copy of its own, not to keep the chunk's alive.
        self._hidden[seq] = features if len(features) == 1 else features[-1:].clone()

    def plan(self, seqs, max_drafts) -> dict:
        return {s: min(len(self.tree), max_drafts[s]) for s in seqs if s in self._hidden}

    def normed_features(self, seqs) -> torch.Tensor:
        """[B, d] the final-normed target hidden states the heads read."""
        hidden = torch.cat([self._hidden[s] for s in seqs]).float()
        return rms_norm_rows(hidden, self.model.final_norm.float(), self.model.arch.rms_norm_eps)

    def top_candidates(self, guesses: torch.Tensor, count: int | None = None) -> list[list[int]]:
        """[N, d] head outputs -> each one's top ``count`` (default top_k) draft tokens (token
        ids)."""
        return self.ranked_candidates(guesses, count)[0]

    def ranked_candidates(
        self, guesses: torch.Tensor, count: int | None = None
    ) -> tuple[list[list[int]], list[list[float]]]:
        """[N, d] head outputs -> each one's top ``count`` (default top_k) draft tokens (token
        ids), and the head's probability of each (the draft's chance of being the target's
        choice, for the policy's chance floor). One is an argmax, which costs a fraction of a
        top-k over the draft vocabulary."""
        logits = self.readout(guesses).float()
        count = self.top_k if count is None else min(count, self.top_k)
        normalizer = torch.logsumexp(logits, dim=-1, keepdim=True)
        if count == 1:
            picks = greedy_tokens(logits)
            values = logits.gather(-1, picks.unsqueeze(-1))
            tokens = self.draft_vocab[picks].unsqueeze(-1)
        else:
            values, indices = logits.topk(count, dim=-1)
            tokens = self.draft_vocab[indices]
        return tokens.tolist(), torch.exp(values - normalizer).tolist()

    def ranks_used(self, num_paths: int, depth: int) -> int:
        """How many of a head's top tokens the first ``num_paths`` paths of the tree use at
        ``depth`` (1: head 1)."""
        return 1 + max((p[-1] for p in self.tree[:num_paths] if len(p) == depth), default=0)

    def proposals(self, seqs, num_drafts, token_of, chance_of) -> dict:
        """``token_of(b, path)``: the draft token of ranked path ``path`` for sequence b;
        ``chance_of(b, path)``: its head's probability of it (the proposal's confidence)."""
        out = {}
        for b, seq in enumerate(seqs):
            n = num_drafts[seq]
            drafts = [token_of(b, path) for path in self.tree[:n]]
            chances = [chance_of(b, path) for path in self.tree[:n]]
            out[seq] = Proposal(drafts, None, chances, [0.0] * n, parents=self.parents[:n])
        return out
