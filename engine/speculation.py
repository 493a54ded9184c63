"""One speculative step: ask the decoder for drafts, verify them in the step's forward pass,
accept per sequence with the rejection sampler, roll the KV cache back past what was rejected.

Every sequence of the batch goes through the same pass: a sequence with drafts contributes its
decode token plus k draft tokens and gets k + 1 rows of logits; one without drafts (or in
prefill) is an ordinary row. Acceptance is counted per draft position (per depth in a tree), as
vLLM reports it.

A tree's drafts sit in the sequence's slots in proposal order, each at the position of its
depth; after verification the accepted path's K/V are copied down into the consecutive slots
after the decode token, so the cache holds the path as if it had been a chain.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.attention import slots_for_positions
from engine.decoders import Decoder, Proposal
from engine.decoders.gate import TargetConfidenceGate
from engine.draft_policy import GoodputPolicy
from engine.kv_cache import BlockManager, KVCache
from engine.model_runner import ForwardItem
from engine.provenance import sources_of_run
from engine.rejection_sampler import DraftRun, RejectionSampler
from engine.sampling import SampledToken
from engine.scheduler import ScheduledSequence
from engine.sequence import Sequence
from engine.target_features import HELD_STEP_ROWS
from engine.token_tree import is_chain

# Tokens a drafter may be behind beyond the drafts it is asked for (the accepted ones and the
# bonus token of the last step) while its drafting time still counts as a step's.
CATCH_UP_SLACK = 2
# A gap between two steps' starts that exceeds the step by more than this share of it is
# idle time (no request to run), not the loop's overhead.
IDLE_GAP_RATIO = 1.0


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # sequences that had drafts verified
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position += [0] * (num_drafts - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over proposed draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verified draft run: accepted drafts plus the one sampled token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass
class Verification:
    """What one verification found: each completing sequence's new tokens, how many of each
    drafting sequence's drafts stood, and the new tokens' sources (engine.provenance) for the
    sequences that asked for them."""

    emitted: list[tuple[Sequence, list[SampledToken]]]
    accepted: dict[Sequence, int]
    sources: dict[Sequence, list]


class Speculator:
    """Runs the loaded drafting decoders for the sequences that use them, and verifies.

    Each sequence drafts with the decoder its request picked (``speculative.method``), or the
    engine's default; "autoregressive" sequences ride along as plain decode rows.
    """

    def __init__(
        self,
        decoders: dict[str, Decoder],
        default_method: str,
        num_speculative_tokens: int,
        block_manager: BlockManager,
        eos_token_ids,
        max_model_len: int,
        gate: TargetConfidenceGate | None = None,
        kv_cache: KVCache | None = None,
        policy: GoodputPolicy | None = None,
        num_target_layers: int = 0,
        trim_drafts: bool = True,
    ):
        self.model_layers = num_target_layers  # the layers feature-reading decoders pick from
        self.decoders = decoders  # drafting decoders by name (autoregressive is not one)
        self.default_method = default_method
        self.num_speculative_tokens = num_speculative_tokens  # k unless a request sets its own
        self.block_manager = block_manager
        self.kv_cache = kv_cache  # where accepted tree paths are compacted
        self.max_model_len = max_model_len
        self.gate = gate or TargetConfidenceGate(None)
        self.policy = policy  # None: draft what the decoders ask for (fixed k)
        self.trim_drafts = trim_drafts  # by the policy's chance floor
        # The policy's prediction for the latest step it chose for, and that step's drafting
        # plus forward time (seconds; 0 without a policy or before its first estimate).
        self.predicted_step_seconds = 0.0
        self.measured_step_seconds = 0.0
        self._measured_step_drafted = False  # whether that step drafted
        self._step_draft_seconds = 0.0
        self._warm_decoders: set[str] = set()  # decoders whose drafting time is measured
        self.rejection_sampler = RejectionSampler(eos_token_ids)
        self.stats = SpecDecodeStats()  # all decoders together
        self.stats_by_decoder = {name: SpecDecodeStats() for name in decoders}
        # Drafts not verified because their chance was under the policy's floor, and this
        # step's trimmed sequences' lengths before trimming.
        self.num_trimmed_drafts = 0
        self._drafted: dict[Sequence, int] = {}
        # This step's feature readers (``_feature_readers``), and each decoder's layers.
        self._readers_of: list[ScheduledSequence] | None = None
        self._readers: list[Decoder | None] = []
        self._decoder_layers: dict[Decoder, tuple[int, ...]] = {}

    @property
    def reads_target_hidden(self) -> bool:
        """Whether a loaded decoder drafts from the target's hidden states."""
        return any(d.reads_target_hidden for d in self.decoders.values())

    def needs_target_hidden(self, scheduled: list[ScheduledSequence]) -> bool:
        """Whether a sequence of this step drafts with a decoder that reads the target's
        hidden states (they must see every step's, drafting or not)."""
        return any(self._feature_readers(scheduled))

    def feature_layers(self, scheduled: list[ScheduledSequence]) -> tuple[int, ...]:
        """The target layers whose outputs this step's feature-reading decoders read."""
        readers = self._feature_readers(scheduled)
        layers = {layer for d in readers if d is not None for layer in self._layers_of(d)}
        return tuple(sorted(layers))

    def _feature_readers(self, scheduled: list[ScheduledSequence]) -> list[Decoder | None]:
        """Per scheduled sequence, its decoder if that reads the target's hidden states (else
        None); empty when none does. The engine asks three times a step (the layers to
        capture, whether to hand them out, to whom): worked out once per step's list."""
        if scheduled is not self._readers_of:
            readers: list[Decoder | None] = []
            if self.reads_target_hidden:
                readers = [
                    d if d is not None and d.reads_target_hidden else None
                    for d in (self.decoder_of(s.seq) for s in scheduled)
                ]
            self._readers_of = scheduled
            self._readers = readers if any(d is not None for d in readers) else []
        return self._readers

    def _layers_of(self, decoder: Decoder) -> tuple[int, ...]:
        layers = self._decoder_layers.get(decoder)
        if layers is None:  # fixed by the decoder's drafter and the target
            layers = self._decoder_layers[decoder] = decoder.feature_layers(self.model_layers)
        return layers

    def loaded_feature_layers(self) -> tuple[int, ...]:
        """The layers every loaded feature-reading decoder reads (CUDA graphs' capture)."""
        layers = {
            layer
            for d in self.decoders.values()
            if d.reads_target_hidden
            for layer in d.feature_layers(self.model_layers)
        }
        return tuple(sorted(layers))

    def plain_step(self, scheduled: list[ScheduledSequence], proposals: dict) -> bool:
        """Whether this step can run as plain autoregressive decoding: no drafts to verify and
        no target confidence to observe (hidden states are handed out on either path)."""
        return not proposals and not self.gate.enabled

    def decoder_of(self, seq: Sequence) -> Decoder | None:
        method = seq.speculative.method if seq.speculative is not None else self.default_method
        return self.decoders.get(method)

    def _by_decoder(self, seqs) -> dict[Decoder, list[Sequence]]:
        groups: dict[Decoder, list[Sequence]] = {}
        for seq in seqs:
            decoder = self.decoder_of(seq)
            if decoder is not None:
                groups.setdefault(decoder, []).append(seq)
        return groups

    def plan(self, running: list[Sequence]) -> dict[Sequence, int]:
        """Draft slots each decoding sequence asks for (the scheduler grants what it can)."""
        decoding = [s for s in running if s.num_uncomputed_tokens == 1]
        lookahead: dict[Sequence, int] = {}
        for decoder, seqs in self._by_decoder(decoding).items():
            seqs = [s for s in seqs if self.gate.allows(s)]
            if not seqs:
                continue
            wants = decoder.plan(seqs, {s: self._max_drafts(s) for s in seqs})
            wants = {s: n for s, n in wants.items() if n > 0}
            if self.policy is None or not wants:
                lookahead.update(wants)
                continue
            for source, group in _by_source(decoder, wants).items():
                lookahead.update(self._chosen_lengths(source, group, decoding))
        return lookahead

    def _chosen_lengths(
        self, source: str, wants: dict[Sequence, int], decoding: list[Sequence]
    ) -> dict[Sequence, int]:
        """The policy's draft length for the sequences of one draft source."""
        others = [s for s in decoding if s not in wants]
        shape = (len(wants), cap := max(wants.values()), len(others))
        if self.policy.repeat_plain(source, shape):
            return {}  # its last choice of 0 stands (``GoodputPolicy.repeat_plain``)
        k = self.policy.choose(
            source,
            len(wants),
            cap,
            context=sum(s.num_tokens for s in wants),
            other_tokens=len(others),
            other_keys=sum(s.num_tokens for s in others),
            shape=shape,
        )
        explorer = next(iter(wants)) if self.policy.explore else None
        self.predicted_step_seconds = self.policy.predicted_seconds or 0.0
        return {
            s: min(n, k + (s is explorer)) for s, n in wants.items()
            if min(n, k + (s is explorer)) > 0
        }  # fmt: skip

    def propose(self, scheduled: list[ScheduledSequence]) -> dict[Sequence, Proposal]:
        """Drafts for the sequences granted lookahead slots; a sequence's ``num_lookahead``
        becomes the number of drafts it really got (a window may stop short of the grant, and
        the policy's chance floor trims drafts not worth their verification row)."""
        granted = {s.seq: s for s in scheduled if s.num_lookahead > 0}
        proposals: dict[Sequence, Proposal] = {}
        floors: dict[Sequence, tuple[float, str]] = {}
        trims = self.policy is not None and self.trim_drafts
        for decoder, seqs in self._by_decoder(granted).items():
            grants = {s: granted[s].num_lookahead for s in seqs}
            for source, group in _by_source(decoder, grants).items():
                proposals.update(self._proposals_of(decoder, source, group))
                floor = self.policy.chance_floor(source) if trims else None
                if floor:
                    floors.update(dict.fromkeys(group, (floor, source)))
        self._drafted = {}
        for seq, s in granted.items():
            proposal = proposals.get(seq)
            count = min(len(proposal.token_ids), s.num_lookahead) if proposal else 0
            if proposal is not None and seq in floors:
                floor, source = floors[seq]
                chance = functools.partial(self.policy.chance, source)
                worth = drafts_worth_verifying(seq, proposal, floor, chance)
                if worth < count:
                    self.num_trimmed_drafts += count - worth
                    self._drafted[seq] = count  # the policy counts the trimmed as rejected
                    count = worth
            if proposal is not None and count == 0:
                del proposals[seq]
                if seq in self._drafted:
                    self._verified_nothing(seq, proposal)
            elif proposal is not None:
                if proposal.parents is not None and self.kv_cache is None:
                    raise ValueError(f"decoder of {seq.request_id} proposed a tree: no KV cache")
                proposals[seq] = proposal.truncated(count)
            s.num_lookahead = count
        return proposals

    def _verified_nothing(self, seq: Sequence, proposal: Proposal) -> None:
        """Every draft of ``seq`` was trimmed: the drafter rolls back as after a verification
        that accepted none, and the policy hears of a run with none accepted."""
        decoder = self.decoder_of(seq)
        decoder.on_verified(seq, proposal.truncated(0), 0)
        self.policy.observe_run(decoder.draft_source(seq), self._drafted.pop(seq), 0)

    def _proposals_of(self, decoder: Decoder, source: str, grants: dict[Sequence, int]) -> dict:
        """One draft source's proposals for its granted sequences, its drafting timed for
        the policy."""
        # A drafter far behind (a sequence's first draft reads its whole prompt, a
        # stretch without drafts its every token) pays a catch-up that drafting every
        # step does not: priced by it, drafting looked 10x dearer than it is and the
        # policy never drafted again (eagle-goodput at 0.95x while eagle-k1 made 1.08x).
        behind = max(decoder.tokens_behind(s) for s in grants)
        started = time.perf_counter()
        proposals = decoder.propose(list(grants), grants)
        if self.policy is not None:
            seconds = time.perf_counter() - started
            steady = behind <= max(grants.values()) + CATCH_UP_SLACK
            if source in self._warm_decoders and steady:
                self.policy.observe_draft(source, max(grants.values()), len(grants), seconds)
            # A decoder's first drafts in a process run cold (first calls allocate and
            # warm caches: 1.5-4x a later call), and the policy would price a
            # length by the one call it made while exploring it.
            self._warm_decoders.add(source)
            self._step_draft_seconds += seconds
        return proposals

    def observe_forward(self, items: list[ForwardItem], seconds: float, drafted: bool) -> None:
        """The step over ``items`` took ``seconds`` from its forward pass through sampling or
        verification (the policy's cost model: its tokens, the keys they attended to, and
        whether it verified drafts). Only decode-shaped steps teach the cost model: see
        ``decode_shaped``."""
        self._readers_of = None  # the step is over: its sequences are not held past it
        if self.policy is not None:
            # A step whose drafts were all trimmed runs plain, but after a drafter streamed its
            # weights through the caches: its forward pass is a drafting step's, dearer than
            # plain decoding's. Taken as plain, it raised the level that plain steps were
            # priced at and lowered the drafted steps' ratio to it (medusa with 8-bit
            # activations: 0.74), so drafting looked cheaper than it was.
            drafted = drafted or self._step_draft_seconds > 0
            if decode_shaped(items):
                tokens = sum(len(item.token_ids) for item in items)
                keys = sum(len(i.token_ids) * (i.num_cached + len(i.token_ids)) for i in items)
                self.policy.observe_step(tokens, seconds, keys, drafted)
            self.measured_step_seconds = seconds + self._step_draft_seconds
            self._measured_step_drafted = drafted
            self._step_draft_seconds = 0.0

    def observe_step_interval(self, seconds: float) -> None:
        """The last step began ``seconds`` before this one: what its forward pass and drafting
        did not take is the policy's per-step overhead. A gap far longer than the step (the
        engine sat idle, waiting for requests) says nothing of it."""
        measured = self.measured_step_seconds
        if self.policy is not None and measured and seconds - measured <= IDLE_GAP_RATIO * measured:
            self.policy.observe_overhead(seconds - measured, self._measured_step_drafted)

    def _max_drafts(self, seq: Sequence) -> int:
        k = self.num_speculative_tokens
        if seq.speculative is not None and seq.speculative.num_speculative_tokens:
            # A request may draft less than the server's k, never more: its drafts come out of
            # the budget that every other running sequence shares.
            k = min(k, seq.speculative.num_speculative_tokens)
        # Drafts past max_tokens or the context would be cut anyway: don't compute them.
        room = min(k, self.max_model_len - seq.num_tokens - 1)
        params = seq.sampling_params
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - len(seq.output_token_ids) - 1)
        return max(0, room)

    def forward_items(
        self,
        scheduled: list[ScheduledSequence],
        completing: list[bool],
        proposals: dict[Sequence, Proposal],
    ) -> list[ForwardItem]:
        items = []
        for s, completes in zip(scheduled, completing, strict=True):
            seq, start = s.seq, s.seq.num_computed_tokens
            proposal = proposals[seq] if s.num_lookahead else None
            drafts = proposal.token_ids if proposal else []
            tokens = seq.token_ids[start : start + s.num_new_tokens] + drafts
            tree = None
            if proposal is not None and proposal.parents is not None:
                # The decode token, then the drafts: draft i's parent p is item token p + 1.
                tree = [-1] + [p + 1 for p in proposal.parents]
            num_logits = len(drafts) + 1 if completes else 0
            items.append(ForwardItem(tokens, start, seq.block_table, num_logits, tree))
        return items

    def verify(
        self,
        logits,
        scheduled: list[ScheduledSequence],
        completing: list[bool],
        proposals: dict[Sequence, Proposal],
        hidden: torch.Tensor | None = None,
    ) -> Verification:
        """Accept drafts: what the verification found (``Verification``: each completing
        sequence's new tokens, their sources where asked, how many of each drafting
        sequence's drafts stood, which the engine marks computed with the step's tokens and
        releases the rest). ``hidden``: the target's last-layer hidden states of every token
        row, for decoders that read them.

        Call after the forward pass and before the sequences' token counts move on.
        """
        runs, seqs = [], []
        for s, completes in zip(scheduled, completing, strict=True):
            if not completes:
                continue
            seq, k = s.seq, s.num_lookahead
            p = proposals.get(seq) if k else None
            if p is None:
                runs.append(DraftRun(seq, [], None, seq.generator))
            else:
                runs.append(DraftRun(seq, p.token_ids, p.draft_probs, seq.generator, p.parents))
            seqs.append(s)
        verified = self.rejection_sampler(logits, runs)
        results, accepted, paths = [], {}, {}
        sources = {
            s.seq: sources_of_run(len(run.draft_token_ids), v.path, run.parents)
            for s, run, v in zip(seqs, runs, verified, strict=True)
            if s.seq.sampling_params.return_provenance
        }
        for s, run, v in zip(seqs, runs, verified, strict=True):
            k = len(run.draft_token_ids)
            if run.parents is not None:
                self._compact_path(s, v.path)
            if k:
                decoder = self.decoder_of(s.seq)
                decoder.on_verified(s.seq, proposals[s.seq], v.num_accepted)
                self.stats_by_decoder[decoder.name].record(k, v.num_accepted)
                if self.policy is not None:
                    drafted = self._drafted.pop(s.seq, k)  # with the trimmed ones
                    source = decoder.draft_source(s.seq)
                    self.policy.observe_run(
                        source, drafted, v.num_accepted, tree=run.parents is not None
                    )
                    if _is_greedy_chain(s.seq, proposals[s.seq]):
                        self.policy.observe_chances(
                            source, proposals[s.seq].confidences, v.num_accepted
                        )
                self.stats.record(k, v.num_accepted)
            results.append((s.seq, v.tokens))
            accepted[s.seq] = v.num_accepted
            paths[s.seq] = v.path
        if self.gate.enabled:
            rows = _last_token_rows(runs, verified)
            self._observe_target_confidence(logits, runs, verified, rows)
        if hidden is not None:
            self.hand_out_features(hidden, scheduled, proposals, paths)
        return Verification(results, accepted, sources)

    def statistics(self) -> dict:
        """Everything speculation counts, as ``EngineStats`` fields (core_protocol.py) and so
        as /metrics series: the one place they are read from, engine to server.

        Totals and per decoder (vLLM's spec_decode_* counters), the goodput policy's chosen
        draft lengths per decoder, and its last predicted step time against the measured one.
        """
        by_decoder = tuple(
            (name, (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens,
                    tuple(s.accepted_per_position)))
            for name, s in self.stats_by_decoder.items()
        )  # fmt: skip
        lengths = ()
        if self.policy is not None:
            lengths = tuple(
                (name, tuple(chosen.get(k, 0) for k in range(max(chosen, default=-1) + 1)))
                for name, chosen in self.policy.chosen.items()
            )
        total = self.stats
        return {
            "decoder": self.default_method,
            "spec_by_decoder": by_decoder,
            "spec_draft_lengths": lengths,
            "spec_policy_predicted_seconds": self.predicted_step_seconds,
            "spec_policy_measured_seconds": self.measured_step_seconds,
            "spec_num_drafts": total.num_drafts,
            "spec_num_draft_tokens": total.num_draft_tokens,
            "spec_num_accepted_tokens": total.num_accepted_tokens,
            "spec_accepted_per_position": tuple(total.accepted_per_position),
            "spec_num_trimmed_drafts": self.num_trimmed_drafts,
        }

    def hand_out_features(self, hidden, scheduled, proposals, paths) -> None:
        """Give each feature-reading decoder the target's hidden states of the tokens that
        stand: the step's tokens, then the accepted drafts (a tree's along its path). ``hidden``
        has a row per token of the step's forward items, in order.

        A decoder may keep what it gets without copying it: a step's hidden states are new
        tensors that nothing writes again, and a few rows of a long step come as a copy of
        their own. Under the goodput policy most steps do not draft, and a copy a step of
        each decode row was a third of what such a step spent handing features over."""
        readers = self._feature_readers(scheduled)
        if not readers:
            return
        row = 0
        long_step = len(hidden.rows) > HELD_STEP_ROWS
        for s, decoder in zip(scheduled, readers, strict=True):
            seq, n = s.seq, s.num_new_tokens
            drafts = len(proposals[seq].token_ids) if s.num_lookahead else 0
            if decoder is not None:
                columns = hidden.of(self._layers_of(decoder))
                path = paths.get(seq)
                if path:  # the accepted drafts' rows too: a copy of its own
                    rows = list(range(row, row + n)) + [row + n + node for node in path]
                    features = columns[rows]
                else:
                    features = columns if n == len(columns) else columns[row : row + n]
                    if long_step and n < HELD_STEP_ROWS:
                        features = features.clone()  # kept, it would keep the step's alive
                decoder.observe_target_features(seq, seq.num_computed_tokens, features)
            row += n + drafts

    def _compact_path(self, s: ScheduledSequence, path: list[int]) -> None:
        """Copy the K/V of the accepted drafts (tree indices ``path``) into the slots after the
        step's tokens, where a chain's would be. Sources never precede their destinations (a
        draft's index is at least its depth), so the copies cannot overwrite each other's."""
        moves = [(depth, node) for depth, node in enumerate(path) if node != depth]
        if not moves:
            return
        first = s.seq.num_computed_tokens + s.num_new_tokens  # draft i sat at slot first + i
        dst = torch.tensor([first + depth for depth, _ in moves])
        src = torch.tensor([first + node for _, node in moves])
        table, size = s.seq.block_table, self.kv_cache.block_size
        self.kv_cache.copy_slots(
            slots_for_positions(table, src, size), slots_for_positions(table, dst, size)
        )

    def _observe_target_confidence(self, logits, runs, verified, rows) -> None:
        """The target's probability for each sequence's last emitted token, for the gate."""
        if not rows:
            return
        ids = [v.tokens[-1].token_id for v in verified]
        probs = torch.softmax(logits[rows].float(), dim=-1)
        chosen = probs[torch.arange(len(rows)), torch.tensor(ids)].tolist()
        for run, p in zip(runs, chosen, strict=True):
            self.gate.observe(run.row, p)


