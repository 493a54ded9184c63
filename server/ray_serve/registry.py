"""Where each replica's own server answers: a small named Ray actor the replicas write to and
the ingress reads, to gather every replica's ``/metrics`` and ``/health`` (Ray Serve's
handles reach *a* replica, never a chosen one).

A replica Ray kills outright runs no destructor and cannot unregister itself, so the registry
keeps each replica's actor handle and ``live()`` drops the entries whose actor is dead: the
application's ``/health`` lists the replicas there are, not every one there ever was.
"""

from __future__ import annotations

import asyncio

REGISTRY_NAME = "specserve-replica-registry"
NAMESPACE = "specserve"
PING_TIMEOUT_S = 2.0  # an actor that answers no ping this fast is busy, not known dead


class ReplicaRegistry:
    def __init__(self):
        self.urls: dict[str, str] = {}
        self.actors: dict[str, object] = {}

    async def add(self, replica_id: str, url: str, actor=None) -> None:
        self.urls[replica_id] = url
        if actor is not None:
            self.actors[replica_id] = actor

    async def remove(self, replica_id: str) -> None:
        self.urls.pop(replica_id, None)
        self.actors.pop(replica_id, None)

    async def all(self) -> dict[str, str]:
        return dict(self.urls)

    async def live(self) -> dict[str, str]:
        """The entries whose replica actor is alive (or busy: only a dead one is dropped)."""
        from ray.exceptions import RayActorError  # inside the actor: Ray is there

        async def dead(actor) -> bool:
            try:
                await asyncio.wait_for(actor.__ray_ready__.remote(), PING_TIMEOUT_S)
            except RayActorError:
                return True
            except TimeoutError:
                return False
            return False

        ids = list(self.actors)
        for replica_id, gone in zip(ids, await asyncio.gather(*(dead(self.actors[i]) for i in ids)),
                                    strict=True):  # fmt: skip
            if gone:
                await self.remove(replica_id)
        return dict(self.urls)


def registry():
    """The cluster's registry actor, created by whoever asks first."""
    import ray  # an optional extra: this module is importable without it

    actor = ray.remote(num_cpus=0)(ReplicaRegistry)
    return actor.options(
        name=REGISTRY_NAME, namespace=NAMESPACE, get_if_exists=True, lifetime="detached"
    ).remote()
