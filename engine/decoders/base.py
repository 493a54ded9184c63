"""The decoder interface: what a speculative decoder proposes, and what it hears back.

A decoder only drafts. A step goes: ``plan`` says how many drafts each decoding sequence
wants; the scheduler grants lookahead slots for them from what the step leaves over;
``propose`` drafts at most the granted number (a model drafter runs its model now, writing
its K/V into the granted slots); the model runner verifies every sequence's drafts in the
step's one forward pass, the rejection sampler accepts per sequence, the engine rolls the KV
cache back past rejected drafts, and ``on_verified`` tells the decoder how many it accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.sequence import Sequence


@dataclass
class Proposal:
    """Draft tokens for one sequence: a chain continuing its tokens, or a token tree."""

    token_ids: list[int]
    # The drafter's distributions q after the target's processing, [k, vocab]; None for a
    # deterministic drafter (q is one-hot at each draft token) and for greedy requests. In a
    # tree, row i is the q that draft i was drawn from, independently of its earlier siblings.
    draft_probs: torch.Tensor | None = None
    # Per draft token, how sure the drafter was: its top-1 probability and its entropy (nats).
    # A deterministic drafter is sure (1.0, 0.0); window policies read these.
    confidences: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    # A token tree: draft i follows draft parents[i] (-1: the sequence's last token); parents
    # come before their children, siblings in order of preference. None: a chain.
    parents: list[int] | None = None

    def truncated(self, count: int) -> Proposal:
        """The first ``count`` drafts (still a tree: parents come first)."""
        if count >= len(self.token_ids):
            return self
        return Proposal(
            self.token_ids[:count],
            self.draft_probs[:count] if self.draft_probs is not None else None,
            self.confidences[:count],
            self.entropies[:count],
            self.parents[:count] if self.parents is not None else None,
        )

    @classmethod
    def drawn(cls, token_ids, q_rows, confidences, entropies) -> Proposal:
        """A model drafter's chain: ``q_rows`` holds one q per token (sampled requests) or
        is empty (greedy requests, whose q the rejection sampler does not read)."""
        return cls(token_ids, torch.stack(q_rows) if q_rows else None, confidences, entropies)


class Decoder:
    """Plain autoregressive decoding: no drafts. Drafting decoders override the hooks."""

    name = "autoregressive"
    # Drafters on the target's features (Medusa heads, EAGLE) set this: each step then also
    # returns the target's last-layer hidden states, and ``observe_target_features`` gets
    # each sequence's.
    reads_target_hidden = False

    def feature_layers(self, num_layers: int) -> tuple[int, ...]:
        """The target layers (0-based, of ``num_layers``) whose outputs
        ``observe_target_features`` gets, side by side in this order: the last by default."""
        return (num_layers - 1,)

    def plan(self, seqs: list[Sequence], max_drafts: dict[Sequence, int]) -> dict[Sequence, int]:
        """How many draft slots each of ``seqs`` (each in decode state: one uncomputed token)
        asks for, at most ``max_drafts[seq]`` (the request's or the configured k, cut to the
        room left). Sequences left out just decode."""
        return {}

    def propose(self, seqs: list[Sequence], num_drafts: dict[Sequence, int]) -> dict:
        """Drafts for ``seqs``, at most ``num_drafts[seq]`` each (the slots the scheduler
        granted; at least 1). Returns ``{seq: Proposal}``; a sequence may be left out."""
        return {}

    def draft_source(self, seq: Sequence) -> str:
        """Which of the decoder's drafters drafts for ``seq`` this step (read after ``plan``):
        the goodput policy learns each source's acceptance and cost apart and picks each its
        own draft length. A decoder with one drafter is its only source."""
        return self.name

    def on_verified(self, seq: Sequence, proposal: Proposal, num_accepted: int) -> None:
        """The target accepted the first ``num_accepted`` drafts of ``proposal``."""

    def tokens_behind(self, seq: Sequence) -> int:
        """Tokens of ``seq`` its drafter has yet to read before drafting (a model drafter
        catches up on what it did not see: the whole prompt on its first draft, every token
        of a stretch it sat out). 0 for drafters that read nothing (prompt lookup)."""
        return 0

    def observe_target_features(
        self, seq: Sequence, first_position: int, features: torch.Tensor
    ) -> None:
        """The target's hidden states (before the final norm), [m, d] a layer of
        ``feature_layers``, of the tokens
        at positions ``first_position`` .. + m - 1 that this step computed and that stand (a
        prefill chunk; a decode token and its accepted drafts). The last row of a step that
        gave ``seq`` tokens is the position whose logits gave its newest token. Called after
        every step that computed tokens of ``seq``, when ``reads_target_hidden``."""


@dataclass
class TargetContext:
    """What a decoder may build its drafter from: the target model, its KV cache (self drafts
    share it) and the cache geometry (a separate draft model mirrors it)."""

    model: object  # engine.models.llama.LlamaModel
    kv_cache: object  # engine.kv_cache.KVCache
    device: str
    eos_token_ids: frozenset[int]
    max_model_len: int  # the longest sequence a draft model must take positions for
