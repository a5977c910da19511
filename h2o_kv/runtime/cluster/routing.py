"""Which replica takes a request: the one that holds its longest kept prefix, weighed against free KV memory, or
the one that served its conversation.

A Ray Serve `RequestRouter` for the engine replicas. Each replica reports its admission state and the fingerprints
of the sequences its prefix store keeps (`EngineReplica.record_routing_stats`: KV bytes allowed minus reserved,
waiting and running requests, batch slots, (length, fingerprint) per kept sequence) every `STATS_PERIOD` seconds.
The gateway sends each completion's prompt fingerprints with the call (`prompts.py`); the rule that weighs the
prompt tokens a replica would not prefill against how full it is lives in `affinity.py` (pure, tested alone).

Requests the router chose for a replica after its last report, and still in flight, count against its room (each
as the average reservation of a running request), so a burst does not all land on the replica that looked emptiest
at the last report. A request stops counting as soon as the gateway has relayed its answer to the end
(`reports.finished`), not only when Ray Serve's completion callback comes: that callback can come after the client's
next request is routed, and one finished request counted as in flight made the replica with room look as full as the
busy one. A request with a session id (the `X-Session-Id` header or the body's `user` field, set by the gateway)
goes back to the replica that served that session, while that replica is alive. The latest stats of every replica
are kept in `reports.LATEST` for the gateway's aggregated /metrics (the router lives in the gateway's process).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from h2o_kv.runtime.cluster import affinity, reports

STATS_PERIOD = 0.5  # seconds between two routing-stats reports of a replica
SESSIONS = 100_000  # conversations remembered for stickiness (the oldest forgotten first)


def view(stats: dict, sent_since: int, per_request: float, unknown: float, reused: int) -> affinity.Replica:
    """What the choice rule needs of a replica from its last report: free KV bytes less `per_request` bytes for
    each request sent to it since, its requests (waiting, running, just sent), its KV limit and batch slots, and
    the `reused` prompt tokens it holds. A replica that has not reported yet (just started) counts `unknown` free
    bytes and no limit (empty)."""
    free = stats.get("free_kv_bytes", unknown)
    if not math.isinf(free):
        free -= sent_since * per_request
    allowed = stats.get("kv_bytes_allowed")
    return affinity.Replica(
        free=free, allowed=math.inf if allowed is None else float(allowed),
        requests=stats.get("waiting", 0) + stats.get("running", 0) + sent_since,
        slots=stats.get("max_batch", 0), reused=reused,
    )  # fmt: skip


def request_bytes(replicas: list[RunningReplica]) -> float:
    """What one more request is expected to reserve: the average reservation of the running requests."""
    stats = [r.routing_stats or {} for r in replicas]
    running = sum(s.get("running", 0) for s in stats)
    return sum(s.get("kv_bytes_reserved", 0) for s in stats) / running if running else 0.0


class KVRoomRouter(RequestRouter):
    """A known session to its replica; else the least cost (affinity.cost): room, prefill saved against fill."""

    def initialize_state(self, **kwargs) -> None:
        self.sessions: OrderedDict[str, ReplicaID] = OrderedDict()  # the most recent SESSIONS conversations
        # internal request id -> (replica, when chosen, the Serve request id the gateway reports finished)
        self.flight: dict[str, tuple[ReplicaID, float, str]] = {}
        self.reports: dict[ReplicaID, tuple[object, float]] = {}  # replica -> (its last stats, when they came)
        self.kept: dict[ReplicaID, affinity.Kept] = {}  # replica -> its last report's kept sequences, indexed

    def unreported(self, replica_id: ReplicaID) -> int:
        """Requests in flight to the replica, chosen after its last report (so not yet in its stats), whose answers
        the gateway has not finished relaying."""
        since = self.reports.get(replica_id, (None, 0.0))[1]
        return sum(
            1
            for rid, at, request in self.flight.values()
            if rid == replica_id and at > since and not reports.finished(request)
        )

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        alive = {replica.replica_id for replica in replicas}
        for replica in replicas:
            self.note(replica.replica_id, replica.routing_stats or {})
        for gone in set(reports.LATEST) - {replica.unique_id for replica in alive}:
            del reports.LATEST[gone]
        self.flight = {rid: entry for rid, entry in self.flight.items() if entry[0] in alive}
        self.kept = {rid: kept for rid, kept in self.kept.items() if rid in alive}

    def note(self, replica_id: ReplicaID, stats: dict) -> None:
        """A replica's stats as Ray Serve passed them on: kept for /metrics, and when new, timed and indexed."""
        reports.LATEST[replica_id.unique_id] = stats
        if self.reports.get(replica_id, (None,))[0] is not stats:  # a new report
            self.reports[replica_id] = (stats, time.monotonic())
            self.kept[replica_id] = affinity.Kept(stats.get("kept"))

    def holds(self, replica_id: ReplicaID, prompt: affinity.Prompt | None) -> int:
        """Prompt tokens the replica's last report says it holds; 0 when that report is older than
        `affinity.STALE_S` (the replica may be stuck) or there is none."""
        stats, when = self.reports.get(replica_id, (None, 0.0))
        if prompt is None or stats is None or time.monotonic() - when > affinity.STALE_S:
            return 0
        return affinity.reused(prompt, self.kept.get(replica_id))

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        session = pending_request.metadata.session_id if pending_request is not None else ""
        if session in self.sessions:
            same = [r for r in candidate_replicas if r.replica_id == self.sessions[session]]
            if same:
                return [same]
        prompt = pending_request.kwargs.get("prompt") if pending_request is not None else None
        per_request = request_bytes(candidate_replicas)
        # a replica that has not reported yet is new, so as empty as the emptiest one that has
        unknown = max(((r.routing_stats or {}).get("free_kv_bytes", 0.0) for r in candidate_replicas), default=0.0)
        views = [view(r.routing_stats or {}, self.unreported(r.replica_id), per_request, unknown,
                      self.holds(r.replica_id, prompt)) for r in candidate_replicas]  # fmt: skip
        tokens = prompt.length if prompt is not None else 0
        ranked = [candidate_replicas[i] for i in affinity.order(views, tokens, per_request)]
        if pending_request is not None:  # counted when chosen: requests routed together are all chosen first
            meta = pending_request.metadata
            self.flight[meta.internal_request_id] = (ranked[0].replica_id, time.monotonic(), meta.request_id)
        return [[replica] for replica in ranked]

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        entry = self.flight.pop(internal_request_id, None)
        if entry is not None:
            reports.forget(entry[2])

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        meta = pending_request.metadata
        chosen = self.flight.get(meta.internal_request_id, (None, time.monotonic()))[1]
        self.flight[meta.internal_request_id] = (replica_id, chosen, meta.request_id)
        session = pending_request.metadata.session_id
        if session:
            self.sessions[session] = replica_id
            self.sessions.move_to_end(session)
            if len(self.sessions) > SESSIONS:
                self.sessions.popitem(last=False)
