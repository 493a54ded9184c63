"""How many threads the engine's products use, kept sensible when the cores are shared.

With one OpenMP thread per core, every parallel region waits for all of its threads; when
another process keeps a core busy, one of ours is descheduled and each region waits a
scheduler slice for it. Measured on a 2-core VM with two busy neighbours: decode fell from
75 to 1.4 tokens/s with 2 threads, while 1 thread kept 54 (docs/benchmarks.md).

``num_threads: auto`` (the default) therefore uses every core the process may run on while
no one else needs them, and gives up one thread per core that other processes keep busy (down
to one). Every ``CHECK_INTERVAL_S`` it reads how much CPU time our cores spent (``/proc/stat``)
minus what this process and its companions (the API server) spent: the rest is the
neighbours' load, in cores. Reading two
counters costs microseconds and needs no probe work, and it also sees a neighbour that was
there before us. A fixed ``num_threads`` turns this off, as does a system without
``/proc/stat``.
"""

from __future__ import annotations

import math
import os
import resource
import time
from pathlib import Path

import torch

CHECK_INTERVAL_S = 0.5
# Steps are far shorter than this: a longer gap between two checks means the engine sat idle
# (or ran one very long prefill), and what the neighbours did meanwhile (a benchmark client
# loading its tokenizer, say) says little about the load the next steps meet. Such a window
# only starts a new one.
IDLE_GAP_S = 2.0
# Neighbours' load in cores is rounded to whole cores taken from us with these offsets: a
# neighbour past half a core costs us a thread; under a quarter of a core it gives it back (the
# gap keeps us from flapping).
BUSY_NEIGHBOURS_CORES = 0.5
FREE_NEIGHBOURS_CORES = 0.25


def allowed_cpus() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return None


def available_cores() -> int:
    cpus = allowed_cpus()
    return len(cpus) if cpus else (os.cpu_count() or 1)


def machine_busy_seconds(cpus: set[int] | None) -> float | None:
    """CPU seconds the cores we may run on spent busy since boot (None without /proc/stat).

    Per-core lines, so a busy core outside our affinity set (another container's) is not
    counted against us. Busy is user + nice + system + irq + softirq + steal; guest time is
    already inside user and nice."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        ticks = [int(v) for v in fields[:8]]
        busy += sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def process_busy_seconds(pid: int) -> float:
    """User + system CPU seconds of another process of ours (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_busy_seconds(companions: tuple[int, ...] = ()) -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime + sum(process_busy_seconds(p) for p in companions)


class ThreadGovernor:
    """``companions``: other processes whose CPU time is ours, not a neighbour's (the API
    server that feeds the engine process)."""

    def __init__(self, num_threads: int | None, companions: tuple[int, ...] = ()):
        self.fixed = num_threads
        self.max_threads = num_threads or available_cores()
        self.threads = self.max_threads
        torch.set_num_threads(self.max_threads)
        self.neighbour_cores = 0.0
        self._cpus = allowed_cpus()
        self._companions = companions
        self._last = self._sample()

    @property
    def adaptive(self) -> bool:
        return self.fixed is None and self.max_threads > 1 and self._last[1] is not None

    @property
    def contended(self) -> bool:
        return self.threads < self.max_threads

    def _sample(self) -> tuple[float, float | None, float]:
        return (
            time.monotonic(),
            machine_busy_seconds(self._cpus),
            own_busy_seconds(self._companions),
        )

    def _threads_for(self, neighbours: float, offset: float) -> int:
        return max(1, min(self.max_threads, self.max_threads - math.ceil(neighbours - offset)))

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
        if wall > IDLE_GAP_S:
            return
        self.neighbour_cores = max(0.0, others / wall)
        fewer = self._threads_for(self.neighbour_cores, BUSY_NEIGHBOURS_CORES)
        more = self._threads_for(self.neighbour_cores, FREE_NEIGHBOURS_CORES)
        if fewer < self.threads:
            threads = fewer
        else:
            threads = max(more, self.threads)
        if threads != self.threads:
            self.threads = threads
            torch.set_num_threads(threads)
