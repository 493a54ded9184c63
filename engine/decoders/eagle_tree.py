"""EAGLE-2's dynamic draft tree (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models
with Dynamic Draft Trees"): the tree's shape follows the drafter's confidence in this context,
not a shape fixed in advance.

A node's value is the product of the drafter's probabilities along its path (the paper's
estimate of the chance the target accepts it). Drafting goes depth by depth:

- *expand*: the ``top_k`` nodes of the newest depth with the highest value each run through the
  drafter layer at once, and each one's ``top_k`` most likely next tokens become its children;
- *rerank*: after ``depth`` levels, every node drafted is ranked by value and the best n (the
  slots the step granted) are the tree the target verifies. A child's value never exceeds its
  parent's, so the ranking lists parents first and every prefix of it is a tree.

**The tree's drafter entries** attend to the sequence's own entries in the drafter's paged
cache (everything up to the decode token, read there once per round) and to their ancestors in
the tree, whose K/V stay in this round's dense tensors: they are entries of guesses, never
kept (the next round re-reads the accepted tokens with the target's features, as after a
chain).

Drafts are deterministic picks, so the verifier's one-hot tree rule keeps every sampling
parameter exact. Candidates and values come from the drafter's logits processed with the
request's own parameters and the node's path as history (a constraint's forbidden tokens are
never drafted, a biased token is ranked as the target will rank it): q for a sampled request,
the softmax of the processed logits for a greedy one.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F

from engine.attention import slots_for_positions
from engine.decoders.base import Proposal
from engine.rejection_sampler import position_row
from engine.sampling import probabilities, process_logits
from engine.token_tree import ancestry, path_to

if TYPE_CHECKING:
    from engine.sequence import Sequence


class TreeDrafter(Protocol):
    """What tree drafting uses of a feature-level drafter (``EagleDrafter`` is one): named
    here so that this module need not import the decoder that imports it."""

    model: Any
    layer: Any
    kv_cache: Any
    device: torch.device
    eos_token_ids: Collection[int]

    def entry(self, embeddings: torch.Tensor, features: torch.Tensor) -> tuple: ...
    def begin_round(self, seq: Sequence) -> None: ...
    def forward(self, seqs: list, drafts: dict, fresh: dict) -> torch.Tensor: ...
    def root_guess(self, seq: Sequence) -> torch.Tensor: ...
    def ends_sequence(self, seq: Sequence, token: int) -> bool: ...
    def read_out(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass
class _Node:
    token: int
    parent: int  # index of the parent node in its tree; -1: the decode token
    depth: int  # 1 for the decode token's children
    prob: float  # the drafter's probability of the token after its parent's path
    value: float  # product of the drafter's probabilities along the path
    guess: torch.Tensor | None = None  # the drafter's output at this node, once expanded


@dataclass
class _Round:
    """One sequence's tree under construction, with what its entries attend to."""

    seq: Sequence
    decode_position: int
    root_guess: torch.Tensor  # the drafter's output at the decode token
    context_k: torch.Tensor  # [L, KVH, D] the drafter's cached entries, positions 0..decode
    context_v: torch.Tensor
    nodes: list[_Node] = field(default_factory=list)
    # The expanded nodes' K/V, one row each in order of expansion, and whose row is whose.
    tree_k: list[torch.Tensor] = field(default_factory=list)
    tree_v: list[torch.Tensor] = field(default_factory=list)
    tree_owner: list[int] = field(default_factory=list)

    @property
    def parents(self) -> list[int]:
        return [n.parent for n in self.nodes]

    def path(self, index: int) -> list[int]:
        """Node indices from the first depth down to ``index`` (empty for the decode token)."""
        return path_to(self.parents, index)

    def tokens(self, index: int) -> list[int]:
        return [self.nodes[i].token for i in self.path(index)]

    def feature_before(self, index: int) -> torch.Tensor:
        """What node ``index``'s entry reads as the previous position's feature."""
        parent = self.nodes[index].parent
        return self.root_guess if parent < 0 else self.nodes[parent].guess


@torch.inference_mode()
def draft_tree(
    drafter: TreeDrafter, seqs: list[Sequence], num_drafts: dict, top_k: int, depth: int
) -> dict[Sequence, Proposal]:
    """An EAGLE-2 tree of at most ``num_drafts[seq]`` nodes for each sequence, at most
    ``depth`` deep, expanding ``top_k`` nodes per depth with ``top_k`` children each."""
    for s in seqs:
        drafter.begin_round(s)
    # The decode token's entry (and any the drafter has not read yet) into the paged cache:
    # its output guesses the first depth.
    logits = drafter.forward(seqs, {s: [] for s in seqs}, {s: 1 for s in seqs})
    rounds = [_start_round(drafter, s) for s in seqs]
    parents = [[-1] for _ in seqs]
    for level in range(1, depth + 1):
        _add_children(drafter, rounds, parents, logits, top_k, level)
        # The newest depth's most valuable nodes go through the drafter layer together.
        parents = [
            _frontier(drafter, r, level, top_k) if level < min(depth, num_drafts[r.seq]) else []
            for r in rounds
        ]  # fmt: skip
        if not any(parents):
            break
        logits = _expand(drafter, rounds, parents)
    return {r.seq: _proposal(r, num_drafts[r.seq]) for r in rounds}


def _start_round(drafter: TreeDrafter, seq: Sequence) -> _Round:
    decode = seq.num_tokens - 1
    k_cache, v_cache = drafter.kv_cache.layers[0]
    positions = torch.arange(decode + 1)
    window = drafter.model.arch.sliding_window
    if window is not None:  # (Mistral) the cached entries a query near the decode token sees
        positions = positions[-window:]
    table = seq.cache_state().block_table
    slots = slots_for_positions(table, positions, drafter.kv_cache.block_size).to(k_cache.device)
    return _Round(seq, decode, drafter.root_guess(seq), k_cache[slots], v_cache[slots])