def decode_shaped(items: list[ForwardItem]) -> bool:
    """Whether every item of a step is a decode (its token and drafts, each wanting logits),
    none a prompt chunk. The policy prices decode steps, and a prompt's pass runs other
    kernels (attention over the prompt, products over a hundred rows) than the curve it
    calibrated: observed, it set the level that every decode step was priced at. While a
    decoder drafted every step, its few plain steps were mostly prompts (kangaroo, chat: the
    level read 1.33 in one run, 1.13 from decode steps alone in the next), so a plain step
    looked dearer than it was, drafting cheap, and the policy drafted every step at 0.92x
    where plain steps made 1.0x."""
    return all(item.num_logits == len(item.token_ids) for item in items)


def _last_token_rows(runs: list[DraftRun], verified) -> list[int]:
    """Each run's logits row that gave its last emitted token: its root row, or the row of
    its last accepted draft."""
    rows, row = [], 0
    for run, v in zip(runs, verified, strict=True):
        rows.append(row + (v.path[-1] + 1 if v.path else 0))
        row += len(run.draft_token_ids) + 1
    return rows


def _by_source(decoder: Decoder, wants: dict[Sequence, int]) -> dict[str, dict[Sequence, int]]:
    """``wants`` split by the decoder's draft source of each sequence."""
    groups: dict[str, dict[Sequence, int]] = {}
    for seq, n in wants.items():
        groups.setdefault(decoder.draft_source(seq), {})[seq] = n
    return groups


