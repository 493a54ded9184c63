"""The thread governor drops to one thread while neighbours keep the cores busy."""

from __future__ import annotations

import pytest
import torch

from engine import thread_governor
from engine.thread_governor import ThreadGovernor


class FakeMachine:
    """Fault injection: the clocks and CPU counters the governor reads."""

    def __init__(self, monkeypatch):
        self.now, self.machine, self.own = 0.0, 0.0, 0.0
        monkeypatch.setattr(thread_governor.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(thread_governor, "machine_busy_seconds", lambda: self.machine)
        monkeypatch.setattr(thread_governor, "own_busy_seconds", lambda: self.own)
        monkeypatch.setattr(thread_governor, "available_cores", lambda: 2)

    def run(self, seconds: float, ours: float, neighbours: float) -> None:
        """``seconds`` pass with our process and the neighbours busy on that many cores."""
        self.now += seconds
        self.own += ours * seconds
        self.machine += (ours + neighbours) * seconds


@pytest.fixture
def machine(monkeypatch):
    threads = torch.get_num_threads()
    yield FakeMachine(monkeypatch)
    torch.set_num_threads(threads)


def test_one_thread_while_neighbours_are_busy_then_all_again(machine):
    governor = ThreadGovernor(None)
    assert governor.adaptive and governor.threads == 2 and torch.get_num_threads() == 2
    machine.run(1.0, ours=2.0, neighbours=0.0)
    governor.tick()
    assert governor.threads == 2
    machine.run(1.0, ours=1.0, neighbours=1.5)
    governor.tick()
    assert governor.contended and torch.get_num_threads() == 1
    machine.run(1.0, ours=1.0, neighbours=0.4)  # between the two limits: stay on one thread
    governor.tick()
    assert governor.threads == 1
    machine.run(1.0, ours=1.0, neighbours=0.1)
    governor.tick()
    assert governor.threads == 2 and torch.get_num_threads() == 2


def test_checks_at_most_every_interval(machine):
    governor = ThreadGovernor(None)
    machine.run(0.1, ours=1.0, neighbours=2.0)
    governor.tick()
    assert not governor.contended  # too soon to look
    machine.run(0.5, ours=1.0, neighbours=2.0)
    governor.tick()
    assert governor.contended


def test_a_fixed_thread_count_is_kept(machine):
    governor = ThreadGovernor(2)
    assert not governor.adaptive
    machine.run(1.0, ours=1.0, neighbours=2.0)
    governor.tick()
    assert governor.threads == 2 and torch.get_num_threads() == 2


def test_without_proc_stat_all_cores_are_used(machine, monkeypatch):
    monkeypatch.setattr(thread_governor, "machine_busy_seconds", lambda: None)
    governor = ThreadGovernor(None)
    assert not governor.adaptive and governor.threads == 2
