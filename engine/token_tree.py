"""A token tree's shape, one definition for every part that reads it: the target's
verification attention (``engine.attention``, ``engine.cuda_graphs``), its positions
(``engine.model_runner``), the rejection rules (``engine.tree_verification``) and EAGLE-2's
drafting attention (``engine.decoders.eagle_tree``).

A tree is ``parents``: token i follows token ``parents[i]`` (-1: the tokens before the tree),
parents before children; a chain is ``[-1, 0, 1, ...]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each tree token (0: follows the tokens before the tree)."""
    out: list[int] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"tree token {i} has parent {p}: parents must come first")
        out.append(0 if p < 0 else out[p] + 1)
    return out


def longest_path(parents: Sequence[int]) -> int:
    """Tokens on the longest root-to-leaf path (0 for an empty tree)."""
    return 1 + max(depths(parents), default=-1)


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """Tree tokens from the first depth down to ``node`` (empty for the root, -1)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def ancestry(parents: Sequence[int]) -> torch.Tensor:
    """[n, n] bool: (i, j) is True when token j is token i or one of its ancestors, which is
    what token i's query may attend to among the tree's own keys."""
    n = len(parents)
    seen = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            seen[i] |= seen[p]
    return seen


def is_chain(parents: Sequence[int]) -> bool:
    """A tree whose every token follows the one before (a tree decoder's one-draft or
    single-path proposal): attention plans it as a chain (tests/test_attention.py checks
    both agree), and the chance floor cuts it as one."""
    return all(p == i - 1 for i, p in enumerate(parents))
