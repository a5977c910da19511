"""The cluster's routing without Ray running (runtime/cluster): the fingerprints of kept sequences and of prompts,
the choice rule (affinity.py: room, then prefill saved against fill), the router's use of its replicas' reports
(routing.py), the gateway's tokenization (prompts.py, checked against the replica's own app) and its key and body
checks. The same cluster started on 127.0.0.1 is tests/runtime/test_cluster.py."""

from __future__ import annotations

import asyncio
import json
import pickle
import random
import time
from collections import namedtuple
from types import SimpleNamespace

import pytest

from h2o_kv.runtime.cluster.affinity import STALE_S, Kept, Prompt, Replica, cost, order, reused
from h2o_kv.runtime.prefixes import BLOCK, PrefixStore, fingerprint

from serve_helpers import MODEL, tiny_model

Rid = namedtuple("Rid", "unique_id")  # stands in for Ray Serve's ReplicaID (hashable, with its unique_id)


def ids(count: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(count)]


def test_a_prompt_fingerprints_each_prefix_as_the_store_does():
    """`Prompt.at(n)` (the gateway's chain plus at most one digest) equals `fingerprint` of the first n ids, across
    block boundaries; another sequence of the same length has another fingerprint; a pickled prompt (as Ray sends
    it) leaves its memo behind."""
    tokens = ids(3 * BLOCK + 5)
    prompt = Prompt.of(tokens)
    assert prompt.length == len(tokens)
    for n in range(1, len(tokens) + 1):
        assert prompt.at(n) == fingerprint(tokens[:n]), n
    assert pickle.loads(pickle.dumps(prompt)) == Prompt.of(tokens)  # sent on without its memo of digests
    other = tokens[:BLOCK] + [tokens[BLOCK] + 1] + tokens[BLOCK + 1 :]
    assert fingerprint(other) != fingerprint(tokens) and fingerprint(other[:BLOCK]) == fingerprint(tokens[:BLOCK])


class _Cache:
    """Stands in for a KVCache in the store: what it has seen and its size."""

    def __init__(self, seen: int, size: int) -> None:
        self.seen_tokens, self.size = seen, size

    def nbytes(self) -> int:
        return self.size

    def fork(self):
        return self


def test_the_store_publishes_what_it_keeps_newest_first():
    """`kept`: (length, fingerprint) per kept sequence, the most recently used first; what is dropped goes."""
    store = PrefixStore(budget=100)
    first, second = ids(40, seed=1), ids(70, seed=2)
    store.put("h2o", first, _Cache(40, 40))
    store.put("h2o", second, _Cache(70, 40))
    assert store.kept == ((70, fingerprint(second)), (40, fingerprint(first)))
    assert store.checkout("h2o", first + [7]) is not None  # the first is used: newest now
    assert store.kept == ((40, fingerprint(first)), (70, fingerprint(second)))
    store.evict(40)  # the least recently used (the second) goes
    assert store.kept == ((40, fingerprint(first)),)


def test_a_replica_holds_its_longest_kept_proper_prefix_of_the_prompt():
    tokens = ids(100)
    prompt = Prompt.of(tokens)
    kept = Kept([(40, fingerprint(tokens[:40])), (70, fingerprint(tokens[:70])), (90, fingerprint(ids(90, 5)))])
    assert reused(prompt, kept) == 70  # the 90 kept are another conversation's
    assert reused(prompt, Kept([(100, fingerprint(tokens))])) == 0  # the whole prompt: nothing left to prefill
    assert reused(prompt, Kept([])) == reused(prompt, None) == reused(None, kept) == 0


ROOM = 1000.0  # KV bytes of each replica in the rule's tests


def test_the_longest_match_wins_when_its_replica_has_room():
    holder = Replica(free=600.0, allowed=ROOM, requests=2, reused=80)
    empty = Replica(free=ROOM, allowed=ROOM)
    assert order([empty, holder], 100, need=200.0) == [1, 0]  # 20 to prefill + 40 of fill < 100 to prefill
    other = Replica(free=600.0, allowed=ROOM, requests=2, reused=40)
    assert order([other, holder], 100, need=200.0) == [1, 0]  # as full: the longer match


def test_free_memory_wins_when_the_match_is_small_or_the_holder_is_full():
    empty = Replica(free=ROOM, allowed=ROOM)
    small = Replica(free=400.0, allowed=ROOM, requests=3, reused=30)
    assert order([small, empty], 100, need=200.0) == [1, 0]  # 70 + 60 of fill > 100
    full = Replica(free=100.0, allowed=ROOM, requests=4, reused=99)
    busy = Replica(free=300.0, allowed=ROOM, requests=3)
    assert cost(full, 100, need=200.0)[0] and not cost(busy, 100, need=200.0)[0]
    assert order([full, busy], 100, need=200.0) == [1, 0]  # no room for it: it would wait there


