"""Which replica takes a request: the one with the most free KV memory, or the one that served its conversation.

A Ray Serve `RequestRouter` for the engine replicas. Each replica reports its admission state
(`EngineReplica.record_routing_stats`: KV bytes allowed minus reserved, waiting and running requests) every
`STATS_PERIOD` seconds; between two reports the router counts what it chose for each replica (each counted as
the largest average reservation of a running request), so a burst does not all land on the replica that looked
emptiest at the last report. A request with a session id (the
`X-Session-Id` header or the body's `user` field, set by the gateway) goes back to the replica that served
that session, while that replica is alive. The latest stats of every replica are kept in `reports.LATEST` for
the gateway's aggregated /metrics (the router lives in the gateway's process).
"""

from __future__ import annotations

import math

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from h2o_kv.runtime.cluster import reports

STATS_PERIOD = 0.5  # seconds between two routing-stats reports of a replica


def room(stats: dict, sent_since: int, per_request: float) -> tuple[float, float]:
    """A replica's rank key, larger first: free KV bytes less `per_request` bytes for each request sent to it
    since its last report, then fewer requests waiting, running or just sent."""
    free = stats.get("free_kv_bytes", 0.0)
    if not math.isinf(free):
        free -= sent_since * per_request
    return free, -(stats.get("waiting", 0) + stats.get("running", 0) + sent_since)


def request_bytes(replicas: list[RunningReplica]) -> float:
    """What one more request is expected to reserve: the largest average reservation of a running request."""
    shares = [r.routing_stats["kv_bytes_reserved"] / r.routing_stats["running"]
              for r in replicas if (r.routing_stats or {}).get("running")]  # fmt: skip
    return max(shares, default=0.0)


class KVRoomRouter(RequestRouter):
    """Most free KV memory first; a known session to its replica."""

    def initialize_state(self, **kwargs) -> None:
        self.sessions: dict[str, ReplicaID] = {}
        self.sent: dict[ReplicaID, int] = {}
        self.reports: dict[ReplicaID, object] = {}

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        alive = {replica.replica_id for replica in replicas}
        for replica in replicas:
            stats = replica.routing_stats or {}
            reports.LATEST[replica.replica_id.unique_id] = stats
            if self.reports.get(replica.replica_id) is not stats:  # a new report: its counts include ours
                self.reports[replica.replica_id] = stats
                self.sent[replica.replica_id] = 0
        for gone in set(reports.LATEST) - {replica.unique_id for replica in alive}:
            del reports.LATEST[gone]

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        session = pending_request.metadata.session_id if pending_request is not None else ""
        if session in self.sessions:
            same = [r for r in candidate_replicas if r.replica_id == self.sessions[session]]
            if same:
                return [same]
        per_request = request_bytes(candidate_replicas)
        ranked = sorted(
            candidate_replicas,
            key=lambda r: room(r.routing_stats or {}, self.sent.get(r.replica_id, 0), per_request),
            reverse=True,
        )
        # counted when chosen, not when routed: requests routed together are chosen before any is routed
        self.sent[ranked[0].replica_id] = self.sent.get(ranked[0].replica_id, 0) + 1
        return [[replica] for replica in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        session = pending_request.metadata.session_id
        if session:
            self.sessions[session] = replica_id
