"""Drafting with a model: k cheap autoregressive steps for every drafting sequence at once.

Used by every model-based decoder (a separate draft model, self drafts, layer skipping, the
levels of the hierarchy). Each step runs the draft model once over all sequences still
drafting (a flattened batch, like the target's step), processes its logits with each request's
own sampling parameters and the drafts so far as hypothetical history (so q is processed
exactly as the target's p will be), and draws the next draft token from q: the argmax for
greedy requests, a draw from the sequence's own draft generator otherwise.

**Where the draft's K/V live.** The draft writes K/V for the tokens it reads at their
positions, through the sequence's block table:

- a *shared* cache (self drafts: same layer shapes as the target) is the target's own: the
  draft reads the target's exact K/V for the verified context and writes approximate K/V into
  the lookahead slots the scheduler granted, which the verification pass then overwrites;
- an *own* cache (a separate draft model) has the draft's own tensors over the same block ids,
  so the target's block allocation, rollback and freeing apply to it unchanged. The draft
  catches up lazily on tokens it has not read (a new or preempted sequence reads its whole
  prefix once; after a verification, the tokens after the accepted drafts).
"""

from __future__ import annotations

import weakref
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.decoders.base import Proposal
from engine.kernels.build import load_kernels
from engine.model_runner import ForwardItem, ModelRunner
from engine.rejection_sampler import position_row
from engine.sampling import (
    make_generator,
    needs_processing,
    probabilities,
    process_logits,
    sample_from_probabilities,
)

if TYPE_CHECKING:  # for annotations only
    from engine.sequence import Sequence

# Offsets a seeded request's draft generator from its sampling generator: the draft's draws
# must be independent of the acceptance draws.
DRAFT_SEED_OFFSET = 0x5D2A_F7

__all__ = ["DRAFT_SEED_OFFSET", "ModelDrafter", "draft_statistics", "softmax_with_statistics"]


@dataclass
class _DraftState:
    num_cached: int  # leading tokens whose draft K/V are valid (own cache)
    cache_epoch: int  # the sequence's cache epoch when num_cached was set
    generator: torch.Generator
    start: int = 0  # position of the first token read in the current drafting round
    # Drafters that record the blocks they wrote (engine/decoders/written_blocks.py): the
    # first position whose block is not recorded yet.
    unrecorded_from: int = 0


def softmax_with_statistics(
    scores: torch.Tensor,
) -> tuple[torch.Tensor, list[float], list[float]]:
    """Softmax of each row of ``scores`` ([R, V] unprocessed draft scores) with its top-1
    probability and entropy: one C++ pass per row on the CPU in float32 (the separate ops
    cost more than the readout that made the scores), PyTorch elsewhere."""
    if scores.device.type == "cpu" and scores.dtype == torch.float32 and load_kernels():
        dists, top, entropy = torch.ops.specserve.softmax_statistics(scores)
        return dists, top.tolist(), entropy.tolist()
    dists = torch.softmax(scores, dim=-1)
    return (dists, *draft_statistics(dists))


def draft_statistics(distributions: torch.Tensor) -> tuple[list[float], list[float]]:
    """Top-1 probability and entropy (nats) of each row of ``distributions`` ([R, V])."""
    probs = distributions.float()
    top = probs.max(dim=-1).values
    # entr(p) = -p ln p with entr(0) = 0: log of the zeros (a drafter's tokens outside its
    # vocabulary, truncated tails) takes a slow path, ten times a dense row's log.
    entropy = torch.special.entr(probs).sum(dim=-1)
    return top.tolist(), entropy.clamp_min(0).tolist()


