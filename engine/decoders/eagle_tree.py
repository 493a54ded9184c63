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

**The tree's drafter entries** go where the target's verification will put its own: into the
drafter's paged cache, at the slots after the decode token (the step reserved them for the n
drafts), one slot per expanded node in order of expansion, each at the position its depth
gives. A node's entry attends to the sequence's cached entries and, of the tree's, to its own
path (a mask, as in the target's tree verification), so the layer runs in the same one C++
call as a chain's. At most n nodes are expanded, the slots there are. They are entries of
guesses, never kept: the next round re-reads the accepted tokens with the target's features
over them, as after a chain.

Drafts are deterministic picks, so the verifier's one-hot tree rule keeps every sampling
parameter exact. Candidates and values come from the drafter's logits processed with the
request's own parameters and the node's path as history (a constraint's forbidden tokens are
never drafted, a biased token is ranked as the target will rank it): q for a sampled request,
the softmax of the processed logits for a greedy one. Where no row needs processing (the usual
request) they are read from the drafter's scores over its draft vocabulary alone, as chains
are (``ModelDrafter``): the other tokens' probabilities are 0 either way.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from engine.attention import AttentionGroup, AttentionMetadata, slots_for_positions
from engine.decoders.base import Proposal
from engine.rejection_sampler import position_row
from engine.sampling import needs_processing, probabilities, process_logits
from engine.token_tree import ancestry, path_to

if TYPE_CHECKING:
    from engine.sequence import Sequence


class TreeDrafter(Protocol):
    """What tree drafting uses of a feature-level drafter (``EagleDrafter`` is one): named
    here so that this module need not import the decoder that imports it."""

    model: Any
    kv_cache: Any
    device: torch.device
    eos_token_ids: Collection[int]
    draft_vocab: torch.Tensor | None  # ascending; ``readout``'s columns

    def begin_round(self, seq: Sequence) -> None: ...
    def forward(self, seqs: list, drafts: dict, fresh: dict, compact: bool = False): ...
    def root_guess(self, seq: Sequence) -> torch.Tensor: ...
    def ends_sequence(self, seq: Sequence, token: int) -> bool: ...
    def readout(self, hidden: torch.Tensor) -> torch.Tensor: ...
    def read_out(self, hidden: torch.Tensor) -> torch.Tensor: ...
    def write_guesses(self, seq: Sequence, first: int, count: int) -> None: ...
    def run_layer(self, embeddings, features, rope, attn) -> torch.Tensor: ...


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
    """One sequence's tree under construction."""

    seq: Sequence
    decode_position: int
    root_guess: torch.Tensor  # the drafter's output at the decode token
    capacity: int  # nodes it may expand: the slots after the decode token it may write
    nodes: list[_Node] = field(default_factory=list)
    # The expanded nodes in order of expansion: node tree_owner[j]'s entry is at slot
    # decode_position + 1 + j.
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
    compact = drafter.draft_vocab is not None
    scores = drafter.forward(seqs, {s: [] for s in seqs}, {s: 1 for s in seqs}, compact=compact)
    rounds = [_start_round(drafter, s, num_drafts[s]) for s in seqs]
    parents = [[-1] for _ in seqs]
    for level in range(1, depth + 1):
        _add_children(drafter, rounds, parents, scores, compact, top_k, level)
        # The newest depth's most valuable nodes go through the drafter layer together.
        parents = [
            _frontier(drafter, r, level, top_k) if level < min(depth, num_drafts[r.seq]) else []
            for r in rounds
        ]  # fmt: skip
        if not any(parents):
            break
        scores = _expand(drafter, rounds, parents, compact)
    return {r.seq: _proposal(r, num_drafts[r.seq]) for r in rounds}


def _start_round(drafter: TreeDrafter, seq: Sequence, num_drafts: int) -> _Round:
    decode = seq.num_tokens - 1
    slots = len(seq.cache_state().block_table) * drafter.kv_cache.block_size
    return _Round(seq, decode, drafter.root_guess(seq), min(num_drafts, slots - decode - 1))


def _frontier(drafter: TreeDrafter, r: _Round, level: int, top_k: int) -> list[int]:
    """The ``top_k`` most valuable nodes of depth ``level`` that the sequence can go on after
    (as many as it has slots left for)."""
    newest = [
        i for i, n in enumerate(r.nodes)
        if n.depth == level and not drafter.ends_sequence(r.seq, n.token)
    ]  # fmt: skip
    room = max(0, r.capacity - len(r.tree_owner))
    return sorted(newest, key=lambda i: -r.nodes[i].value)[: min(top_k, room)]


def _add_children(drafter, rounds, parents, scores, compact: bool, top_k: int, level) -> None:
    """Each parent's ``top_k`` likeliest next tokens become its children. ``scores`` has a
    row per parent, round after round: over the draft vocabulary with ``compact``, else over
    the whole vocabulary."""
    rows, owners = [], []
    for r, ps in zip(rounds, parents, strict=True):
        seq = r.seq
        for p in ps:
            rows.append(
                position_row(seq.sampling_params, seq.prompt_token_ids, seq.output_token_ids,
                             r.tokens(p))
            )  # fmt: skip
            owners.append((r, p))
    processing = any(map(needs_processing, rows))
    if compact and processing:  # back to the whole vocabulary, -inf outside the drafter's
        whole = scores.new_full((len(scores), drafter.model.arch.vocab_size), float("-inf"))
        whole[:, drafter.draft_vocab] = scores
        scores = whole
    probs, tokens = _values(scores, rows, processing, drafter.eos_token_ids).topk(top_k, dim=-1)
    if compact and not processing:
        tokens = drafter.draft_vocab[tokens]
    for (r, p), row_probs, row_tokens in zip(owners, probs.tolist(), tokens.tolist(), strict=True):
        base = 1.0 if p < 0 else r.nodes[p].value
        for prob, token in zip(row_probs, row_tokens, strict=True):
            if prob > 0:
                r.nodes.append(_Node(token, p, level, prob, base * prob))


def _values(scores: torch.Tensor, rows, processing: bool, eos_token_ids) -> torch.Tensor:
    """Each row's distribution over next tokens, processed as the target's will be (masks,
    bias, penalties; a sampled row's temperature and filters): q for a sampled row, for a
    greedy one how likely each token is to be the target's pick. Masked tokens get 0.
    Without ``processing`` (no row needs any) that is the softmax of the scores, over
    whichever columns they have."""
    if not processing:
        return torch.softmax(scores, dim=-1)
    processed = process_logits(scores, rows, eos_token_ids)
    return probabilities(processed).masked_fill(processed.isneginf(), 0.0)


def _expand(drafter: TreeDrafter, rounds: list[_Round], parents: list[list[int]], compact):
    """The drafter layer over the frontier nodes of every round at once, their entries
    written after the round's earlier ones; returns their scores, a row per node, round
    after round (as ``drafter.forward`` would), and keeps their guesses."""
    members = [(r, ps) for r, ps in zip(rounds, parents, strict=True) if ps]
    entries = [(r, i) for r, ps in members for i in ps]
    model, device = drafter.model, drafter.device
    for r, ps in members:
        drafter.write_guesses(r.seq, r.decode_position + 1 + len(r.tree_owner), len(ps))
        r.tree_owner += ps
    tokens = torch.tensor([r.nodes[i].token for r, i in entries], device=device)
    features = torch.stack([r.feature_before(i) for r, i in entries]).to(device)
    positions = torch.tensor(
        [r.decode_position + r.nodes[i].depth for r, i in entries], device=device
    )
    attn = _tree_attention(drafter, members)
    hidden = drafter.run_layer(model.embed(tokens), features, model.rope.lookup(positions), attn)
    for (r, i), guess in zip(entries, hidden, strict=True):
        r.nodes[i].guess = guess
    return drafter.readout(hidden).float() if compact else drafter.read_out(hidden)


def _tree_attention(drafter: TreeDrafter, members) -> AttentionMetadata:
    """The attention plan of an expansion: each frontier node's entry goes to its round's
    next tree slot and sees the round's cached entries (positions 0 .. decode) and, of the
    tree's entries, its own path; one padded group over every round."""
    block_size = drafter.kv_cache.block_size
    window = drafter.model.arch.sliding_window
    q_len = max(len(ps) for _, ps in members)
    kv_len = max(r.decode_position + 1 + len(r.tree_owner) for r, _ in members)
    b = len(members)
    query_index = torch.zeros(b, q_len, dtype=torch.long)
    kv_slots = torch.zeros(b, kv_len, dtype=torch.long)
    mask = torch.zeros(b, 1, q_len, kv_len, dtype=torch.bool)
    valid = torch.zeros(b, q_len, dtype=torch.bool)
    slot_mapping, row = [], 0
    for m, (r, ps) in enumerate(members):
        context, written = r.decode_position + 1, len(r.tree_owner)
        total = context + written
        slots = slots_for_positions(r.seq.cache_state().block_table, torch.arange(total),
                                    block_size)  # fmt: skip
        kv_slots[m, :total] = slots
        slot_mapping += slots[total - len(ps) :].tolist()
        query_index[m] = row
        query_index[m, : len(ps)] = torch.arange(row, row + len(ps))
        seen = mask[m, 0]
        seen[: len(ps), :context] = True
        seen[: len(ps), context:total] = ancestry(r.parents)[ps][:, r.tree_owner]
        if window is not None:  # the window counts tree positions (decode + depth)
            depth = torch.tensor([r.nodes[i].depth for i in r.tree_owner])
            key_pos = torch.cat([torch.arange(context), r.decode_position + depth])
            query_pos = r.decode_position + torch.tensor([r.nodes[i].depth for i in ps])
            seen[: len(ps), :total] &= key_pos[None, :] > query_pos[:, None] - window
        seen[len(ps) :, 0] = True  # padding rows see one key so softmax stays finite
        valid[m, : len(ps)] = True
        row += len(ps)
    output_rows = torch.arange(row)
    all_valid = bool(valid.all())
    group = AttentionGroup(
        query_index.to(drafter.device),
        kv_slots.to(drafter.device),
        mask.to(drafter.device),
        None if all_valid else valid.flatten().to(drafter.device),
        output_rows.to(drafter.device),
        whole_batch=all_valid,  # no padding: the queries are rows 0 .. T - 1 in order
    )
    slots = torch.tensor(slot_mapping, dtype=torch.long, device=drafter.device)
    head_dim = drafter.model.arch.head_dim
    return AttentionMetadata(slots, [group], head_dim**-0.5)


def _proposal(r: _Round, n: int) -> Proposal:
    """The ``n`` most valuable nodes, parents first (a child is never worth more than its
    parent; ties keep the shallower first)."""
    order = sorted(range(len(r.nodes)), key=lambda i: (-r.nodes[i].value, r.nodes[i].depth))[:n]
    index = {node: rank for rank, node in enumerate(order)}
    nodes = [r.nodes[i] for i in order]
    parents = [-1 if node.parent < 0 else index[node.parent] for node in nodes]
    probs = [node.prob for node in nodes]
    return Proposal([node.token for node in nodes], None, probs, [0.0] * len(nodes), parents)
