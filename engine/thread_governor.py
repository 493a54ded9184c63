"""How many threads the engine's products use, kept sensible when the cores are shared.

With one OpenMP thread per core, every parallel region waits for all of its threads; when
another process keeps a core busy, one of ours is descheduled and each region waits a
scheduler slice for it. Measured on a 2-core VM with two busy neighbours: decode fell from
75 to 1.4 tokens/s with 2 threads, while 1 thread kept 54 (docs/benchmarks.md).

``num_threads: auto`` (the default) therefore uses every core the process may run on while
no one else needs them, and one thread while other processes keep cores busy. Every
``CHECK_INTERVAL_S`` it reads how much CPU time the machine spent (``/proc/stat``) minus what
this process spent (``getrusage``): the rest is the neighbours' load, in cores. Reading two
counters costs microseconds and needs no probe work, and it also sees a neighbour that was
there before us. A fixed ``num_threads`` turns this off, as does a system without
``/proc/stat``.
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import torch

CHECK_INTERVAL_S = 0.5
# Neighbours using more than this many cores make us drop to one thread; below the lower
# figure we use every core again (the gap keeps us from flapping).
BUSY_NEIGHBOURS_CORES = 0.5
FREE_NEIGHBOURS_CORES = 0.25


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def machine_busy_seconds() -> float | None:
    """CPU seconds all cores spent busy since boot, or None where /proc/stat is missing."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal ...: everything but idle and iowait.
    ticks = [int(v) for v in fields[1:]]
    busy = sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)
    return busy / os.sysconf("SC_CLK_TCK")


def own_busy_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class ThreadGovernor:
    def __init__(self, num_threads: int | None):
        self.fixed = num_threads
        self.max_threads = num_threads or available_cores()
        torch.set_num_threads(self.max_threads)
        self.contended = False
        self.neighbour_cores = 0.0
        self._last = self._sample()

    @property
    def adaptive(self) -> bool:
        return self.fixed is None and self.max_threads > 1 and self._last[1] is not None

    @property
    def threads(self) -> int:
        return 1 if self.contended else self.max_threads

    @staticmethod
    def _sample() -> tuple[float, float | None, float]:
        return time.monotonic(), machine_busy_seconds(), own_busy_seconds()

    def tick(self) -> None:
        """Call before each step: now and then re-reads the load and sets the thread count."""
        if not self.adaptive:
            return
        now = time.monotonic()
        if now - self._last[0] < CHECK_INTERVAL_S:
            return
        sample = self._sample()
        wall = sample[0] - self._last[0]
        others = (sample[1] - self._last[1]) - (sample[2] - self._last[2])
        self._last = sample
        self.neighbour_cores = max(0.0, others / wall)
        limit = FREE_NEIGHBOURS_CORES if self.contended else BUSY_NEIGHBOURS_CORES
        contended = self.neighbour_cores > limit
        if contended != self.contended:
            self.contended = contended
            torch.set_num_threads(self.threads)
