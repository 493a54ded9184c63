"""Ray Serve request router for specserve replicas: prefix affinity, else power of two choices.

A request goes to the replica that served the longest run of its leading prompt blocks
(``prefix_keys``), which most likely still holds them in its prefix cache, unless that
replica's queue is longer than the shortest candidate's by more than ``imbalance`` requests;
otherwise two random candidates are offered and Ray Serve sends it to the one with the shorter
queue (the default policy's rule). Queues are what the replicas report
(``SpecserveReplica.record_routing_stats``: the engine's running and waiting requests,
refreshed every ``request_routing_stats_period_s``), or, when more, the requests this router
has in flight on the replica (exact and immediate, where the reports lag a period behind).

This is SGLang's cache-aware router and Ray Serve LLM's ``PrefixCacheAffinityRouter`` in
miniature: the table of which replica served which prefix lives in the router, bounded
(least recently used entries go first), and a dead replica's entries are dropped.
"""

from __future__ import annotations

import random
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from server.ray_serve.proxied import ProxiedRequest

DEFAULT_IMBALANCE = 4  # queued requests a prefix hit may cost beyond the shortest queue
MAX_ENTRIES = 200_000  # prefix blocks remembered (a few MB)


def hashes_of(pending_request: PendingRequest | None) -> list[str]:
    if pending_request is None:
        return []
    for arg in pending_request.args:
        if isinstance(arg, ProxiedRequest):
            return arg.prefix_hashes
    return []


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, imbalance: int = DEFAULT_IMBALANCE, max_entries: int = MAX_ENTRIES):
        self.imbalance = imbalance
        self.max_entries = max_entries
        self.owners: OrderedDict[str, ReplicaID] = OrderedDict()  # prefix hash -> replica
        self.in_flight: dict[ReplicaID, int] = {}  # requests of this router not yet ended
        self.affinity_hits = 0  # requests sent to the replica holding their prefix

    def queue_length(self, replica: RunningReplica) -> int:
        stats = replica.routing_stats or {}
        reported = int(stats.get("running", 0)) + int(stats.get("waiting", 0))
        return max(reported, self.in_flight.get(replica.replica_id, 0))

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
        if holder is not None:
            shortest = min(self.queue_length(r) for r in candidate_replicas)
            if self.queue_length(holder) <= shortest + self.imbalance:
                self.affinity_hits += 1
                others = [r for r in candidate_replicas if r is not holder]
                return [[holder], others] if others else [[holder]]
        # Power of two choices: Ray Serve takes the shorter queue of the two it is offered.
        return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result):
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
        for h in [h for h, owner in self.owners.items() if owner == replica_id]:
            del self.owners[h]