def _frontier(drafter: TreeDrafter, r: _Round, level: int, top_k: int) -> list[int]:
    """The ``top_k`` most valuable nodes of depth ``level`` that the sequence can go on after."""
    newest = [
        i for i, n in enumerate(r.nodes)
        if n.depth == level and not drafter.ends_sequence(r.seq, n.token)
    ]  # fmt: skip
    return sorted(newest, key=lambda i: -r.nodes[i].value)[:top_k]


def _add_children(drafter, rounds, parents, logits, top_k: int, level: int) -> None:
    """Each parent's ``top_k`` likeliest next tokens become its children. ``logits`` has a
    row per parent, round after round."""
    rows, owners = [], []
    for r, ps in zip(rounds, parents, strict=True):
        seq = r.seq
        for p in ps:
            rows.append(
                position_row(seq.sampling_params, seq.prompt_token_ids, seq.output_token_ids,
                             r.tokens(p))
            )  # fmt: skip
            owners.append((r, p))
    dists = _values(logits, rows, drafter.eos_token_ids)
    probs, tokens = dists.topk(top_k, dim=-1)
    for (r, p), row_probs, row_tokens in zip(owners, probs.tolist(), tokens.tolist(), strict=True):
        base = 1.0 if p < 0 else r.nodes[p].value
        for prob, token in zip(row_probs, row_tokens, strict=True):
            if prob > 0:
                r.nodes.append(_Node(token, p, level, prob, base * prob))


def _values(logits: torch.Tensor, rows, eos_token_ids) -> torch.Tensor:
    """Each row's distribution over next tokens, processed as the target's will be (masks,
    bias, penalties; a sampled row's temperature and filters): q for a sampled row, for a
    greedy one how likely each token is to be the target's pick. Masked tokens get 0."""
    processed = process_logits(logits, rows, eos_token_ids)
    return probabilities(processed).masked_fill(processed.isneginf(), 0.0)


def _expand(drafter: TreeDrafter, rounds: list[_Round], parents: list[list[int]]):
    """The drafter layer over the frontier nodes of every round at once (the same layer as
    ``EagleDrafter.forward``, with the tree's attention); returns their logits, a row per node,
    round after round, and keeps their guesses and K/V."""
    entries = [(r, i) for r, ps in zip(rounds, parents, strict=True) for i in ps]
    model, layer = drafter.model, drafter.layer
    device = drafter.device
    tokens = torch.tensor([r.nodes[i].token for r, i in entries], device=device)
    features = torch.stack([r.feature_before(i) for r, i in entries]).to(device)
    positions = torch.tensor(
        [r.decode_position + r.nodes[i].depth for r, i in entries], device=device
    )
    x, residual = drafter.entry(model.embed(tokens), features)
    q, k, v = layer.attention_inputs(x, model.rope.lookup(positions))
    attended, row = [], 0
    for r, ps in zip(rounds, parents, strict=True):
        if not ps:
            continue
        rows = slice(row, row + len(ps))
        for i, key, value in zip(ps, k[rows], v[rows], strict=True):
            r.tree_k.append(key)
            r.tree_v.append(value)
            r.tree_owner.append(i)
        attended.append(_attend(q[rows], r, ps))
        row += len(ps)
    hidden = layer.finish(residual, torch.cat(attended))
    for (r, i), guess in zip(entries, hidden, strict=True):
        r.nodes[i].guess = guess
    return drafter.read_out(hidden)


def _attend(q: torch.Tensor, r: _Round, nodes: list[int]) -> torch.Tensor:
    """q [F, H, D] of ``nodes``' entries over the round's cached entries and, of the tree's
    entries, each node's own path; returns [F, H, D]."""
    f, h, d = q.shape
    keys = torch.cat([r.context_k, torch.stack(r.tree_k)])  # [L + m, KVH, D]
    values = torch.cat([r.context_v, torch.stack(r.tree_v)])
    kvh = keys.shape[1]
    group = h // kvh  # query heads per K/V head
    # Each node sees the round's cached entries and, of the tree's, its own path's (the
    # target's verification attention reads the same ancestry). Built on the CPU, moved once.
    own = ancestry(r.parents)[nodes][:, r.tree_owner]  # [F, m]
    seen = torch.cat([torch.ones(f, len(r.context_k), dtype=torch.bool), own], 1).to(q.device)
    # Queries of one K/V head side by side: [KVH, F * group, D] against [KVH, L + m, D].
    qg = q.reshape(f, kvh, group, d).permute(1, 0, 2, 3).reshape(kvh, f * group, d)
    mask = seen.repeat_interleave(group, dim=0)  # [F * group, L + m]
    out = F.scaled_dot_product_attention(
        qg, keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask
    )
    return out.reshape(kvh, f, group, d).permute(1, 0, 2, 3).reshape(f, h, d)


def _proposal(r: _Round, n: int) -> Proposal:
    """The ``n`` most valuable nodes, parents first (a child is never worth more than its
    parent; ties keep the shallower first)."""
    order = sorted(range(len(r.nodes)), key=lambda i: (-r.nodes[i].value, r.nodes[i].depth))[:n]
    index = {node: rank for rank, node in enumerate(order)}
    nodes = [r.nodes[i] for i in order]
    parents = [-1 if node.parent < 0 else index[node.parent] for node in nodes]
    probs = [node.prob for node in nodes]
    return Proposal([node.token for node in nodes], None, probs, [0.0] * len(nodes), parents)
