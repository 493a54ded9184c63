"""One sequence's constraint matcher: the mask of allowed next tokens after any history."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import torch
from llguidance import LLMatcher

from engine.constraints.banned import BannedPhrasesState
from engine.constraints.spec import ConstraintSpec
from engine.constraints.vocabulary import ConstraintVocabulary


class ConstraintState:
    """An llguidance matcher kept in step with whatever history it is asked about.

    Rows of one step ask about the sequence's output followed by different drafts (position j
    of a chain, each node's path in a tree), and the next step's output keeps only some of
    them: the matcher rolls back to the longest common prefix and consumes the rest, so each
    question costs the tokens that differ, not the whole output.
    """

    def __init__(self, matcher, vocab_size: int, eos_token_ids: Collection[int] = ()):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.consumed: list[int] = []
        self._bits = torch.empty((1, (vocab_size + 31) // 32), dtype=torch.int32)

    def mask_(self, logits: torch.Tensor, history: Sequence[int]) -> None:
        """Set the logits (a [vocab] row) of the tokens not allowed after ``history`` to -inf."""
        allowed = self.allowed(history)
        if allowed is not None:
            # The mask is built on the CPU; a GPU row needs it on its own device. The copy's
            # source is a fresh tensor nothing writes to again, so it need not block.
            refused = (~allowed).to(logits.device, non_blocking=True)
            logits[: allowed.shape[0]].masked_fill_(refused, float("-inf"))

    def allowed(self, history: Sequence[int]) -> torch.Tensor | None:
        """Bool [vocab] of the tokens the constraint allows after ``history``; None when the
        history itself breaks the constraint (a rejected draft's row: it is never used, and
        masking it whole would only make NaNs)."""
        if not self._follow(list(history)):
            return None
        # Straight into our buffer (llguidance.torch would do the same, but importing it
        # compiles kernels we do not use).
        self.matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        # Bit i of the mask is token i (little-endian words): unpack without a tensor op per bit.
        unpacked = np.unpackbits(self._bits.numpy().view(np.uint8), bitorder="little")
        return torch.from_numpy(unpacked[: self.vocab_size].view(np.bool_))

    def allows(self, history: Sequence[int]) -> bool:
        """Whether ``history`` (a sequence's output with a token about to be appended) keeps
        to the constraint."""
        history = list(history)
        if history and history[-1] in self.eos_token_ids:
            # The mask allows EOS where the constraint may end; the matcher does not consume it.
            return self._follow(history[:-1]) and self.matcher.is_accepting()
        return self._follow(history)

    def _follow(self, history: list[int]) -> bool:
        """Bring the matcher to ``history``; False if it cannot get all the way there."""
        common = _common_prefix(self.consumed, history)
        if common < len(self.consumed):
            if not self.matcher.rollback(len(self.consumed) - common) or self.matcher.is_error():
                raise RuntimeError(f"constraint matcher failed: {self.matcher.get_error()}")
            del self.consumed[common:]
        rest = history[common:]
        if rest:
            # try_consume stops at the first token the grammar refuses, without entering
            # the matcher's (permanent) error state.
            taken = self.matcher.try_consume_tokens(rest)
            self.consumed.extend(rest[:taken])
            return taken == len(rest)
        return True


def _common_prefix(a: list[int], b: list[int]) -> int:
    if len(a) <= len(b) and b[: len(a)] == a:
        return len(a)  # the usual case: only new tokens to consume
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class AllConstraints:
    """Several constraints on one sequence (a grammar and banned phrases): every mask applies."""

    def __init__(self, states: Sequence):
        self.states = list(states)

    def mask_(self, logits: torch.Tensor, history: Sequence[int]) -> None:
        for state in self.states:
            state.mask_(logits, history)

    def allows(self, history: Sequence[int]) -> bool:
        return all(state.allows(history) for state in self.states)


class ConstraintFactory(ConstraintVocabulary):
    """Builds sequences' matchers for the engine, over the vocabulary it extends."""

    def banned(self, phrases: Sequence[str]) -> BannedPhrasesState:
        tokenizer = self.hf_tokenizer

        def decode(ids):
            return tokenizer.decode(list(ids), skip_special_tokens=True)

        return BannedPhrasesState(list(phrases), decode)

    def state(self, spec: ConstraintSpec) -> ConstraintState:
        """A fresh matcher; raises ValueError naming what is wrong with the constraint."""

        error = spec.error(self.tokenizer)
        if error:
            raise ValueError(f"the output constraint is not usable: {error}")
        return ConstraintState(
            LLMatcher(self.tokenizer, spec.grammar(), log_level=0),
            self.vocab_size,
            self.eos_token_ids,
        )
