"""What the trained-head drafters (``medusa``, ``hydra``) share: the drafter directory, where
shipped drafters are found, the readout through the target's LM head, and the tree ranking.

A drafter directory holds ``config.json`` (its kind, shape, held-out accuracies, the target's
shape, how it was trained) and ``heads.safetensors`` (the heads' weights in float16 and the
draft vocabulary). ``specserve train KIND`` writes one.

The readout is the target's own LM head cut to the draft vocabulary (the tokens the target
writes most: the full head is a fifth of SmolLM2's weights, and reading its 49152 rows per draft
would cost a quarter of a target step), int8 in the kernels' layout where the target runs the
C++ kernels. A drafter's numerics only decide how often it is right, never the output.

The tree: the candidate paths (i-th candidate of head 1, j-th of head 2, ...) are ranked by the
product of the heads' held-out top-i accuracies (Medusa's sparse tree). That ranking is the
proposal order, so the first n nodes (what a grant of n slots keeps) are the best n-node tree,
parents first.
"""

from __future__ import annotations

import heapq
import json
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.decoders.base import Proposal
from engine.models.llama import rms_norm

CONFIG_FILE, WEIGHTS_FILE = "config.json", "heads.safetensors"
# Drafters trained for the shipped model(s), found by the target's shape.
SHIPPED_DRAFTERS = Path(__file__).resolve().parent.parent / "drafters"
# Candidate paths kept in a tree ranking (more than any sensible k).
MAX_TREE_NODES = 64


class ResidualBlocks(nn.Module):
    """The part both kinds of heads share: per head j, Medusa's residual block
    x + SiLU(W_j x + b_j), with W starting at zero (the block starts as the identity)."""

    def __init__(self, num_heads: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_heads, hidden_size))

    @property
    def num_heads(self) -> int:
        return self.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1]


@dataclass
class HeadsDrafter:
    """A trained drafter: heads, draft vocabulary, and what it was trained for."""

    kind: str  # "medusa" or "hydra"
    heads: nn.Module  # with num_heads and hidden_size
    draft_vocab: torch.Tensor  # [V'] int64: token id of each readout row
    accuracies: list[list[float]]  # [head][i]: held-out P(the i-th candidate is the token)
    target: dict  # hidden_size, vocab_size, num_layers of the model it was trained on
    info: dict  # how it was trained (command, data, time), for the record

    def save(self, directory: str | Path) -> None:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {
            f"heads.{name}": value.detach().to(torch.float16).contiguous()
            for name, value in self.heads.state_dict().items()
        }
        tensors["draft_vocab"] = self.draft_vocab.to(torch.int64).contiguous()
        save_file(tensors, str(directory / WEIGHTS_FILE))
        config = {
            "type": self.kind,
            "num_heads": self.heads.num_heads,
            "hidden_size": self.heads.hidden_size,
            "draft_vocab_size": len(self.draft_vocab),
            "accuracies": self.accuracies,
            "target": self.target,
            "training": self.info,
        }
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path, kind: str, heads_class: type) -> HeadsDrafter:
        from safetensors.torch import load_file

        directory = Path(directory)
        config_path = directory / CONFIG_FILE
        if not config_path.is_file():
            raise ValueError(f"{directory} is not a drafter directory (no {CONFIG_FILE})")
        config = json.loads(config_path.read_text())
        if config.get("type") != kind:
            raise ValueError(f"{directory} holds a {config.get('type')!r} drafter, not {kind}")
        tensors = load_file(str(directory / WEIGHTS_FILE))
        heads = heads_class(config["num_heads"], config["hidden_size"])
        state = {
            name.removeprefix("heads."): value.float()
            for name, value in tensors.items()
            if name.startswith("heads.")
        }
        heads.load_state_dict(state)
        return cls(
            kind,
            heads.eval(),
            tensors["draft_vocab"],
            config["accuracies"],
            config["target"],
            config.get("training", {}),
        )


def target_signature(model) -> dict:
    arch = model.arch
    return {
        "hidden_size": arch.hidden_size,
        "vocab_size": arch.vocab_size,
        "num_layers": arch.num_layers,
    }


def find_shipped_drafter(kind: str, model) -> Path | None:
    """The shipped drafter of ``kind`` trained on a model of ``model``'s shape, if any."""
    wanted = target_signature(model)
    for config in sorted(SHIPPED_DRAFTERS.glob(f"*/{kind}/{CONFIG_FILE}")):
        if json.loads(config.read_text()).get("target") == wanted:
            return config.parent
    return None


def load_drafter(path: str | None, kind: str, heads_class: type, model) -> HeadsDrafter:
    """The drafter at ``path``, or the one shipped for ``model``; checked against its shape."""
    found = Path(path) if path else find_shipped_drafter(kind, model)
    if found is None:
        raise ValueError(
            f"no {kind} drafter ships for this model's shape: train one with "
            f"`specserve train {kind}` and set decoder.{kind}.drafter (or --drafter)"
        )
    drafter = HeadsDrafter.load(found, kind, heads_class)
    if drafter.target != target_signature(model):
        raise ValueError(
            f"{kind} drafter {found} was trained for {drafter.target}, "
            f"not this model ({target_signature(model)})"
        )
    return drafter


def build_readout(model, draft_vocab: torch.Tensor) -> nn.Module:
    """The target's LM head rows of the draft vocabulary, int8."""
    from engine.models.draft_copies import dense_weight, quantized_dense

    rows = dense_weight(model.lm_head)[draft_vocab]
    return quantized_dense(rows, None, "int8", model)


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


class TrainedHeadsDecoder:
    """The decoder side both kinds share: each sequence's newest target hidden state (kept until
    the sequence is gone), the plan (a tree of up to k nodes for every sequence that has one),
    and assembling proposals from per-node candidates."""

    reads_target_hidden = True

    def __init__(self, drafter: HeadsDrafter, target, readout: nn.Module):
        self.heads = drafter.heads
        self.draft_vocab = drafter.draft_vocab
        self.model = target.model
        self.readout = readout
        self.tree = rank_tree(drafter.accuracies)
        self.parents = tree_parents(self.tree)
        self.top_k = max(max(path) for path in self.tree) + 1
        self._hidden: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def observe_target_hidden(self, seq, hidden: torch.Tensor) -> None:
        self._hidden[seq] = hidden.detach().clone()

    def plan(self, seqs, max_drafts) -> dict:
        return {s: min(len(self.tree), max_drafts[s]) for s in seqs if s in self._hidden}

    def normed_features(self, seqs) -> torch.Tensor:
        """[B, d] the final-normed target hidden states the heads read."""
        hidden = torch.stack([self._hidden[s] for s in seqs]).float()
        eps = self.model.arch.rms_norm_eps
        return rms_norm(hidden, self.model.final_norm.float(), eps)

    def top_candidates(self, guesses: torch.Tensor) -> list[list[int]]:
        """[N, d] head outputs -> each one's top_k draft tokens (token ids)."""
        logits = self.readout(guesses).float()
        return self.draft_vocab[logits.topk(self.top_k, dim=-1).indices].tolist()

    def proposals(self, seqs, num_drafts, token_of) -> dict:
        """``token_of(b, path)``: the draft token of ranked path ``path`` for sequence b."""
        out = {}
        for b, seq in enumerate(seqs):
            n = num_drafts[seq]
            drafts = [token_of(b, path) for path in self.tree[:n]]
            out[seq] = Proposal(drafts, None, [1.0] * n, [0.0] * n, parents=self.parents[:n])
        return out
