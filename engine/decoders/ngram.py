"""Prompt lookup (n-gram) drafting: propose what followed the latest earlier occurrence of the
sequence's last n tokens, for n from ``prompt_lookup_max`` down to ``prompt_lookup_min``.

It costs no model call, so it pays whenever the output copies from its input (summaries,
rewrites, code edits) and costs one wider verification pass when it does not. Drafts are
deterministic: the rejection sampler treats them as a one-hot q, which keeps sampling exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.decoders.base import Decoder, Proposal

if TYPE_CHECKING:  # engine.sequence imports engine.decoders.base
    from engine.sequence import Sequence


def find_continuation(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The up-to-``k`` tokens after the latest earlier match of the longest suffix n-gram."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = tokens[length - n :]
        # Latest match first: recent context predicts the continuation best.
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == pattern:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []


class NgramDecoder(Decoder):
    name = "ngram"

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        # Found while planning, handed out (cut to the granted slots) when proposing.
        self._found: dict[Sequence, list[int]] = {}

    def plan(self, seqs: list[Sequence], max_drafts: dict[Sequence, int]) -> dict[Sequence, int]:
        self._found = {}
        for seq in seqs:
            k = max_drafts[seq]  # the request's k (or ours), cut to what it can still use
            drafts = find_continuation(seq.token_ids, self.min_n, self.max_n, k) if k > 0 else []
            if drafts:
                self._found[seq] = drafts
        return {seq: len(drafts) for seq, drafts in self._found.items()}

    def propose(self, seqs: list[Sequence], num_drafts: dict[Sequence, int]) -> dict:
        found, self._found = self._found, {}
        proposals = {}
        for seq in seqs:
            drafts = found.get(seq, [])[: num_drafts[seq]]
            if drafts:
                proposals[seq] = Proposal(drafts, None, [1.0] * len(drafts), [0.0] * len(drafts))
        return proposals
