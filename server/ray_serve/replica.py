"""One specserve replica in Ray Serve: the existing server and engine, unchanged, in a child
process on a port of its node, and a deployment that leases it to the ingress.

Running the whole ``specserve serve`` per replica keeps one code path for every feature
(validation and its 4xx, SSE, logprobs, constraints, the engine process and its watchdog).
A request's bytes do not pass through the replica actor: Ray's router picks the replica, whose
``__call__`` answers with a ``Lease`` (its server's address) and holds it until the ingress,
having streamed the answer from that server itself, cancels it. Carrying every SSE chunk as a
Ray object through the actor as well cost a third of the throughput on 2 cores; holding the
lease keeps Ray's count of each replica's ongoing requests (its ``max_ongoing_requests``,
autoscaling, the router's queue lengths) true. The replica reports its engine's queue and KV
usage to the router (``record_routing_stats``), answers Ray's health checks from its
server's ``/health`` (a failing replica is replaced), and registers its server's address so
the ingress can gather every replica's ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from server.ray_serve.proxied import Lease, ProxiedRequest
from server.ray_serve.registry import registry
from server.ray_serve.tethered import REASON_FILE_ENV

REPLICA_START_FAILED = "the replica's specserve serve exited"  # app.py finds it in Ray's status
START_TIMEOUT_S = 600.0  # a first start may pull the model and tune the kernels
# A lease whose ingress never ends it (the ingress died mid-request) ends by itself: only the
# replica's count of ongoing requests was wrong meanwhile.
LEASE_MAX_S = 3600.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_gauges(metrics_text: str, names: dict[str, str]) -> dict[str, float]:
    """``{key: value}`` of the gauges ``names`` ({metric name: key}) in Prometheus text."""
    found: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            try:
                found[names[name]] = found.get(names[name], 0.0) + float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return found


ROUTING_GAUGES = {
    "specserve:num_requests_running": "running",
    "specserve:num_requests_waiting": "waiting",
    "specserve:kv_cache_usage_perc": "kv_usage",
}


class SpecserveReplica:
    """The deployment class (``server/ray_serve/app.py`` wraps it with ``serve.deployment``)."""

    def __init__(self, serve_args: list[str], replica_name: str | None = None):
        from ray import serve  # the optional extra; this module is importable without it

        self.port = free_port()
        # Alone on one node, the server listens on loopback only; in a cluster the ingress
        # (on any node) reaches it at its node's address.
        self.host = "127.0.0.1" if _single_node() else _node_ip()
        context = serve.get_replica_context()
        self.replica_id = replica_name or context.replica_id.unique_id
        # Tethered: a replica Ray kills outright takes its server with it (tethered.py).
        command = [sys.executable, "-m", "server.ray_serve.tethered", str(os.getpid()),
                   self.replica_id, "serve", *serve_args, "--host", self.host,
                   "--port", str(self.port)]  # fmt: skip
        fd, self.reason_file = tempfile.mkstemp(prefix="specserve-replica-", suffix=".reason")
        os.close(fd)
        env = {**os.environ, REASON_FILE_ENV: self.reason_file}
        self.process = subprocess.Popen(command, start_new_session=True, env=env)
        self.base = f"http://{self.host}:{self.port}"
        self.client = httpx.AsyncClient(base_url=self.base, timeout=None)
        self._wait_until_ready()
        registry().add.remote(self.replica_id, self.base, _own_actor())

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code, reason = self.process.returncode, self._start_failure()
                raise RuntimeError(f"{REPLICA_START_FAILED} with {code}: {reason}")
            try:
                if httpx.get(f"{self.base}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"specserve serve did not answer /health in {START_TIMEOUT_S:.0f} s")

    def _start_failure(self) -> str:
        """The server's error line, as its tether wrote it down."""
        try:
            with open(self.reason_file) as f:
                return f.read().strip() or "(no output)"
        except OSError:
            return "(no output)"

    def _exit_if_server_gone(self) -> None:
        """A replica whose server died is of no use: end the actor, so that Ray's routers drop
        it at once (instead of at the next failed health check) and Ray starts a new one."""
        if self.process.poll() is not None:
            threading.Timer(0.2, os._exit, args=(1,)).start()  # after this call's error is sent
            raise RuntimeError(f"the replica's server exited with {self.process.returncode}")

    async def __call__(self, request: ProxiedRequest):
        """Yields a ``Lease`` on this replica's server, then holds it until cancelled."""
        self._exit_if_server_gone()
        yield Lease(self.base, self.replica_id)
        await asyncio.sleep(LEASE_MAX_S)

    async def metrics_text(self) -> str:
        return (await self.client.get("/metrics")).text

    async def check_health(self) -> None:
        """Ray calls this periodically; raising marks the replica unhealthy (it is replaced)."""
        if self.process.poll() is not None:
            raise RuntimeError(f"the replica's server exited with {self.process.returncode}")
        response = await self.client.get("/health", timeout=10.0)
        if response.status_code != 200:
            raise RuntimeError(f"the replica's server is unhealthy: {response.status_code}")

    async def record_routing_stats(self) -> dict:
        """The engine's queue and KV usage, for the router (``router.py``)."""
        try:
            return parse_gauges(await self.metrics_text(), ROUTING_GAUGES)
        except httpx.HTTPError:
            return {}

    def __del__(self):
        process = getattr(self, "process", None)
        if process is not None and process.poll() is None:
            try:
                os.killpg(process.pid, 15)
                process.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(process.pid, 9)
        if getattr(self, "reason_file", None) is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.reason_file)
        if getattr(self, "replica_id", None) is not None:
            try:
                registry().remove.remote(self.replica_id)
            except Exception:  # the cluster may be going down with us
                pass


def _node_ip() -> str:
    import ray  # the optional extra, as above

    return ray.util.get_node_ip_address()


def _own_actor():
    import ray  # the optional extra, as above

    return ray.get_runtime_context().current_actor


def _single_node() -> bool:
    import ray  # the optional extra, as above

    return len([n for n in ray.nodes() if n.get("Alive")]) <= 1
