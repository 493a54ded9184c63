"""``hierarchical``: HSDDW's three-level drafting (hierarchical speculative decoding with
dynamic windows).

Level 1 drafts for level 2; level 2 verifies level 1's drafts with the same lossless
rejection rule the target uses (so every token of its chain is a draw from level 2's
processed distribution), and keeps extending its chain, round after round, while it is
confident: while its entropy at each new position stays at or below ``tau2``, and up to k.
The target then verifies level 2's whole chain with level 2's distributions as q. The target
verifies every emitted token, so the hierarchy is exactly as lossless as ``draft``.

Level 2 is the ``draft`` model (``decoder.draft``). Level 1 is prompt lookup (``ngram``; free,
and when it finds nothing level 2 drafts one token per pass on its own) or
``draft_truncated``: level 2's own first layers with its final norm and head, whose K/V for
those layers are exactly level 2's, so they share level 2's cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.config import DecoderConfig
from engine.decoders.base import Decoder, Proposal, TargetContext
from engine.decoders.draft import draft_kv_cache, load_draft_model
from engine.decoders.drafting import DRAFT_SEED_OFFSET, ModelDrafter, draft_statistics
from engine.decoders.ngram import find_continuation
from engine.decoders.windows import FixedWindow, build_window
from engine.model_runner import ModelRunner
from engine.models.llama import LlamaModel
from engine.rejection_sampler import DraftRun, RejectionSampler, position_row

if TYPE_CHECKING:
    from engine.sequence import Sequence

# Level 1's draft stream must differ from level 2's, whose draws verify level 1's drafts.
LEVEL1_SEED_OFFSET = DRAFT_SEED_OFFSET + 0x1F1


def first_layers(model: LlamaModel, num_layers: int) -> LlamaModel:
    """``model`` cut after ``num_layers`` layers, sharing every tensor with it."""
    if not 1 <= num_layers < len(model.layers):
        raise ValueError(
            f"hierarchical.level1_num_layers must be in [1, {len(model.layers) - 1}], "
            f"got {num_layers}"
        )
    layers = list(model.layers)[:num_layers]
    return LlamaModel(
        model.arch, model.rope, model.embed_tokens, layers, model.final_norm, model.lm_head
    )


class HierarchicalDecoder(Decoder):
    name = "hierarchical"

    def __init__(self, config: DecoderConfig, target: TargetContext):
        model, shares = load_draft_model(config, target)
        kv_cache = draft_kv_cache(model, shares, target)
        self.window = build_window(config.window)
        self.level2 = ModelDrafter(
            ModelRunner(model, kv_cache, target.device), target.eos_token_ids, self.window, shares
        )
        spec = config.hierarchical
        self.tau2 = spec.tau2
        self.level1 = None  # ngram
        if spec.level1 == "draft_truncated":
            small = first_layers(model, spec.level1_num_layers)
            # Level 1's K/V are level 2's for the same layers: it reads level 2's cache as far
            # as level 2 has read, catches up on the rest, and drafts on.
            self.level1 = ModelDrafter(
                ModelRunner(small, kv_cache, target.device),
                target.eos_token_ids,
                FixedWindow(),
                shares_target_cache=shares,
                seed_offset=LEVEL1_SEED_OFFSET,
                follows=self.level2,
            )
        self.lookup = (config.prompt_lookup_min, config.prompt_lookup_max)
        self.level2_sampler = RejectionSampler(target.eos_token_ids)
        self.level2_acceptance = [0, 0]  # level-1 drafts accepted by level 2, proposed

    def plan(self, seqs: list[Sequence], max_drafts: dict[Sequence, int]) -> dict[Sequence, int]:
        return {seq: k for seq, k in max_drafts.items() if k > 0}

    def _level1(self, seqs, chains, room) -> dict[Sequence, Proposal]:
        """Level 1's drafts continuing each chain, at most ``room[seq]`` tokens."""
        wanting = [s for s in seqs if room[s] > 0]
        if self.level1 is not None:
            return self.level1.draft(wanting, room, prefixes=chains)
        low, high = self.lookup
        found = {s: find_continuation(s.token_ids + chains[s], low, high, room[s]) for s in wanting}
        return {s: Proposal(d) for s, d in found.items() if d}

    def propose(self, seqs: list[Sequence], num_drafts: dict[Sequence, int]) -> dict:
        level2 = self.level2
        for s in seqs:
            level2.begin_round(s)
        chains = {s: [] for s in seqs}
        q_rows = {s: [] for s in seqs}
        stats = {s: ([], []) for s in seqs}
        active = [s for s in seqs if num_drafts[s] > 0]
        while active:
            # Level 1 drafts so that level 2's answer (its accepted drafts and one token of its
            # own) still fits in the window.
            room = {s: num_drafts[s] - len(chains[s]) - 1 for s in active}
            level1 = self._level1(active, chains, room)
            candidates = {s: level1[s].token_ids if s in level1 else [] for s in active}
            logits = level2.forward(
                active,
                {s: chains[s] + candidates[s] for s in active},
                {s: len(candidates[s]) + 1 for s in active},
            )
            runs, rows = [], []
            for s in active:
                row = position_row(
                    s.sampling_params, s.prompt_token_ids, s.output_token_ids, chains[s]
                )
                proposal = level1.get(s)
                q = proposal.draft_probs if proposal is not None else None
                runs.append(DraftRun(row, candidates[s], q, level2.generator(s)))
                drafts = candidates[s]
                rows += [
                    position_row(
                        s.sampling_params,
                        s.prompt_token_ids,
                        s.output_token_ids,
                        chains[s] + drafts[:j],
                    )
                    for j in range(len(drafts) + 1)
                ]
            verified = self.level2_sampler(logits, runs)
            dists, _ = level2.distributions(logits, rows)
            tops, ents = draft_statistics(dists)
            still, offset = [], 0
            for s, run, v in zip(active, runs, verified, strict=True):
                self.level2_acceptance[0] += v.num_accepted
                self.level2_acceptance[1] += len(run.draft_token_ids)
                confident = True
                for j, token in enumerate(v.tokens):
                    chains[s].append(token.token_id)
                    if not s.sampling_params.greedy:
                        q_rows[s].append(dists[offset + j])
                    stats[s][0].append(tops[offset + j])
                    stats[s][1].append(ents[offset + j])
                    if (
                        ents[offset + j] > self.tau2
                        or level2.ends_sequence(s, token.token_id)
                        or not self.window.keep_drafting(tops[offset + j], ents[offset + j])
                    ):
                        confident = False
                        break
                offset += len(run.draft_token_ids) + 1
                # Level 2 read the chain up to the last token it accepted from level 1.
                level2.rewind(s, s.cache_state().num_cached + len(chains[s]))
                if confident and len(chains[s]) < num_drafts[s]:
                    still.append(s)
            active = still
        return {
            s: Proposal.drawn(chains[s], q_rows[s], stats[s][0], stats[s][1])
            for s in seqs
            if chains[s]
        }

    def on_verified(self, seq: Sequence, proposal: Proposal, num_accepted: int) -> None:
        self.level2.on_verified(seq, proposal, num_accepted)


def build_hierarchical_decoder(config: DecoderConfig, target: TargetContext) -> HierarchicalDecoder:
    """The registered builder (engine/decoder_registry.py)."""
    return HierarchicalDecoder(config, target)