def _is_greedy_chain(seq: Sequence, proposal: Proposal) -> bool:
    """A greedy request's chain (or one-path tree) whose drafts carry their drafter's top-1
    probabilities (lookup's read 1: it has none)."""
    drafts = len(proposal.token_ids)
    if proposal.parents is not None and not is_chain(proposal.parents):
        return False
    return (
        seq.sampling_params.greedy
        and len(proposal.confidences) >= drafts
        and any(c < 1 for c in proposal.confidences[:drafts])
    )


def drafts_worth_verifying(
    seq: Sequence, proposal: Proposal, floor: float, chance: Callable[[float], float] = float
) -> int:
    """How many of a greedy chain's drafts have a chance of standing of at least ``floor``:
    ``chance`` of each draft's top-1 probability (a greedy draft stands when it is the
    target's argmax, which the drafter's probability, calibrated, estimates), multiplied along
    the chain. Trees, sampled requests (whose drafts stand by the ratio of two distributions)
    and drafts without probabilities keep every draft."""
    drafts = len(proposal.token_ids)
    if not _is_greedy_chain(seq, proposal):
        return drafts
    together, worth = 1.0, 0
    for confidence in proposal.confidences[:drafts]:
        together *= chance(confidence)
        if together < floor:
            break
        worth += 1
    return worth
