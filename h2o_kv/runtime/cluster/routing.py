"""Which replica takes a request: the one with the most free KV memory, or the one that served its conversation.

A Ray Serve `RequestRouter` for the engine replicas. Each replica reports its admission state
(`EngineReplica.record_routing_stats`: KV bytes allowed minus reserved, waiting and running requests) every
`STATS_PERIOD` seconds; between two reports the router counts what it sent to each replica, so a burst does
not all land on the replica that looked emptiest at the last report. A request with a session id (the
`X-Session-Id` header or the body's `user` field, set by the gateway) goes back to the replica that served
that session, while that replica is alive. The latest stats of every replica are kept in `reports.LATEST` for
the gateway's aggregated /metrics (the router lives in the gateway's process).
"""

from __future__ import annotations

import math

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from h2o_kv.runtime.cluster import reports

STATS_PERIOD = 0.5  # seconds between two routing-stats reports of a replica


def room(stats: dict, sent_since: int) -> tuple[float, float]:
    """A replica's rank key, larger first: free KV bytes, less the requests sent since its last report (each
    counted as an average running request), then fewer requests waiting or running."""
    free = stats.get("free_kv_bytes", 0.0)
    running = stats.get("running", 0)
    per_request = stats.get("kv_bytes_reserved", 0) / running if running else 0.0
    if not math.isinf(free):
        free -= sent_since * per_request
    return free, -(stats.get("waiting", 0) + stats.get("running", 0) + sent_since)


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
        ranked = sorted(
            candidate_replicas,
            key=lambda r: room(r.routing_stats or {}, self.sent.get(r.replica_id, 0)),
            reverse=True,
        )
        return [[replica] for replica in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self.sent[replica_id] = self.sent.get(replica_id, 0) + 1
        session = pending_request.metadata.session_id
        if session:
            self.sessions[session] = replica_id
