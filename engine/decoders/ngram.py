"""Prompt lookup (n-gram) drafting: propose what followed the latest earlier occurrence of the
sequence's last n tokens, for n from ``prompt_lookup_max`` down to ``prompt_lookup_min``.

It costs no model call, so it pays whenever the output copies from its input (summaries,
rewrites, code edits) and costs one wider verification pass when it does not. Drafts are
deterministic: the rejection sampler treats them as a one-hot q, which keeps sampling exact.

With ``candidates`` > 1 the suffix's other occurrences count too: what followed each of up to
that many matches is merged into a token tree, and the k draft slots go to the tree's most
travelled nodes, so a suffix that was followed by different words in different places proposes
several of them in one verification pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.decoders.base import Decoder, Proposal

if TYPE_CHECKING:  # engine.sequence imports engine.decoders.base
    from engine.sequence import Sequence


def find_continuation(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The up-to-``k`` tokens after the latest earlier match of the longest suffix n-gram."""
    found = find_continuations(tokens, min_n, max_n, k, 1)
    return found[0] if found else []


def find_continuations(
    tokens: list[int], min_n: int, max_n: int, k: int, matches: int
) -> list[list[int]]:
    """What followed each of the first ``matches`` earlier occurrences of a suffix n-gram
    (up to ``k`` tokens each), longest n first and the latest match first within an n: recent
    context predicts the continuation best."""
    length, found = len(tokens), []
    for n in range(min(max_n, length - 1), max(min_n, 1) - 1, -1):  # an empty n-gram says nothing
        pattern = tokens[length - n :]
        for start in reversed(_positions_of(tokens, pattern[0], length - n)):
            if tokens[start : start + n] == pattern:
                found.append(tokens[start + n : start + n + k])  # never empty: start + n < length
                if len(found) == matches:
                    return found
    return found


def _positions_of(tokens: list[int], token: int, end: int) -> list[int]:
    """Where ``token`` occurs in ``tokens[:end]``, ascending. ``list.index`` scans in C, so
    only the occurrences cost Python steps: comparing an n-gram at every position of the
    context cost 0.7 ms a step at 2,000 tokens and 2.7 ms at 8,000 (the grounded prompts that
    lookup is for)."""
    found, i = [], -1
    try:
        while True:
            i = tokens.index(token, i + 1, end)
            found.append(i)
    except ValueError:
        return found


def merge_into_tree(continuations: list[list[int]], budget: int) -> tuple[list[int], list[int]]:
    """The ``budget`` most travelled nodes of the continuations' trie, as (tokens, parents) with
    parents first and siblings most travelled first. Ties go to the earlier continuation, then
    the shallower node: with no repeats the tree is the first continuation's chain."""
    nodes: dict[tuple[int, ...], list[int]] = {}  # path -> [times travelled, first continuation]
    for rank, follow in enumerate(continuations):
        for depth in range(1, len(follow) + 1):
            nodes.setdefault(tuple(follow[:depth]), [0, rank])[0] += 1
    # A child is travelled at most as often as its parent, first by no earlier continuation and
    # is deeper, so this order puts every parent before its children.
    chosen = sorted(nodes, key=lambda path: (-nodes[path][0], nodes[path][1], len(path)))[:budget]
    chosen.sort(key=lambda path: (len(path), -nodes[path][0], nodes[path][1]))
    index = {path: i for i, path in enumerate(chosen)}
    return [path[-1] for path in chosen], [index.get(path[:-1], -1) for path in chosen]


class NgramDecoder(Decoder):
    name = "ngram"

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, candidates: int = 1):
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.candidates = candidates  # matches merged into a tree; 1: the latest match's chain
        # Found while planning, handed out (cut to the granted slots) when proposing.
        self._found: dict[Sequence, Proposal] = {}

    def _lookup(self, tokens: list[int], k: int) -> Proposal | None:
        if self.candidates == 1:
            drafts, parents = find_continuation(tokens, self.min_n, self.max_n, k), None
        else:
            found = find_continuations(tokens, self.min_n, self.max_n, k, self.candidates)
            drafts, parents = merge_into_tree(found, k)
            if parents == list(range(-1, len(parents) - 1)):
                parents = None  # every match agreed: a chain
        if not drafts:
            return None
        return Proposal(drafts, None, [1.0] * len(drafts), [0.0] * len(drafts), parents)

    def plan(self, seqs: list[Sequence], max_drafts: dict[Sequence, int]) -> dict[Sequence, int]:
        self._found = {}
        for seq in seqs:
            k = max_drafts[seq]  # the request's k (or ours), cut to what it can still use
            proposal = self._lookup(seq.token_ids, k) if k > 0 else None
            if proposal is not None:
                self._found[seq] = proposal
        return {seq: len(p.token_ids) for seq, p in self._found.items()}

    def propose(self, seqs: list[Sequence], num_drafts: dict[Sequence, int]) -> dict:
        found, self._found = self._found, {}
        return {seq: found[seq].truncated(num_drafts[seq]) for seq in seqs if seq in found}


def build_ngram_decoder(config, target) -> NgramDecoder:
    """The registered builder (engine/decoder_registry.py): prompt lookup needs no model."""
    return NgramDecoder(
        config.prompt_lookup_min, config.prompt_lookup_max, config.prompt_lookup_candidates
    )