def test_without_a_kv_limit_fill_is_the_share_of_batch_slots():
    assert Replica(requests=2, slots=4).fill() == 0.5 and Replica(requests=9, slots=4).fill() == 1.0
    assert Replica(requests=3).fill() == 0.0  # slots unknown
    assert order([Replica(requests=3, slots=4), Replica(requests=1, slots=4, reused=10)], 100, need=0.0) == [1, 0]


def _router(*reports):
    """A KVRoomRouter without Ray Serve (its own state only), each (replica id, stats) noted as a report."""
    pytest.importorskip("ray.serve")
    from h2o_kv.runtime.cluster import reports as shared
    from h2o_kv.runtime.cluster.routing import KVRoomRouter

    router = object.__new__(KVRoomRouter)
    router.initialize_state()
    for rid, stats in reports:
        router.note(rid, stats)
        shared.LATEST.pop(rid.unique_id)  # the gateway's /metrics is not this test's
    return router


def _choose(router, prompt: Prompt | None, replicas: dict, session: str = "") -> list:
    """The unique ids of the replicas in the router's order, for one request."""
    candidates = [SimpleNamespace(replica_id=rid, routing_stats=stats) for rid, stats in replicas.items()]
    meta = SimpleNamespace(session_id=session, internal_request_id="i-1", request_id="r-1")
    ranked = asyncio.run(router.choose_replicas(candidates, SimpleNamespace(metadata=meta, kwargs={"prompt": prompt})))
    router.flight.clear()  # not counted against the replica chosen (in-flight counting has its own test)
    return [group[0].replica_id.unique_id for group in ranked]


def _stats(free: float, running: int = 0, kept=()) -> dict:
    return {"free_kv_bytes": free, "kv_bytes_allowed": ROOM, "running": running, "waiting": 0,
            "kv_bytes_reserved": ROOM - free, "max_batch": 4, "kept": kept}  # fmt: skip


def test_the_router_sends_a_conversation_to_the_replica_holding_it_unless_its_report_is_stale():
    a, b, new = Rid("a"), Rid("b"), Rid("new")
    tokens = ids(100)
    holder = _stats(800.0, running=1, kept=((80, fingerprint(tokens[:80])),))
    replicas = {b: _stats(ROOM), a: holder}
    router = _router(*replicas.items())
    assert _choose(router, Prompt.of(tokens), replicas) == ["a", "b"]
    assert _choose(router, Prompt.of(ids(100, seed=3)), replicas) == ["b", "a"]  # another conversation: by room
    assert _choose(router, None, replicas) == ["b", "a"]  # no prompt (not a completion): by room
    # a replica that has not reported yet counts as empty and holding nothing
    assert _choose(router, Prompt.of(ids(100, seed=3)), {a: holder, new: None}) == ["new", "a"]
    stats, _ = router.reports[a]
    # its last report came long ago: what it holds is not counted
    router.reports[a] = (stats, time.monotonic() - STALE_S - 1)
    assert router.holds(a, Prompt.of(tokens)) == 0 and _choose(router, Prompt.of(tokens), replicas) == ["b", "a"]


def test_a_session_still_goes_back_to_its_replica():
    a, b = Rid("a"), Rid("b")
    tokens = ids(100)
    replicas = {a: _stats(200.0, running=3), b: _stats(ROOM, kept=((80, fingerprint(tokens[:80])),))}
    router = _router(*replicas.items())
    router.sessions["alice"] = a
    assert _choose(router, Prompt.of(tokens), replicas, session="alice") == ["a"]


