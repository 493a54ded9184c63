"""What the ingress and a replica hand each other: the request as Ray's router sees it (its
prefix hashes, read by ``server/ray_serve/router.py``), and the replica's lease on its server."""

from __future__ import annotations

from dataclasses import dataclass, field

# The header naming the replica that answered (importable without Ray, for the benches).
REPLICA_HEADER = "x-specserve-replica"


@dataclass
class ProxiedRequest:
    method: str
    path: str  # with its query string
    prefix_hashes: list[str] = field(default_factory=list)


@dataclass
class Lease:
    """A replica's answer: the address of its own server, which the ingress sends the request
    to; the replica counts the request as ongoing until the ingress ends the lease."""

    url: str
    replica_id: str
