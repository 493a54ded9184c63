"""One speculative step: ask the decoder for drafts, verify them in the step's forward pass,
accept per sequence with the rejection sampler, roll the KV cache back past what was rejected.

Every sequence of the batch goes through the same pass: a sequence with drafts contributes its
decode token plus k draft tokens and gets k + 1 rows of logits; one without drafts (or in
prefill) is an ordinary row. Acceptance is counted per draft position, as vLLM reports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.decoders import Decoder, Proposal
from engine.kv_cache import BlockManager
from engine.model_runner import ForwardItem
from engine.rejection_sampler import DraftRun, RejectionSampler
from engine.sampling import SampledToken
from engine.scheduler import ScheduledSequence
from engine.sequence import Sequence


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


class Speculator:
    def __init__(
        self,
        decoder: Decoder,
        num_speculative_tokens: int,
        block_manager: BlockManager,
        eos_token_ids,
        max_model_len: int,
    ):
        self.decoder = decoder
        self.num_speculative_tokens = num_speculative_tokens  # k unless a request sets its own
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.rejection_sampler = RejectionSampler(eos_token_ids)
        self.stats = SpecDecodeStats()

    def propose(self, running: list[Sequence]) -> dict[Sequence, Proposal]:
        decoding = [
            s
            for s in running
            if s.num_uncomputed_tokens == 1
            and (s.speculative is None or s.speculative.method == self.decoder.name)
        ]
        return self.decoder.propose(decoding, {s: self._max_drafts(s) for s in decoding})

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
            drafts = proposals[seq].token_ids[: s.num_lookahead] if s.num_lookahead else []
            tokens = seq.token_ids[start : start + s.num_new_tokens] + drafts
            items.append(
                ForwardItem(tokens, start, seq.block_table, len(drafts) + 1 if completes else 0)
            )
        return items

    def verify(
        self,
        logits,
        scheduled: list[ScheduledSequence],
        completing: list[bool],
        proposals: dict[Sequence, Proposal],
    ) -> list[tuple[Sequence, list[SampledToken]]]:
        """Accept drafts, roll back the rest; returns each completing sequence's new tokens.

        Call after the forward pass and before the sequences' token counts move on.
        """
        runs, seqs = [], []
        for s, completes in zip(scheduled, completing, strict=True):
            seq = s.seq
            k = s.num_lookahead
            seq.num_computed_tokens += s.num_new_tokens + k
            if not completes:
                continue
            proposal = proposals.get(seq)
            drafts = proposal.token_ids[:k] if k else []
            q = proposal.draft_probs[:k] if k and proposal.draft_probs is not None else None
            runs.append(DraftRun(seq, drafts, q, seq.generator))
            seqs.append(s)
        verified = self.rejection_sampler(logits, runs)
        results = []
        for s, run, v in zip(seqs, runs, verified, strict=True):
            k = len(run.draft_token_ids)
            if k:
                # Keep the decode token and the accepted drafts; drop the rejected ones.
                self.block_manager.rollback(s.seq, s.seq.num_computed_tokens - k + v.num_accepted)
                self.decoder.on_verified(s.seq, proposals[s.seq], v.num_accepted)
                self.stats.record(k, v.num_accepted)
            results.append((s.seq, v.tokens))
        return results