def test_a_replicas_view_counts_the_requests_sent_since_its_report():
    """Free KV bytes less the expected bytes of requests sent since the last report; a replica that has not
    reported yet (just started) counts as free as the emptiest one, not as full."""
    pytest.importorskip("ray.serve")
    from h2o_kv.runtime.cluster.routing import request_bytes, view

    busy = {"free_kv_bytes": 600.0, "kv_bytes_allowed": 1000, "running": 2, "waiting": 0, "kv_bytes_reserved": 400}
    idle = {"free_kv_bytes": 1000.0, "kv_bytes_allowed": 1000, "running": 0, "waiting": 0, "kv_bytes_reserved": 0}
    per_request = request_bytes([SimpleNamespace(routing_stats=s) for s in (busy, idle, None)])
    assert per_request == 200.0  # 400 bytes reserved by 2 running requests
    assert order([view(busy, 0, per_request, 1000.0, 0), view(idle, 0, per_request, 1000.0, 0)], 0, 200.0) == [1, 0]
    sent = view(idle, 3, per_request, 1000.0, 0)  # 3 just sent: 400 left
    assert (sent.free, sent.requests) == (400.0, 3)
    assert order([sent, view(busy, 0, per_request, 1000.0, 0)], 0, 200.0) == [1, 0]
    assert view({}, 0, per_request, 1000.0, 0) == Replica(free=1000.0)  # unreported: the emptiest, no limit known
    assert view({}, 1, per_request, 1000.0, 0).free == 800.0


