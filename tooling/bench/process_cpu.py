"""Where a load's CPU went, by role: which processes of a Ray Serve deployment (or of plain
``specserve serve``) spent the machine's cores. Read from ``/proc`` (Linux), so the bench can
say what Ray's proxy and the ingress cost per token instead of inferring it from wall time."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ROLES = ("engines", "servers", "Ray proxy", "ingress", "replica actors", "Ray's other processes")


@dataclass(frozen=True)
class _Process:
    name: str  # /proc/PID/stat's comm: Ray names its actors' processes "ray::<actor>"
    command: str
    parent: int
    cpu_s: float  # user + system
    started: int = 0  # clock ticks after boot: with the pid, names one process for good


def _processes() -> dict[int, _Process]:
    ticks = os.sysconf("SC_CLK_TCK")
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        # fields[1] is the parent (stat's 4th field); [11], [12]: user and system ticks;
        # [19]: the start time (the 22nd).
        found[int(entry.name)] = _Process(
            name, command, int(fields[1]), (int(fields[11]) + int(fields[12])) / ticks,
            int(fields[19]),
        )
    return found


def role_of(pid: int, processes: dict[int, _Process]) -> str | None:
    """The role of a process in a specserve deployment, or None for anything else."""
    p = processes[pid]
    if p.name.startswith("ray::ProxyActor") or p.name == "haproxy":  # --ray-proxy haproxy
        return "Ray proxy"
    if p.name.startswith("ray::ServeRepli"):  # comm is cut to 15 characters
        return "ingress" if "specserve-ingress" in p.command else "replica actors"
    serving = (".cli serve", "specserve serve", "server.ray_serve.tethered")  # our entry points
    if any(s in p.command for s in serving):
        # `serve --replicas` itself only drives the cluster.
        return "Ray's other processes" if "--replicas" in p.command else "servers"
    if "spawn_main" in p.command and p.parent in processes:
        if role_of(p.parent, processes) == "servers":
            return "engines"  # the engine process a server spawned
    if p.name.startswith("ray::") or "/ray/" in p.command or p.name in ("raylet", "gcs_server"):
        return "Ray's other processes"
    return None


Reading = dict[tuple[int, int], tuple[str, float]]  # (pid, start) -> (role, CPU seconds)


def cpu_by_role() -> Reading:
    """CPU seconds so far of every live process with a role."""
    processes = _processes()
    reading = {}
    for pid, process in processes.items():
        role = role_of(pid, processes)
        if role is not None:
            reading[pid, process.started] = (role, process.cpu_s)
    return reading


def spent(before: Reading, after: Reading) -> dict[str, float]:
    """CPU seconds each role spent between two readings, process by process: one that began
    meanwhile counts whole, one that ended meanwhile is missing (its last share is lost)."""
    totals = dict.fromkeys(ROLES, 0.0)
    for key, (role, seconds) in after.items():
        earlier = before.get(key, (role, 0.0))[1]
        totals[role] += max(seconds - earlier, 0.0)
    return totals
