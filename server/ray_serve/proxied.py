"""A request as the ingress hands it to a replica: what the replica's own server needs to
answer it, and the prefix hashes the router reads (``server/ray_serve/router.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ProxiedRequest:
    method: str
    path: str  # with its query string
    headers: list[tuple[str, str]]
    body: bytes
    prefix_hashes: list[str] = field(default_factory=list)


@dataclass
class ResponseStart:
    """The first item a replica yields: the status and headers of its server's answer; the
    body's chunks (bytes) follow."""

    status: int
    headers: list[tuple[str, str]]
