"""The thread governor drops to one thread while neighbours keep the cores busy."""

from __future__ import annotations

import pytest
import torch

from engine import thread_governor
from engine.thread_governor import ThreadGovernor


class FakeMachine:
    """Fault injection: the clocks and CPU counters the governor reads."""

    def __init__(self, monkeypatch, cores: int = 2):
        self.now, self.machine, self.own = 0.0, 0.0, 0.0
        monkeypatch.setattr(thread_governor.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(thread_governor, "machine_busy_seconds", lambda cpus: self.machine)
        monkeypatch.setattr(thread_governor, "own_busy_seconds", lambda companions: self.own)
        monkeypatch.setattr(thread_governor, "available_cores", lambda: cores)

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


def test_load_seen_while_idle_is_not_acted_on(machine):
    governor = ThreadGovernor(None)
    # The engine idles while a neighbour is busy (a client starting up), then steps alone.
    machine.run(5.0, ours=0.0, neighbours=1.0)
    governor.tick()
    assert governor.threads == 2
    machine.run(0.6, ours=2.0, neighbours=0.0)
    governor.tick()
    assert governor.threads == 2
    # A neighbour still busy once the engine works is seen at the next check.
    machine.run(5.0, ours=0.0, neighbours=1.5)
    governor.tick()
    machine.run(0.6, ours=1.0, neighbours=1.5)
    governor.tick()
    assert governor.threads == 1


def test_a_fixed_thread_count_is_kept(machine):
    governor = ThreadGovernor(2)
    assert not governor.adaptive
    machine.run(1.0, ours=1.0, neighbours=2.0)
    governor.tick()
    assert governor.threads == 2 and torch.get_num_threads() == 2


def test_many_cores_give_up_one_thread_per_busy_core(monkeypatch):
    threads = torch.get_num_threads()
    try:
        machine = FakeMachine(monkeypatch, cores=8)
        governor = ThreadGovernor(None)
        assert governor.threads == 8
        machine.run(1.0, ours=6.0, neighbours=2.7)  # rounds to three cores taken
        governor.tick()
        assert governor.threads == 5 and torch.get_num_threads() == 5
        machine.run(1.0, ours=5.0, neighbours=2.2)  # two cores: one thread back
        governor.tick()
        assert governor.threads == 6
        machine.run(1.0, ours=5.0, neighbours=0.1)
        governor.tick()
        assert governor.threads == 8
    finally:
        torch.set_num_threads(threads)


def test_proc_stat_counts_only_our_cores_and_companions(tmp_path):
    # Real counters of this machine: plausible, and a companion's time is counted as ours.
    cpus = thread_governor.allowed_cpus()
    busy = thread_governor.machine_busy_seconds(cpus)
    assert busy is not None and busy > 0
    assert thread_governor.machine_busy_seconds({10**6}) == 0  # no such core: nothing counted
    import os

    alone = thread_governor.own_busy_seconds()
    with_parent = thread_governor.own_busy_seconds((os.getppid(),))
    assert with_parent >= alone
    assert thread_governor.process_busy_seconds(2**22 + 12345) == 0.0  # gone: nothing


def test_without_proc_stat_all_cores_are_used(machine, monkeypatch):
    monkeypatch.setattr(thread_governor, "machine_busy_seconds", lambda cpus: None)
    governor = ThreadGovernor(None)
    assert not governor.adaptive and governor.threads == 2
