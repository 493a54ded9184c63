"""The decoder interface: what a speculative decoder proposes, and what it hears back.

A decoder only drafts. The model runner verifies every sequence's drafts in the step's one
forward pass, the rejection sampler accepts per sequence, and the engine rolls the KV cache
back past rejected drafts; the decoder is then told how many of its drafts were accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # engine.sequence imports SpeculativeOptions from here
    from engine.sequence import Sequence


@dataclass(frozen=True)
class SpeculativeOptions:
    """A request's choice among the decoders the engine has loaded (the server's
    ``"speculative": {"method": ..., "num_speculative_tokens": ...}``)."""

    method: str
    num_speculative_tokens: int | None = None  # None: the decoder's configured k

    def __post_init__(self):
        k = self.num_speculative_tokens
        if k is not None and not (isinstance(k, int) and 1 <= k <= 16):
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {k!r}")


@dataclass
class Proposal:
    """Draft tokens for one sequence: a chain continuing its tokens."""

    token_ids: list[int]
    # The drafter's distributions q after the target's processing, [k, vocab]; None for a
    # deterministic drafter (q is one-hot at each draft token).
    draft_probs: torch.Tensor | None = None


class Decoder:
    """Plain autoregressive decoding: no drafts. Drafting decoders override ``propose``."""

    name = "autoregressive"

    def propose(self, seqs: list[Sequence], max_drafts: dict[Sequence, int]) -> dict:
        """Drafts for some of ``seqs`` (each in decode state: one uncomputed token), at most
        ``max_drafts[seq]`` tokens each (the request's or the configured k, cut to the room
        left); sequences without a proposal just decode."""
        return {}

    def on_verified(self, seq: Sequence, proposal: Proposal, num_accepted: int) -> None:
        """The target accepted the first ``num_accepted`` drafts of ``proposal``."""
