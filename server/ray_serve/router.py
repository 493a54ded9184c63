"""Ray Serve request router for specserve replicas: prefix affinity, else power of two choices.

A request goes to the replica that served the longest run of its leading prompt blocks
(``prefix_keys``), which most likely still holds them in its prefix cache, unless that
replica's queue is longer than the shortest candidate's by more than ``imbalance`` requests;
otherwise it goes to the shortest queue (ties broken at random). A new prefix's replica is
where the conversation will stay, so that choice must not follow stale numbers: requests
chosen but not yet routed count as queued (measured: conversations arriving together were
split 5 / 3 by Ray's own two choices, and the replica holding five thrashed its KV cache).
Queues are what the replicas report (``SpecserveReplica.record_routing_stats``: the
engine's running and waiting requests, refreshed every ``request_routing_stats_period_s``),
or, when more, the requests this router has in flight on the replica (exact and immediate,
where the reports lag a period behind).

This is SGLang's cache-aware router and Ray Serve LLM's ``PrefixCacheAffinityRouter`` in
miniature: the table of which replica served which prefix lives in the router, bounded
(least recently used entries go first), and a dead replica's entries are dropped.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from server.ray_serve.proxied import ProxiedRequest

DEFAULT_IMBALANCE = 4  # queued requests a prefix hit may cost beyond the shortest queue
MAX_ENTRIES = 200_000  # prefix blocks remembered (a few MB)
CHOSEN_TTL_S = 10.0  # a choice counts as queued until its request is routed, or this long


def hashes_of(pending_request: PendingRequest | None) -> list[str]:
    if pending_request is None:
        return []
    for arg in pending_request.args:
        if isinstance(arg, ProxiedRequest):
            return arg.prefix_hashes
    return []


def _request_id(pending_request: PendingRequest) -> str:
    metadata = getattr(pending_request, "metadata", None)
    return getattr(metadata, "internal_request_id", None) or str(id(pending_request))


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, imbalance: int = DEFAULT_IMBALANCE, max_entries: int = MAX_ENTRIES):
        self.imbalance = imbalance
        self.max_entries = max_entries
        self.owners: OrderedDict[str, ReplicaID] = OrderedDict()  # prefix hash -> replica
        self.in_flight: dict[ReplicaID, int] = {}  # requests of this router not yet ended
        # request id -> (replica, when), until the request is routed; oldest first
        self.chosen: dict[str, tuple[ReplicaID, float]] = {}
        self.affinity_hits = 0  # requests sent to the replica holding their prefix

    def queue_length(self, replica: RunningReplica) -> int:
        stats = replica.routing_stats or {}
        reported = int(stats.get("running", 0)) + int(stats.get("waiting", 0))
        ours = self.in_flight.get(replica.replica_id, 0)
        ours += sum(1 for r, _ in self.chosen.values() if r == replica.replica_id)
        return max(reported, ours)

    def holder(self, hashes: list[str], candidates: dict[ReplicaID, RunningReplica]):
        """The candidate that served the longest run of ``hashes`` (None: no candidate did)."""
        for h in reversed(hashes):
            owner = self.owners.get(h)
            if owner in candidates:
                return candidates[owner]
        return None

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        holder = self.holder(hashes_of(pending_request), by_id)
        lengths = {r.replica_id: self.queue_length(r) for r in candidate_replicas}
        shortest = min(lengths.values())
        if holder is not None and lengths[holder.replica_id] <= shortest + self.imbalance:
            self.affinity_hits += 1
            best = holder
        else:
            best = random.choice(
                [r for r in candidate_replicas if lengths[r.replica_id] == shortest]
            )
        now = time.monotonic()
        if pending_request is not None:
            self.chosen[_request_id(pending_request)] = (best.replica_id, now)
        # A choice never routed (its request cancelled while waiting) stops counting.
        while self.chosen and next(iter(self.chosen.values()))[1] < now - CHOSEN_TTL_S:
            self.chosen.pop(next(iter(self.chosen)))
        others = [r for r in candidate_replicas if r is not best]
        return [[best], others] if others else [[best]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result):
        self.chosen.pop(_request_id(pending_request), None)
        self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1
        for h in hashes_of(pending_request):
            self.owners[h] = replica_id
            self.owners.move_to_end(h)
        while len(self.owners) > self.max_entries:
            self.owners.popitem(last=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.in_flight.get(replica_id, 0) > 0:
            self.in_flight[replica_id] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self.in_flight.pop(replica_id, None)
        self.chosen = {k: v for k, v in self.chosen.items() if v[0] != replica_id}
        for h in [h for h, owner in self.owners.items() if owner == replica_id]:
            del self.owners[h]
