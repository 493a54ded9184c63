"""Which sequences run this step, and how many of their tokens.

Continuous batching with chunked prefill under a token budget. Running sequences go first
(a decode token each, or the next chunk of an unfinished prefill); waiting sequences are
admitted while budget, sequence slots and KV blocks allow. When a running sequence cannot
get the blocks it needs, the newest running sequence is preempted by recompute: its blocks
are freed and it goes back to the head of the waiting queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.kv_cache import BlockManager
from engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens to compute this step, starting at seq.num_computed_tokens
    # Slots reserved after those for draft tokens to verify (rolled back when rejected).
    num_lookahead: int = 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self, lookahead: Mapping[Sequence, int] | None = None) -> SchedulerOutput:
        """Pick this step's work. ``lookahead[seq]`` asks for draft slots after a sequence's
        decode token; they are granted last, from the budget and free blocks that every
        running and newly admitted sequence left over, never by preempting one."""
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        # Admitting new work in a step that had to preempt would only thrash.
        if not out.preempted:
            budget = self._admit_waiting(out, budget)
        if lookahead:
            self._grant_lookahead(out, budget, lookahead)
        return out

    def _grant_lookahead(
        self, out: SchedulerOutput, budget: int, lookahead: Mapping[Sequence, int]
    ) -> None:
        """Draft slots come last, from what every running and admitted sequence left over."""
        for s in out.scheduled:
            if budget <= 0:
                return
            seq = s.seq
            if s.num_new_tokens != 1 or seq.num_computed_tokens + 1 != seq.num_tokens:
                continue  # only a decode step (its one uncomputed token) carries drafts
            extra = min(lookahead.get(seq, 0), budget)
            if extra > 0 and self.block_manager.can_append(seq, 1 + extra):
                self.block_manager.append_slots(seq, 1 + extra)
                s.num_lookahead = extra
                budget -= extra

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.can_append(seq, n):
                victim = self.running.pop()  # newest; never one already scheduled
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.append_slots(seq, n)
                out.scheduled.append(ScheduledSequence(seq, n))
                budget -= n
                i += 1
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # Cached tokens run no forward pass, so they would have no prompt logprobs (or
            # hidden states).
            hits = self.block_manager.allocate_prefix(seq, lookup=not seq.runs_every_prompt_token)
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.can_append(seq, n):
                self.block_manager.free(seq)  # give back the prefix-cache references
                break
            self.block_manager.append_slots(seq, n)
            if seq.num_preemptions == 0:  # a recompute is not a prompt lookup
                seq.num_prefix_hit_tokens = hits
                if self.block_manager.enable_prefix_caching and not seq.runs_every_prompt_token:
                    self.block_manager.stats.record(seq.num_prompt_tokens, hits)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, n))
            budget -= n
        return budget

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def recompute(self, seq: Sequence) -> None:
        """Send a running sequence whose tokens changed (a rewind) back to be recomputed, as a
        preemption does: its blocks are freed, the prefix cache gives back the full ones."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1  # the epoch: drafters forget what they kept for it
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (stop, length or abort) and release its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
