"""Verification of a draft token tree: the tree counterpart of the chain rules in
``engine.rejection_sampler``, lossless under every sampling parameter.

A run's drafts form a tree: draft i follows draft ``parents[i]`` (-1: the sequence's own tokens),
parents before children, siblings in the drafter's order of preference (a chain is the tree
``[-1, 0, 1, ...]``). The target scored the root position and every draft in one pass: row 0
holds the target's distribution after the sequence's tokens, row i + 1 the one after the path to
draft i, each processed as if its path had been emitted (penalties, min_tokens).

Walking down from the root, at each node:

- greedy runs, and sampled runs whose drafts are deterministic (a one-hot q): draw the token that
  autoregressive decoding would draw here (the argmax, or the inverse CDF of p at the run's next
  uniform) and follow the child holding it; where no child holds it, emit it and stop. Every
  emitted token is exactly the autoregressive draw, so the output follows p, and a seeded request
  gets the same tokens whatever tree it was granted (as with chains).
- sampled runs whose drafts were drawn from a q (multi-candidate speculative sampling, SpecInfer,
  Miao et al. 2024): try the children in order; child x, drawn from q_x, is accepted with
  probability min(1, r(x) / q_x(x)), r being the residual (p at first); a rejection updates
  r <- norm(max(0, r - q_x)); when every child is rejected the token is drawn from r. This is
  lossless when each child was drawn from its q independently of its earlier siblings (several
  draws of one q qualify).

A node without children gives the bonus token from its own row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampling import (
    default_generator,
    draw_uniforms,
    greedy_tokens,
    probabilities,
    sample_from_probabilities,
)
from engine.token_tree import longest_path


@dataclass
class TreeOutcome:
    """The accepted drafts (indices, root to leaf) and the tokens to emit: their tokens, then one
    more."""

    path: list[int]
    tokens: list[int]


def children_of(parents: Sequence[int]) -> list[list[int]]:
    """Children of each node in order: entry 0 for the root, entry i + 1 for draft i."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"draft {i} has parent {parent}: parents must come first")
        children[parent + 1].append(i)
    return children


def _follow(
    token_ids: Sequence[int], children: list[list[int]], node: int, token: int
) -> int | None:
    """The first child of ``node`` holding ``token``, or None."""
    for child in children[node + 1]:
        if token_ids[child] == token:
            return child
    return None


def verify_tree_greedy(
    processed: torch.Tensor, token_ids: Sequence[int], parents: Sequence[int]
) -> TreeOutcome:
    """Greedy: the longest path that matches the target's argmax. ``processed``: the run's rows."""
    best = greedy_tokens(processed).tolist()
    children = children_of(parents)
    path, node = [], -1
    while (child := _follow(token_ids, children, node, best[node + 1])) is not None:
        path.append(child)
        node = child
    return TreeOutcome(path, [token_ids[i] for i in path] + [best[node + 1]])


def verify_tree_one_hot(
    processed: torch.Tensor,
    token_ids: Sequence[int],
    parents: Sequence[int],
    generator: torch.Generator | None,
) -> TreeOutcome:
    """Sampled, deterministic drafts: follow the autoregressive draws (see the module doc)."""
    generator = generator or default_generator()
    children = children_of(parents)
    # As the chain rule: draw the uniforms of the deepest path, then consume only those of the
    # emitted tokens, so a chain-shaped tree spends them exactly as a chain does.
    state = generator.get_state()
    uniforms = torch.rand(longest_path(parents) + 1, generator=generator, dtype=torch.float64)
    path, node = [], -1
    while True:
        probs = probabilities(processed[node + 1 : node + 2])
        depth = len(path)
        token = int(sample_from_probabilities(probs, uniforms[depth : depth + 1]))
        child = _follow(token_ids, children, node, token)
        if child is None:
            break
        path.append(child)
        node = child
    generator.set_state(state)
    torch.rand(len(path) + 1, generator=generator, dtype=torch.float64)
    return TreeOutcome(path, [token_ids[i] for i in path] + [token])


def verify_tree_drawn(
    processed: torch.Tensor,
    token_ids: Sequence[int],
    parents: Sequence[int],
    draft_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> TreeOutcome:
    """Sampled, drafts drawn from q (``draft_probs[i]``: the q draft i was drawn from)."""
    children = children_of(parents)
    # One uniform per draft (its test) and one for the final draw, in that fixed order: a chain
    # uses them as the chain rule does.
    uniforms = draw_uniforms([generator] * (len(token_ids) + 1)).tolist()
    path, node = [], -1
    while True:
        residual = probabilities(processed[node + 1]).clone()
        mass = 1.0  # the residual's total: p is normalised, later residuals are not
        accepted = None
        for child in children[node + 1]:
            token = token_ids[child]
            q = draft_probs[child].to(residual)
            # u * q(x) < r(x) / mass, written without a division (as the chain rule).
            if uniforms[child] * float(q[token]) * mass < float(residual[token]):
                accepted = child
                break
            updated = (residual - mass * q).clamp_min(0)
            total = float(updated.sum())
            if total > 0:  # zero only where r == q, which exact arithmetic never rejects
                residual, mass = updated, total
        if accepted is None:
            token = int(sample_from_probabilities(residual[None], torch.tensor(uniforms[-1:])))
            return TreeOutcome(path, [token_ids[i] for i in path] + [token])
        path.append(accepted)
        node = accepted
