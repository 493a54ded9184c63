"""The conversations bench's think times: conversations out of step, reproducibly."""

from __future__ import annotations

import statistics

from tooling.bench.bench_conversations import think_times


def test_no_think_time_keeps_conversations_in_lockstep():
    assert think_times(3, 6, 0.0) == [0.0] * 6


def test_think_times_are_seeded_per_conversation_with_the_mean_asked():
    assert think_times(1, 6, 2.0) == think_times(1, 6, 2.0)
    assert think_times(1, 6, 2.0) != think_times(2, 6, 2.0)
    assert think_times(1, 6, 2.0, seed=1) != think_times(1, 6, 2.0)
    pauses = think_times(0, 4000, 2.0)
    assert min(pauses) >= 0 and 1.9 < statistics.fmean(pauses) < 2.1
