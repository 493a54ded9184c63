"""Medusa heads (Cai et al. 2024): small heads on the target's last hidden state, head j
guessing the token j + 1 places after the next one; their top candidates form a token tree that
the target verifies in one pass.

Each head is Medusa's residual block, h + SiLU(W h + b), on the target's final-normed hidden
state, read out by the target's own LM head cut to a draft vocabulary: the tokens the target
writes most (the LM head is a fifth of SmolLM2's weights, and reading all 49152 rows per step
would cost a quarter of a target step). Where the target's layers run the C++ kernels, that
readout is an int8 copy in the kernels' layout. A drafter's numerics only decide how often it
is right, never the output.

Drafts are deterministic (top-k picks), so the verifier's one-hot tree rule applies: the output
is lossless under every sampling parameter. Medusa's typical acceptance (lossy) is not offered.

The tree: a drafter directory records each head's held-out top-i accuracy; the candidate paths
are ranked by the product of their heads' accuracies (Medusa's sparse tree), and that ranking is
the proposal order, so the first n nodes (what a grant of n slots keeps) are the best n-node
tree, parents first.
"""

from __future__ import annotations

import heapq
import json
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.decoders.base import Decoder, Proposal, TargetContext
from engine.models.llama import rms_norm

if TYPE_CHECKING:
    from engine.config import DecoderConfig
    from engine.sequence import Sequence

CONFIG_FILE, WEIGHTS_FILE = "config.json", "medusa.safetensors"
# Drafters trained for the shipped model(s), found by the target's shape.
SHIPPED_DRAFTERS = Path(__file__).resolve().parent.parent / "drafters"
# Candidate paths kept in a tree ranking (more than any sensible k).
MAX_TREE_NODES = 64


class MedusaHeads(nn.Module):
    """``num_heads`` residual blocks over hidden size ``d``: head j maps h to h + SiLU(W_j h + b_j).
    W starts at zero (Medusa's initialisation): every head starts as the identity, i.e. as the
    target's own next-token guess."""

    def __init__(self, num_heads: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_heads, hidden_size))

    @property
    def num_heads(self) -> int:
        return self.weight.shape[0]

    def forward(self, normed: torch.Tensor) -> torch.Tensor:
        """[B, d] final-normed hidden states -> [heads, B, d]."""
        z = torch.einsum("bd,hed->hbe", normed, self.weight) + self.bias[:, None, :]
        return normed[None] + nn.functional.silu(z)


@dataclass
class MedusaDrafter:
    """A trained drafter directory: heads, draft vocabulary, and what it was trained for."""

    heads: MedusaHeads
    draft_vocab: torch.Tensor  # [V'] int64: token id of each readout row
    accuracies: list[list[float]]  # [head][i]: held-out P(the i-th candidate is the token)
    target: dict  # hidden_size, vocab_size, num_layers of the model it was trained on
    info: dict  # how it was trained (command, data, time), for the record

    def save(self, directory: str | Path) -> None:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {
            "weight": self.heads.weight.detach().to(torch.float16).contiguous(),
            "bias": self.heads.bias.detach().to(torch.float16).contiguous(),
            "draft_vocab": self.draft_vocab.to(torch.int64).contiguous(),
        }
        save_file(tensors, str(directory / WEIGHTS_FILE))
        config = {
            "type": "medusa",
            "num_heads": self.heads.num_heads,
            "hidden_size": self.heads.weight.shape[1],
            "draft_vocab_size": len(self.draft_vocab),
            "accuracies": self.accuracies,
            "target": self.target,
            "training": self.info,
        }
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> MedusaDrafter:
        from safetensors.torch import load_file

        directory = Path(directory)
        config_path = directory / CONFIG_FILE
        if not config_path.is_file():
            raise ValueError(f"{directory} is not a drafter directory (no {CONFIG_FILE})")
        config = json.loads(config_path.read_text())
        if config.get("type") != "medusa":
            raise ValueError(f"{directory} holds a {config.get('type')!r} drafter, not medusa")
        tensors = load_file(str(directory / WEIGHTS_FILE))
        heads = MedusaHeads(config["num_heads"], config["hidden_size"])
        with torch.no_grad():
            heads.weight.copy_(tensors["weight"].float())
            heads.bias.copy_(tensors["bias"].float())
        return cls(
            heads,
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


class MedusaDecoder(Decoder):
    name = "medusa"
    reads_target_hidden = True

    def __init__(self, drafter: MedusaDrafter, target: TargetContext, readout: nn.Module):
        self.heads = drafter.heads.eval()
        self.draft_vocab = drafter.draft_vocab
        self.model = target.model
        self.readout = readout  # the target's LM head rows of the draft vocabulary
        self.tree = rank_tree(drafter.accuracies)
        self.parents = [self.tree.index(path[:-1]) if len(path) > 1 else -1 for path in self.tree]
        self.top_k = max(max(path) for path in self.tree) + 1
        # Each sequence's newest target hidden state; gone with the sequence.
        self._hidden: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def observe_target_hidden(self, seq: Sequence, hidden: torch.Tensor) -> None:
        self._hidden[seq] = hidden.detach().clone()

    def plan(self, seqs: list[Sequence], max_drafts: dict[Sequence, int]) -> dict[Sequence, int]:
        return {s: min(len(self.tree), max_drafts[s]) for s in seqs if s in self._hidden}

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_drafts: dict[Sequence, int]) -> dict:
        seqs = [s for s in seqs if s in self._hidden]
        if not seqs:
            return {}
        arch = self.model.arch
        hidden = torch.stack([self._hidden[s] for s in seqs]).float()
        normed = rms_norm(hidden, self.model.final_norm.float(), arch.rms_norm_eps)
        guesses = self.heads(normed)  # [heads, B, d]
        heads, batch, width = guesses.shape
        logits = self.readout(guesses.reshape(heads * batch, width)).float()
        top = logits.topk(self.top_k, dim=-1).indices.reshape(heads, batch, self.top_k)
        tokens = self.draft_vocab[top].tolist()  # [head][sequence][i]
        proposals = {}
        for b, seq in enumerate(seqs):
            n = num_drafts[seq]
            drafts = [tokens[len(path) - 1][b][path[-1]] for path in self.tree[:n]]
            proposals[seq] = Proposal(drafts, None, [1.0] * n, [0.0] * n, parents=self.parents[:n])
        return proposals


def build_medusa_decoder(config: DecoderConfig, target: TargetContext) -> MedusaDecoder:
    from engine.models.draft_copies import dense_weight, quantized_dense

    path = config.medusa.drafter
    found = Path(path) if path else find_shipped_drafter("medusa", target.model)
    if found is None:
        raise ValueError(
            "no medusa drafter ships for this model's shape: train one with "
            "`specserve train medusa` and set decoder.medusa.drafter (or --drafter)"
        )
    drafter = MedusaDrafter.load(found)
    if drafter.target != target_signature(target.model):
        raise ValueError(
            f"medusa drafter {found} was trained for {drafter.target}, "
            f"not this model ({target_signature(target.model)})"
        )
    rows = dense_weight(target.model.lm_head)[drafter.draft_vocab]
    readout = quantized_dense(rows, None, "int8", target.model)
    return MedusaDecoder(drafter, target, readout)
