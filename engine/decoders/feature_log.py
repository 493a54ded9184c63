"""A sequence's target features that a drafter has not consumed for good yet.

Drafters that read the target's hidden states (EAGLE's last-layer features, Kangaroo's
shallow exit) get every step's, drafting or not, and read them when they next draft: EAGLE
an entry's previous feature, Kangaroo the shallow hidden states of the tokens its adapter has
not read yet. Appending is the common, cheap part (a buffer that doubles when full); the
normalization a drafter wants is applied only to the rows it reads. A decode step's single row
is only kept (``PENDING_ROWS`` of them at most) and copied in with the others when the log is
read: under the goodput policy most steps do not draft, and one copy a step into the buffer
was a third of what a plain step spent on handing features over (60 of 200 us on a Zen 1).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.sequence import Sequence

# Decode steps' rows kept as they came before one copy moves them into the buffer.
PENDING_ROWS = 32


class FeatureLog:
    """A sequence's kept features (positions start .. end - 1) and, for EAGLE, its newest
    guess (the output of the last entry it computed)."""

    def __init__(self, start: int, features: torch.Tensor, normalize):
        self.start = start  # position of the first kept feature
        self._buffer = features.detach().clone()
        self._head, self._count = 0, len(features)  # rows in the buffer
        # Single rows appended since, not copied into the buffer yet. They are the step's
        # own tensors (each step's hidden states are new ones, never written again).
        self._pending: list[torch.Tensor] = []
        self._normalize = normalize  # what the drafter reads them through (EAGLE: final norm)
        self.guess: torch.Tensor | None = None
        self.guess_position = -1

    @property
    def end(self) -> int:
        """One past the last position with a feature."""
        return self.start + self._count + len(self._pending)

    @property
    def features(self) -> torch.Tensor:
        """[m, d] the kept features, normalized (positions start .. end - 1)."""
        self._flush()
        return self._normalize(self._rows(0, self._count))

    def _rows(self, a: int, b: int) -> torch.Tensor:
        return self._buffer[self._head + a : self._head + b]

    def append(self, features: torch.Tensor) -> None:
        if len(features) == 1 and len(self._pending) < PENDING_ROWS:
            self._pending.append(features)  # the step's own row (hand_out_features)
            return
        self._flush()
        self._copy_in(features)

    def _flush(self) -> None:
        if not self._pending:
            return
        rows = self._pending[0] if len(self._pending) == 1 else torch.cat(self._pending)
        self._pending = []
        self._copy_in(rows)

    # Steps append, readers flush, inside inference mode or not: a buffer grown inside it is
    # an inference tensor, which only inference mode may write.
    @torch.inference_mode()
    def _copy_in(self, features: torch.Tensor) -> None:
        n = len(features)
        if self._head + self._count + n > len(self._buffer):
            grown = self._buffer.new_empty(max(64, 2 * (self._count + n)), self._buffer.shape[1])
            grown[: self._count] = self._rows(0, self._count)
            self._buffer, self._head = grown, 0
        self._buffer[self._head + self._count : self._head + self._count + n] = features
        self._count += n

    def drop_before(self, position: int) -> None:
        """Forget the features of positions before ``position``."""
        if position - self.start > self._count:
            self._flush()  # the drop reaches into the pending rows
        drop = min(max(0, position - self.start), self._count)
        self._head, self._count = self._head + drop, self._count - drop
        self.start += drop

    def before(self, first: int, count: int, width: int) -> torch.Tensor:
        """[count, d] the features entries first .. first + count - 1 read: position p - 1's
        target feature where known, else the guess made there, else zeros."""
        lo, hi = first - 1, first - 1 + count  # feature positions wanted: [lo, hi)
        self._flush()
        if self.start <= lo and hi <= self.end:  # the usual case: all known, nothing to merge
            return self._normalize(self._rows(lo - self.start, hi - self.start))
        out = torch.zeros(count, width, dtype=self._buffer.dtype)
        if self.guess is not None and lo <= self.guess_position < hi:
            out[self.guess_position - lo] = self.guess
        a, b = max(lo, self.start), min(hi, self.end)
        if a < b:
            out[a - lo : b - lo] = self._normalize(self._rows(a - self.start, b - self.start))
        return out

    def at(self, first: int, count: int, width: int) -> torch.Tensor:
        """[count, d] the features of positions first .. first + count - 1 (zeros where
        unknown; a guess never stands in for them)."""
        if self.guess is not None:
            raise ValueError("a log with guesses reads entries' previous features: before()")
        return self.before(first + 1, count, width)


class SequenceFeatureLogs:
    """Each sequence's ``FeatureLog`` (held weakly: a finished sequence's goes with it)."""

    def __init__(self, normalize):
        self._normalize = normalize
        self._logs: weakref.WeakKeyDictionary[Sequence, FeatureLog] = weakref.WeakKeyDictionary()

    def __contains__(self, seq: Sequence) -> bool:
        return seq in self._logs

    def __getitem__(self, seq: Sequence) -> FeatureLog:
        return self._logs[seq]

    def get(self, seq: Sequence) -> FeatureLog | None:
        return self._logs.get(seq)

    def observe(
        self, seq: Sequence, first_position: int, features: torch.Tensor, needed_from
    ) -> None:
        """A step's features of positions ``first_position`` on; ``needed_from`` (None: all):
        the first position the drafter will still read, the ones before it are dropped."""
        log = self._logs.get(seq)
        if log is None or first_position != log.end:
            # New, or recomputed after preemption: start over from these positions.
            self._logs[seq] = FeatureLog(first_position, features, self._normalize)
            return
        if needed_from is not None:
            log.drop_before(needed_from)
        log.append(features.detach())