def test_the_gateway_tokenizes_as_the_replicas_app_does(tokenizer, tmp_path):
    """`prompts.token_ids` (the gateway, with the tokenizer loaded from the model's folder) gives the ids the
    replica's app submits to its engine: a completion's text or ids, a chat's messages; None where the app
    refuses the body or the route has no prompt."""
    from fastapi.testclient import TestClient

    from h2o_kv.runtime.cluster import prompts
    from h2o_kv.runtime.engine import Engine
    from h2o_kv.runtime.serve.app import create_app

    tokenizer.save_pretrained(tmp_path)
    gateway = prompts.load_tokenizer(str(tmp_path))
    engine = Engine(tiny_model(tokenizer), tokenizer, policy="full", max_batch=1)
    submitted: list[list[int]] = []
    submit = engine.submit
    engine.submit = lambda ids, **kw: submitted.append(list(ids)) or submit(ids, **kw)
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there!"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": [{"type": "text", "text": "More."}]},
    ]
    bodies = [("/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1}),
              ("/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1}),
              ("/v1/chat/completions", {"model": MODEL, "messages": chat, "max_tokens": 1})]  # fmt: skip
    with TestClient(create_app(engine, MODEL)) as http:
        for path, body in bodies:
            assert http.post(path, json=body).status_code == 200
    expected = [prompts.token_ids(gateway, path, json.dumps(body).encode()) for path, body in bodies]
    assert expected == submitted and all(expected)
    refused = [("/v1/completions", b"not json"), ("/v1/completions", b'{"model": "tiny", "prompt": ""}'),
               ("/v1/chat/completions", b'{"model": "tiny", "messages": []}'), ("/v1/models", b"")]  # fmt: skip
    assert [prompts.token_ids(gateway, path, body) for path, body in refused] == [None] * 4
    assert prompts.fingerprint(gateway, *refused[0]) is None
    assert prompts.fingerprint(gateway, "/v1/completions", json.dumps(bodies[1][1]).encode()) == Prompt.of([5, 6, 7])


class _FakeReplicas:
    """Stands in for the replicas' deployment handle: records the calls, answers 200 with a fixed body."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.prompts: list = []
        self.options_seen: list[dict] = []

    def options(self, **options):
        self.options_seen.append(options)
        return self

    @property
    def forward(self):
        return self

    def remote(self, *call, prompt=None):
        self.calls.append(call)
        self.prompts.append(prompt)

        async def parts():
            yield {"status": 200, "headers": [(b"content-type", b"application/json")]}
            yield b'{"ok": true}'

        return parts()


def test_the_gateway_checks_keys_and_names_the_session_and_the_prompt(tokenizer):
    """The gateway's key check (every route but /health), the session it hands the router, and the prompt's
    fingerprints (a completion's, with the tokenizer; none for another route)."""
    from fastapi.testclient import TestClient

    from h2o_kv.runtime.cluster.gateway import build_gateway

    fake = _FakeReplicas()
    with TestClient(build_gateway(fake, ["secret"], tokenizer=tokenizer)) as http:
        refused = http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert http.get("/metrics").status_code == 401 and not fake.calls
        assert http.get("/health").json() == {"ok": True}
        keyed = {"Authorization": "Bearer secret"}
        body = {"model": MODEL, "prompt": "x y", "user": "ann"}
        assert http.post("/v1/completions", json=body, headers=keyed).status_code == 200
        http.post("/v1/completions", json={"prompt": "x", "user": "ann"}, headers={**keyed, "X-Session-Id": "s1"})
        assert http.get("/metrics", headers=keyed).status_code == 200
    assert [o["session_id"] for o in fake.options_seen] == ["", "ann", "s1"]
    method, path, headers, _ = fake.calls[1]
    assert (method, path) == ("POST", "/v1/completions")
    assert all(name != b"authorization" for name, _ in headers)  # the key stays at the gateway
    assert fake.prompts[0] is None  # /health: no prompt
    assert fake.prompts[1] == Prompt.of(tokenizer("x y")["input_ids"])
    assert fake.prompts[2] is None  # no model field: the replica refuses it (400), nothing to match


def test_the_gateway_bounds_a_body_before_reading_it():
    """A body over the bound (413) or without a length (411) never reaches a replica."""
    from fastapi.testclient import TestClient

    from h2o_kv.runtime.cluster.gateway import build_gateway

    fake = _FakeReplicas()
    with TestClient(build_gateway(fake, [], max_body_bytes=100)) as http:
        big = http.post("/v1/completions", json={"prompt": "x" * 200})
        assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large"
        chunked = http.post("/v1/completions", content=iter([b'{"prompt": "x"}']))
        assert chunked.status_code == 411
        assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 200
    assert len(fake.calls) == 1


def test_a_request_the_gateway_finished_no_longer_counts_against_its_replica():
    """Ray Serve's completion callback can come after the client's next request is routed; a request whose answer
    the gateway has relayed to the end (`reports.finish`) stops counting against its replica at once, so a replica
    with room does not look as full as a busy one (the cause of a flaky routing test)."""
    pytest.importorskip("ray.serve")
    from h2o_kv.runtime.cluster import reports
    from h2o_kv.runtime.cluster.routing import KVRoomRouter

    router = SimpleNamespace(reports={}, flight={"internal-1": ("free", 1.0, "req-1"), "internal-2": ("free", 1.0, "")})
    assert KVRoomRouter.unreported(router, "free") == 2
    reports.finish("req-1")
    assert KVRoomRouter.unreported(router, "free") == 1 and reports.finished("req-1")
    KVRoomRouter.on_request_completed(router, "free", "internal-1")  # Ray Serve's word comes late: the id is forgotten
    assert not reports.finished("req-1") and KVRoomRouter.unreported(router, "free") == 1
    reports.finish("")  # no request id: nothing to remember
    assert KVRoomRouter.unreported(router, "free") == 1


class _Call:
    """One call's answer as the deployment handle gives it: async iteration over its parts, `cancel`, its request id;
    `lost` makes its first part raise as a replica Ray cannot reach does."""

    def __init__(self, request_id: str, lost: Exception | None) -> None:
        self.request_id, self.lost, self.cancelled = request_id, lost, False
        self.parts = iter([{"status": 200, "headers": [(b"content-type", b"application/json")]}, b'{"ok": true}'])

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.lost is not None:
            raise self.lost
        try:
            return next(self.parts)
        except StopIteration:
            raise StopAsyncIteration from None

    def cancel(self) -> None:
        self.cancelled = True


class _FlakyReplicas(_FakeReplicas):
    """The first call's replica is unreachable (it may still be running the request); the next one answers."""

    def __init__(self) -> None:
        super().__init__()
        self.answers: list[_Call] = []

    def remote(self, *call, prompt=None):
        from ray.exceptions import ActorUnavailableError

        self.calls.append(call)
        lost = ActorUnavailableError("the replica did not answer in time", None) if len(self.calls) == 1 else None
        self.answers.append(_Call(f"req-{len(self.calls)}", lost))
        return self.answers[-1]


def test_a_request_whose_replica_is_lost_is_sent_again_and_the_lost_call_cancelled():
    """Ray reports a replica it cannot reach for a while (ActorUnavailableError) that may still run the request: the
    gateway sends the request again and cancels the call it gave up on, so the request does not also run there (as a
    flaky cluster test once saw: a held stream on both replicas), nor counts against that replica."""
    pytest.importorskip("ray.serve")
    from fastapi.testclient import TestClient

    from h2o_kv.runtime.cluster import reports
    from h2o_kv.runtime.cluster.gateway import build_gateway

    fake = _FlakyReplicas()
    with TestClient(build_gateway(fake, [])) as http:
        reply = http.post("/v1/completions", json={"prompt": "x"})
        assert reply.status_code == 200 and reply.json() == {"ok": True}
        retries = [
            line for line in http.get("/metrics").text.splitlines() if line.startswith("h2o_kv_gateway_retries_total")
        ]
    assert len(fake.calls) == 2 and [a.cancelled for a in fake.answers] == [True, False]
    assert reports.finished("req-1") and retries == ["h2o_kv_gateway_retries_total 1.0"]
    for request_id in ("req-1", "req-2"):
        reports.forget(request_id)
