"""``hybrid``: prompt lookup where the text repeats itself, a trained drafter everywhere else
(the combination Arctic Inference offers: Suffix Decoding with its trained speculators).

The two win in different places. Prompt lookup drafts for free and its long matches are
accepted whole when an answer copies its input (grounded answers, code edits), but it has
nothing to say, or a weak two-token guess, in free text; a trained drafter guesses one or two
tokens well anywhere, at a drafting cost, and gains little where lookup wins big. Each step,
per sequence: a match of at least ``hybrid.lookup_min`` tokens drafts its continuation, and
otherwise the trained drafter (``hybrid.drafter``, a registered trained decoder built from
its own config section) drafts.

The two are told apart as the sequence's draft *source*: the goodput policy learns each
source's acceptance and drafting cost on its own and picks each its own draft length, and a
proposal's verification reaches the source that made it. The trained drafter still sees
every step's target features (the hybrid forwards them), so it drafts the step after a
lookup run without catching up beyond what a drafter that sat a step out must.

Both sources' drafts are exact under the verifier (one-hot drafts, or the drafter's q):
lossless like each alone.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from engine.decoder_registry import decoder_spec
from engine.decoders.base import Decoder, Proposal, TargetContext
from engine.decoders.ngram import NgramDecoder

if TYPE_CHECKING:
    from engine.config import DecoderConfig
    from engine.sequence import Sequence

LOOKUP = "lookup"


class HybridDecoder(Decoder):
    name = "hybrid"

    def __init__(self, lookup: NgramDecoder, drafter: Decoder, drafter_max_tokens: int | None):
        self.lookup = lookup
        self.drafter = drafter
        self.drafter_max_tokens = drafter_max_tokens
        self.reads_target_hidden = drafter.reads_target_hidden
        # Which source drafts for each sequence this step (set by ``plan``; weak, so a
        # sequence that finished is not held until the next plan).
        self._source: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @property
    def sources(self) -> tuple[str, str]:
        return (f"{self.name}:{LOOKUP}", f"{self.name}:{self.drafter.name}")

    def draft_source(self, seq: Sequence) -> str:
        return self._source.get(seq, self.sources[1])

    def feature_layers(self, num_layers: int) -> tuple[int, ...]:
        return self.drafter.feature_layers(num_layers)

    def plan(self, seqs: list[Sequence], max_drafts: dict[Sequence, int]) -> dict[Sequence, int]:
        looked_up = self.lookup.plan(seqs, max_drafts)
        rest = [s for s in seqs if s not in looked_up]
        most = self.drafter_max_tokens
        caps = {s: max_drafts[s] if most is None else min(max_drafts[s], most) for s in rest}
        drafted = self.drafter.plan(rest, caps) if rest else {}
        lookup_source, drafter_source = self.sources
        self._source = weakref.WeakKeyDictionary({s: lookup_source for s in looked_up})
        self._source.update({s: drafter_source for s in drafted})
        return {**looked_up, **drafted}

    def _looked_up(self, seq: Sequence) -> bool:
        """Whether prompt lookup drafts for ``seq`` this step."""
        return self._source.get(seq) == self.sources[0]

    def propose(self, seqs: list[Sequence], num_drafts: dict[Sequence, int]) -> dict:
        looked_up = [s for s in seqs if self._looked_up(s)]
        drafted = [s for s in seqs if not self._looked_up(s)]
        proposals = self.lookup.propose(looked_up, num_drafts) if looked_up else {}
        if drafted:
            proposals.update(self.drafter.propose(drafted, num_drafts))
        return proposals

    def on_verified(self, seq: Sequence, proposal: Proposal, num_accepted: int) -> None:
        if not self._looked_up(seq):
            self.drafter.on_verified(seq, proposal, num_accepted)

    def tokens_behind(self, seq: Sequence) -> int:
        return 0 if self._looked_up(seq) else self.drafter.tokens_behind(seq)

    def observe_target_features(
        self, seq: Sequence, first_position: int, features: torch.Tensor
    ) -> None:
        self.drafter.observe_target_features(seq, first_position, features)


def build_hybrid_decoder(config: DecoderConfig, target: TargetContext) -> HybridDecoder:
    """The registered builder (engine/decoder_registry.py): the trained drafter is built by
    its own registered builder from its own section (``decoder.hydra``, ...)."""
    hybrid = config.section("hybrid")
    longest = max(config.prompt_lookup_max, hybrid.lookup_min)
    lookup = NgramDecoder(hybrid.lookup_min, longest, config.prompt_lookup_candidates)
    drafter = decoder_spec(hybrid.drafter).builder()(config, target)
    drafter.name = hybrid.drafter
    return HybridDecoder(lookup, drafter, hybrid.drafter_max_tokens)
