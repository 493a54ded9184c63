"""A sequence's feature log (engine/decoders/feature_log.py): decode steps' single rows are
kept as they came and copied into the buffer only when the log is read or their count runs
out; whatever the order of appends, drops and reads, the log reads exactly what a log that
copied every row at once reads. The speculator hands a decode row over as it is, and as a copy
of its own when it is a row of a long step."""

from __future__ import annotations

import random

import torch

from engine import target_features
from engine.decoders import feature_log
from engine.decoders.base import Decoder
from engine.decoders.feature_log import FeatureLog
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSequence
from engine.sequence import Sequence
from engine.speculation import Speculator
from engine.target_features import TargetFeatures


class EagerLog:
    """The reference: every kept feature in one list, by position."""

    def __init__(self, start: int, rows: torch.Tensor):
        self.start, self.rows = start, list(rows)

    @property
    def end(self) -> int:
        return self.start + len(self.rows)

    def append(self, rows: torch.Tensor) -> None:
        self.rows += list(rows)

    def drop_before(self, position: int) -> None:
        drop = min(max(0, position - self.start), len(self.rows))
        self.rows, self.start = self.rows[drop:], self.start + drop

    def at(self, first: int, count: int, width: int) -> torch.Tensor:
        out = torch.zeros(count, width)
        for i in range(count):
            if self.start <= first + i < self.end:
                out[i] = self.rows[first + i - self.start]
        return out


def test_a_log_that_keeps_decode_rows_reads_what_an_eager_copy_reads():
    draws = random.Random(5)
    width = 8
    first = torch.randn(6, width)
    log, reference = FeatureLog(3, first, lambda x: x * 2), EagerLog(3, first)
    kept_pending = 0
    for _ in range(400):
        action = draws.random()
        if action < 0.6:  # a decode step's row, now and then a verification's several rows
            rows = torch.randn(1 if draws.random() < 0.85 else draws.randint(2, 5), width)
            log.append(rows)
            reference.append(rows)
            kept_pending = max(kept_pending, len(log._pending))
        elif action < 0.8:  # the drafter has read up to some position for good
            position = draws.randint(reference.start - 2, reference.end + 1)
            log.drop_before(position)
            reference.drop_before(position)
        else:  # a read of a stretch that may reach past either end
            at, count = draws.randint(reference.start - 3, reference.end), draws.randint(1, 9)
            assert torch.equal(log.at(at, count, width), reference.at(at, count, width) * 2)
        assert (log.start, log.end) == (reference.start, reference.end)
    assert torch.equal(log.features, torch.stack(reference.rows) * 2)
    assert kept_pending > 1  # rows were kept, not copied at once


def test_pending_rows_are_copied_in_once_their_count_runs_out(monkeypatch):
    monkeypatch.setattr(feature_log, "PENDING_ROWS", 4)
    log = FeatureLog(0, torch.zeros(1, 2), lambda x: x)
    rows = [torch.full((1, 2), float(i)) for i in range(1, 10)]
    for row in rows:
        log.append(row)
    assert len(log._pending) <= 4
    assert torch.equal(log.features, torch.cat([torch.zeros(1, 2), *rows]))


class KeepingDecoder(Decoder):
    """Keeps what each step hands it, as a drafter that logs features does."""

    name = "keeping"
    reads_target_hidden = True

    def __init__(self):
        self.kept: dict[str, torch.Tensor] = {}

    def observe_target_features(self, seq, first_position, features) -> None:
        self.kept[seq.request_id] = features


def handed_over(rows_in_step: int, decoding_rows: int = 1) -> dict[str, torch.Tensor]:
    """One step of a decoding sequence and a prefill filling the rest of ``rows_in_step``."""
    decoder = KeepingDecoder()
    speculator = Speculator({"keeping": decoder}, "keeping", 4, None, [0], 4096)
    decoding = Sequence("d", "d", [1, 2, 3], SamplingParams(), None)
    prefill = Sequence("p", "p", list(range(rows_in_step)), SamplingParams(), None)
    scheduled = [
        ScheduledSequence(decoding, decoding_rows),
        ScheduledSequence(prefill, rows_in_step - decoding_rows),
    ]
    hidden = TargetFeatures(torch.randn(rows_in_step, 4), (29,))
    speculator.model_layers = 30
    speculator.hand_out_features(hidden, scheduled, {}, {})
    return decoder.kept


def test_a_decode_row_is_handed_over_as_it_is_and_a_long_step_s_as_a_copy():
    short = handed_over(8)
    assert short["d"].untyped_storage().nbytes() == 8 * 4 * 4  # a view of the step's rows
    long = handed_over(target_features.HELD_STEP_ROWS + 1)
    # A kept view of one row would keep the whole step's alive: the row comes as a copy.
    assert long["d"].untyped_storage().nbytes() == 1 * 4 * 4
    assert long["p"].shape == (target_features.HELD_STEP_ROWS, 4)