class ModelDrafter:
    """Drafts chains with ``runner``'s model; see the module docstring for the cache modes."""

    # Drafters that can only propose a draft vocabulary (the trained ones: a readout of a few
    # thousand LM-head rows) declare it with ``set_draft_vocabulary`` and return scores over
    # just those columns from ``forward(..., compact=True)``. Where no row's logits need
    # processing (greedy or plain sampling, no penalties, bias, filters or constraints: the
    # usual request) a draft step then never touches a whole-vocabulary row, which at batch 1
    # cost more than the drafter's products. The other columns are -inf, so they add nothing
    # to a softmax, its entropy or its top: greedy drafts are the same tokens (ascending ids
    # keep an argmax's first-of-equals choice), and a sampled draft is drawn from the same q,
    # its probabilities equal up to float rounding (sums over a shorter row).
    draft_vocab: torch.Tensor | None = None
    vocab_size: int = 0

    def set_draft_vocabulary(self, token_ids: torch.Tensor, vocab_size: int) -> None:
        """The only tokens this drafter can propose (any order; kept ascending), out of a
        vocabulary of ``vocab_size``."""
        if len(token_ids) == 0 or int(token_ids.max()) >= vocab_size or int(token_ids.min()) < 0:
            raise ValueError(f"a draft vocabulary must be ids in [0, {vocab_size})")
        self.draft_vocab, self.vocab_size = token_ids.sort().values, vocab_size

    def __init__(
        self,
        runner: ModelRunner,
        eos_token_ids: Collection[int],
        window,
        shares_target_cache: bool,
        model_options: dict | None = None,
        seed_offset: int = DRAFT_SEED_OFFSET,
        follows: ModelDrafter | None = None,
    ):
        self.runner = runner
        self.eos_token_ids = frozenset(eos_token_ids)
        self.window = window
        self.shares_target_cache = shares_target_cache
        self.model_options = model_options or {}
        # Two drafters over one sequence (the levels of `hierarchical`) need different offsets:
        # a draw must never be reused by whoever verifies it.
        self.seed_offset = seed_offset
        # A drafter over another drafter's cache (hierarchical's level 1 over level 2's): its
        # K/V are valid exactly as far as that drafter has read.
        self.follows = follows
        self._states: weakref.WeakKeyDictionary[Sequence, _DraftState] = weakref.WeakKeyDictionary()

    def _state(self, seq: Sequence) -> _DraftState:
        cache = seq.cache_state()
        state = self._states.get(seq)
        if state is None:
            state = _DraftState(0, cache.epoch, self._new_generator(seq))
            self._states[seq] = state
        elif state.cache_epoch != cache.epoch:
            # Preempted since: its blocks were freed, so nothing of it is cached. The draft
            # stream goes on: restarting it would reuse draws that already shaped the output.
            state.num_cached, state.cache_epoch, state.unrecorded_from = 0, cache.epoch, 0
        if self.follows is not None:
            leader = self.follows._states.get(seq)
            state.num_cached = leader.num_cached if leader is not None else 0
        elif self.shares_target_cache:
            state.num_cached = cache.num_cached  # the target's cache is authoritative
        state.num_cached = min(state.num_cached, cache.num_cached)
        return state

    def tokens_behind(self, seq: Sequence) -> int:
        """Tokens of ``seq`` whose draft K/V this drafter has not computed (see
        ``Decoder.tokens_behind``); read-only, unlike ``_state``."""
        state = self._states.get(seq)
        cached = 0 if state is None else min(state.num_cached, seq.cache_state().num_cached)
        if self.shares_target_cache:
            cached = seq.cache_state().num_cached
        return max(0, seq.num_tokens - cached)

    def _new_generator(self, seq: Sequence) -> torch.Generator:
        """A draft stream of the sequence's own, independent of its sampling stream and of
        every other drafter's: seeded from the sequence's seed (each of a request's n
        continuations has its own) when the request has a seed, fresh otherwise."""
        if seq.sampling_params.seed is None or seq.generator is None:
            return make_generator(None)
        return make_generator(seq.generator.initial_seed() + self.seed_offset)

    def ends_sequence(self, seq: Sequence, token: int) -> bool:
        """A draft token that would end the sequence: nothing after it can be emitted."""
        params = seq.sampling_params
        return token in params.stop_token_ids or (
            not params.ignore_eos and token in self.eos_token_ids
        )

    def begin_round(self, seq: Sequence) -> None:
        """Start drafting for ``seq`` at its decode token."""
        self._state(seq).start = seq.cache_state().num_cached

    def generator(self, seq: Sequence) -> torch.Generator:
        return self._state_of(seq).generator

    def _state_of(self, seq: Sequence) -> _DraftState:
        return self._states.get(seq) or self._state(seq)

    def forward(
        self,
        seqs: list[Sequence],
        chains: dict[Sequence, list[int]],
        num_logits: dict[Sequence, int],
        compact: bool = False,
    ) -> torch.Tensor:
        """Run the draft model over each sequence's tokens followed by ``chains[seq]``, from
        the first position it has no K/V for; returns the raw logits of the last
        ``num_logits[seq]`` positions of each, sequence after sequence (with ``compact``,
        over the draft vocabulary's columns: the runner must support it)."""
        items = self.read_items(seqs, chains, num_logits)
        options = {**self.model_options, "compact": True} if compact else self.model_options
        return self.runner.run(items, **options)

    def read_items(
        self, seqs: list[Sequence], chains: dict[Sequence, list[int]], num_logits
    ) -> list[ForwardItem]:
        """The draft model's forward items for ``forward``: each sequence's tokens from its
        first one without draft K/V, which they then count as read."""
        items = []
        for s in seqs:
            state = self._states[s]
            tokens = (s.token_ids + chains[s])[state.num_cached :]
            blocks = s.cache_state().block_table
            items.append(ForwardItem(tokens, state.num_cached, blocks, num_logits[s]))
            state.num_cached += len(tokens)
        return items

    def rewind(self, seq: Sequence, num_valid: int) -> None:
        """Only the first ``num_valid`` tokens of ``seq`` (with its chain) are what the draft
        read: the K/V past them are of tokens that were replaced."""
        state = self._states[seq]
        state.num_cached = min(state.num_cached, num_valid)

    def distributions(self, logits: torch.Tensor, rows) -> tuple[torch.Tensor, torch.Tensor]:
        """(distributions, processed logits) of draft logits for ``rows``: q for sampled rows;
        for greedy rows, whose processed distribution is a point mass, the raw softmax (what
        the window policies judge confidence by)."""
        processed = process_logits(logits, rows, self.eos_token_ids)
        greedy = [row.sampling_params.greedy for row in rows]
        if processed is logits and all(greedy):
            return torch.softmax(logits, dim=-1), processed  # nothing processed: one softmax
        dists = probabilities(processed)
        if any(greedy):
            raw = torch.softmax(logits, dim=-1)
            mask = torch.tensor(greedy, device=dists.device).unsqueeze(-1)
            dists = torch.where(mask, raw, dists)
        return dists, processed

    def draft(
        self, seqs: list[Sequence], num_drafts: dict[Sequence, int], prefixes=None
    ) -> dict[Sequence, Proposal]:
        """Draft up to ``num_drafts[seq]`` tokens for each sequence, stopping a sequence early
        when the window policy says so. ``prefixes[seq]`` (optional) are tokens already
        drafted for it, read as context before drafting more (and not returned)."""
        prefixes = prefixes or {}
        active = [s for s in seqs if num_drafts.get(s, 0) > 0]
        for s in active:
            self.begin_round(s)
        chains = {s: list(prefixes.get(s, [])) for s in active}
        drafts: dict[Sequence, list[int]] = {s: [] for s in active}
        q_rows: dict[Sequence, list[torch.Tensor]] = {s: [] for s in active}
        confidences: dict[Sequence, list[float]] = {s: [] for s in active}
        entropies: dict[Sequence, list[float]] = {s: [] for s in active}
        while active:
            rows = [
                position_row(s.sampling_params, s.prompt_token_ids, s.output_token_ids, chains[s])
                for s in active
            ]
            ones = {s: 1 for s in active}
            compact = self.draft_vocab is not None and not any(map(needs_processing, rows))
            if compact:
                processed = self.forward(active, chains, ones, compact=True)
                # Unprocessed: q of a sampled row and the raw softmax of a greedy one agree.
                dists, tops, ents = softmax_with_statistics(processed)
            else:
                dists, processed = self.distributions(self.forward(active, chains, ones), rows)
                tops, ents = draft_statistics(dists)
            # max's indices: argmax's (the first of equal maxima) at a third of its time here.
            picks = processed.max(dim=-1).indices
            greedy = [s.sampling_params.greedy for s in active]
            sampled = [i for i, g in enumerate(greedy) if not g]
            if sampled:
                uniforms = torch.cat(
                    [
                        torch.rand(1, generator=self.generator(active[i]), dtype=torch.float64)
                        for i in sampled
                    ]
                )
                picks[sampled] = sample_from_probabilities(dists[sampled], uniforms)
            tokens = (self.draft_vocab[picks] if compact else picks).tolist()
            still = []
            for i, s in enumerate(active):
                token = tokens[i]
                drafts[s].append(token)
                chains[s].append(token)
                if not greedy[i]:
                    q_rows[s].append(self._whole_vocabulary(dists[i]) if compact else dists[i])
                confidences[s].append(tops[i])
                entropies[s].append(ents[i])
                if (
                    len(drafts[s]) < num_drafts[s]
                    and not self.ends_sequence(s, token)
                    and self.window.keep_drafting(tops[i], ents[i])
                ):
                    still.append(s)
            active = still
        return {
            s: Proposal.drawn(drafts[s], q_rows[s], confidences[s], entropies[s]) for s in drafts
        }

    def _whole_vocabulary(self, dist: torch.Tensor) -> torch.Tensor:
        """A draft-vocabulary distribution as a row over every token (the verifier's q)."""
        full = dist.new_zeros(self.vocab_size)
        full[self.draft_vocab] = dist
        return full

    def on_verified(self, seq: Sequence, proposal: Proposal, num_accepted: int) -> None:
        """Keep the draft K/V of the tokens that stood: the decode token and the accepted
        drafts (the draft read all drafts but the last)."""
        self.window.on_verified(proposal, num_accepted)
        state = self._states.get(seq)
        if state is not None and not self.shares_target_cache:
            state.num_cached = min(state.num_cached, state.start + 1 + num_accepted)
