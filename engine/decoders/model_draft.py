"""A decoder whose drafts come from a model (``ModelDrafter``): the common shape of ``draft``
and ``layerskip``, which differ only in the model they draft with."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.decoders.base import Decoder, Proposal
from engine.decoders.drafting import ModelDrafter

if TYPE_CHECKING:
    from engine.sequence import Sequence


class ModelDraftDecoder(Decoder):
    def __init__(self, name: str, drafter: ModelDrafter):
        self.name = name
        self.drafter = drafter

    def plan(self, seqs: list[Sequence], max_drafts: dict[Sequence, int]) -> dict[Sequence, int]:
        # Ask for the whole window: how far to draft is only known while drafting.
        return {seq: k for seq, k in max_drafts.items() if k > 0}

    def propose(self, seqs: list[Sequence], num_drafts: dict[Sequence, int]) -> dict:
        return self.drafter.draft(seqs, num_drafts)

    def on_verified(self, seq: Sequence, proposal: Proposal, num_accepted: int) -> None:
        self.drafter.on_verified(seq, proposal, num_accepted)

    def tokens_behind(self, seq: Sequence) -> int:
        return self.drafter.tokens_behind(seq)
