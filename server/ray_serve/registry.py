"""Where each replica's own server answers: a small named Ray actor the replicas write to and
the ingress reads, to gather every replica's ``/metrics`` and ``/health`` (Ray Serve's
handles reach *a* replica, never a chosen one)."""

from __future__ import annotations

REGISTRY_NAME = "specserve-replica-registry"
NAMESPACE = "specserve"


class ReplicaRegistry:
    def __init__(self):
        self.urls: dict[str, str] = {}

    def add(self, replica_id: str, url: str) -> None:
        self.urls[replica_id] = url

    def remove(self, replica_id: str) -> None:
        self.urls.pop(replica_id, None)

    def all(self) -> dict[str, str]:
        return dict(self.urls)


def registry():
    """The cluster's registry actor, created by whoever asks first."""
    import ray  # an optional extra: this module is importable without it

    actor = ray.remote(num_cpus=0)(ReplicaRegistry)
    return actor.options(
        name=REGISTRY_NAME, namespace=NAMESPACE, get_if_exists=True, lifetime="detached"
    ).remote()
