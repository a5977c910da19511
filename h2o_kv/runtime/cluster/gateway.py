"""The cluster's front door: a Ray Serve FastAPI ingress in front of the engine replicas (`h2o-kv serve --replicas`).

Every route of the one-process server goes through unchanged: the gateway checks the API key, picks nothing itself
and hands the request to the replicas' deployment handle, whose router (routing.py) sends it to the replica that
served its session (`X-Session-Id` header or the body's `user` field), else to the one of least cost (affinity.py):
room for it, then the prompt tokens a replica already holds (its longest kept prefix) weighed against how full it
is. For that the gateway tokenizes each completion's prompt as the replicas will and sends its fingerprints with the
call (prompts.py), when the replicas keep prefixes (`--session-memory`). What the replica's app answers comes back
as it is sent (streams included).

A replica that dies: a request that has received nothing yet is sent again (another replica, up to
`RETRIES` tries). The call given up on is cancelled: Ray also reports as lost a replica it cannot reach for a while
(`ActorUnavailableError`), which may still run the request, and it must not go on beside its retry. A stream that
already started ends with an OpenAI-shaped error event and `data: [DONE]`; Ray Serve restarts the replica. /metrics
shows the gateway's own counts and each replica's last report
(running, waiting, KV bytes in use and allowed), labelled by replica.

Shutdown (launch.stop, on SIGTERM) drains through the gateway, as the one-process server does: `begin_drain`
answers every new request 503 (`shutting_down`) while the requests in flight go on; `requests_in_flight` counts
them; `end_requests` (at --drain-timeout) cancels the replicas' calls still running: a stream ends with an
OpenAI-shaped `shutting_down` error event and `data: [DONE]`, a request with no answer yet gets the 503.
"""

from __future__ import annotations

import asyncio
import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import RequestCancelledError

from h2o_kv.runtime.cluster import prompts, reports, routing
from h2o_kv.runtime.serve import schemas
from h2o_kv.runtime.serve.app import WRONG_KEY, body_refusal, error_response, key_matches
from h2o_kv.runtime.serve.metrics import CONTENT_TYPE, PREFIX

RETRIES = 3
LOST = (ActorDiedError, ActorUnavailableError, RayActorError)  # the replica's process went away
_REPLICA_GAUGES = (
    ("replica_requests_running", "running", "Requests running on each replica (its last report)"),
    ("replica_requests_waiting", "waiting", "Requests waiting on each replica (its last report)"),
    ("replica_kv_bytes_in_use", "kv_bytes_in_use", "KV bytes each replica holds (its last report)"),
    ("replica_kv_bytes_allowed", "kv_bytes_allowed", "KV memory limit of each replica (+Inf: none)"),
    (
        "replica_kv_bytes_reserved",
        "kv_bytes_reserved",
        "KV bytes each replica's admitted requests are counted at (allocated rows, prompts going in)",
    ),
    ("replica_kv_bytes_peak", "kv_bytes_peak", "Most KV bytes each replica held since it started or /reset_peaks"),
    ("replica_generated_tokens", "generated_tokens", "Tokens each replica has generated since it started"),
    ("replica_requests_finished", "finished_requests", "Requests each replica has finished since it started"),
    ("replica_prefix_entries", "prefix_entries", "Finished requests' caches each replica keeps for reuse"),
    ("replica_prefix_hits", "prefix_hits", "Requests each replica started from a kept cache since it started"),
    ("replica_prefix_tokens_reused", "prefix_tokens_reused", "Prompt tokens each replica did not prefill (kept)"),
    ("replica_process_id", "pid", "Each replica's process id"),
    ("replica_torch_threads", "torch_threads", "Each replica's torch CPU threads"),
)


class _Replicas:
    """The replicas' last reports as Prometheus gauges, read at scrape time."""

    def collect(self):
        for name, key, doc in _REPLICA_GAUGES:
            family = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["replica"])
            for replica, stats in sorted(reports.LATEST.items()):
                if key in stats:  # a replica that has not reported yet has no samples
                    value = stats[key]
                    family.add_metric([replica], math.inf if value is None else float(value))
            yield family


def session_of(request: Request, body: bytes) -> str:
    """The conversation a request belongs to: the X-Session-Id header, else the body's `user` field."""
    header = request.headers.get("x-session-id")
    if header:
        return header
    try:
        user = json.loads(body).get("user") if body else None
    except (ValueError, AttributeError):
        return ""  # not JSON (or not an object): the replica's app answers that with a 400
    return user if isinstance(user, str) else ""


SHUTTING_DOWN = ("the server is shutting down: it finishes the requests it has and takes no new ones; retry on "
                 "another replica or after it restarts")  # fmt: skip


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(status_code=status, content=schemas.error_body(message, type="server_error", code=code))


@dataclass
class Drain:
    """The gateway's shutdown state: whether new requests are refused, and the replicas' calls in flight."""

    draining: bool = False
    ending: bool = False
    calls: set = field(default_factory=set)  # the replicas' answers (response generators) not yet relayed

    def end(self) -> None:
        """Cancel every call in flight: its request ends now (a stream with an error event, else a 503)."""
        self.ending = True
        for parts in list(self.calls):
            parts.cancel()


def build_gateway(replicas, api_keys: list[str], max_body_bytes: int = 1 << 20, tokenizer=None) -> FastAPI:
    """The gateway's app over the replicas' deployment handle; a body is read only once the key is checked and
    its length is within `max_body_bytes` (the replicas' own bound). With the model's `tokenizer`, each completion
    carries its prompt's fingerprints to the router (tokenized on one worker thread, off the event loop)."""
    app = FastAPI(title="h2o-kv cluster")
    tokenizing = ThreadPoolExecutor(1, thread_name_prefix="h2o-kv-gateway-tokenizer")
    keys = [key.encode() for key in api_keys]
    registry = CollectorRegistry()
    registry.register(_Replicas())
    retried = Counter(f"{PREFIX}_gateway_retries", "Requests sent again after their replica was lost",
                      registry=registry)  # fmt: skip
    broken = Counter(f"{PREFIX}_gateway_streams_broken", "Streams ended by a lost replica", registry=registry)
    drain = app.state.drain = Drain()

    def refused(request: Request) -> JSONResponse | None:
        if not keys or key_matches(request.headers.get("authorization"), keys):
            return None
        return error_response(WRONG_KEY)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if (refusal := refused(request)) is not None:
            return refusal
        return Response(generate_latest(registry), media_type=CONTENT_TYPE)

    @app.post("/reset_peaks")
    async def reset_peaks() -> JSONResponse:
        """Not across replicas (a handle reaches one): each replica's peaks count from its start."""
        return JSONResponse(status_code=404, content=schemas.error_body(
            "the cluster gateway does not reset peaks: each replica's count from its start",
            type="not_found_error", code="not_supported"))  # fmt: skip

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(request: Request, path: str) -> Response:
        if drain.draining:  # every route, /health included, as the one-process server while it drains
            return _error(503, SHUTTING_DOWN, "shutting_down")
        if path != "health" and (refusal := refused(request)) is not None:
            return refusal
        error = body_refusal(request.method, request.headers.get("content-length"), max_body_bytes)
        if error is not None:
            return error_response(error)
        body = await request.body()
        headers = [(k.encode(), v.encode()) for k, v in request.headers.items() if k.lower() != "authorization"]
        handle = replicas.options(stream=True, session_id=session_of(request, body))
        prompt = None
        if tokenizer is not None and request.method == "POST":
            loop = asyncio.get_running_loop()
            prompt = await loop.run_in_executor(tokenizing, prompts.fingerprint, tokenizer, f"/{path}", body)
        for _ in range(RETRIES):
            parts = handle.forward.remote(request.method, f"/{path}", headers, body, prompt=prompt)
            drain.calls.add(parts)
            try:
                if drain.ending:
                    parts.cancel()
                start = await parts.__anext__()
                break
            except LOST:
                drain.calls.discard(parts)
                parts.cancel()  # a replica only unreachable for a while would otherwise run it beside the retry
                reports.finish(getattr(parts, "request_id", ""))  # nor does it count against that replica any more
                retried.inc()
            except RequestCancelledError:
                drain.calls.discard(parts)
                if drain.ending:
                    return _error(503, SHUTTING_DOWN, "shutting_down")
                raise
            except BaseException:
                drain.calls.discard(parts)
                raise
        else:
            return _error(503, f"no replica answered after {RETRIES} tries (replicas lost)", "replica_lost")
        out = {k.decode(): v.decode() for k, v in start["headers"] if k.lower() not in (b"content-length",)}
        return StreamingResponse(_relay(parts, drain, broken), status_code=start["status"], headers=out)

    return app


async def _relay(parts, drain: Drain, broken: Counter):
    """The rest of a replica's answer, chunk by chunk; a lost replica or the drain's end closes it with an error event,
    a client that goes away cancels the replica's call."""
    done = False
    try:
        async for chunk in parts:
            yield chunk
        done = True
    except LOST as err:
        done = True
        broken.inc()
        yield _last_event(f"the replica serving this stream was lost: {type(err).__name__}", "replica_lost")
    except RequestCancelledError:
        if not drain.ending:
            raise
        done = True
        yield _last_event("the server shut down before this stream finished (--drain-timeout)", "shutting_down")
    finally:
        drain.calls.discard(parts)
        # the router stops counting it against its replica now, before the client can send its next request
        reports.finish(getattr(parts, "request_id", ""))  # a handle's response has one (a test's stand-in may not)
        if not done:  # the client went away: the replica's app sees a disconnect and frees the request
            parts.cancel()


def _last_event(message: str, code: str) -> bytes:
    """An OpenAI-shaped error event and `data: [DONE]`: how a stream the replica cannot finish ends."""
    failure = schemas.error_body(message, type="server_error", code=code)
    return f"data: {json.dumps(failure)}\n\ndata: [DONE]\n\n".encode()


def build(model: str, *, device: str, engine: dict, served_name: str, limits, replicas: int, api_keys: list[str]):
    """The Ray Serve application: `replicas` engine replicas behind the gateway, routed by routing.KVRoomRouter."""
    from ray.serve.config import RequestRouterConfig

    from h2o_kv.runtime.cluster.replica import EngineReplica

    router = RequestRouterConfig(request_router_class=f"{routing.__name__}:{routing.KVRoomRouter.__name__}",
                                 request_routing_stats_period_s=routing.STATS_PERIOD)  # fmt: skip
    engines = serve.deployment(
        EngineReplica, name="engine", num_replicas=replicas, max_ongoing_requests=1024,
        request_router_config=router, ray_actor_options={"num_cpus": 0},
    ).bind(model, device, engine, served_name, limits)  # fmt: skip

    @serve.deployment(name="gateway", max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0})
    @serve.ingress()
    class Gateway:
        def __init__(self, engines_handle) -> None:
            self.engines = engines_handle
            # the replicas' own, to match what they keep; without --session-memory they keep nothing: no need
            self.tokenizer = prompts.load_tokenizer(model) if engine.get("session_memory") else None

        def __serve_build_asgi_app__(self):
            app = build_gateway(self.engines, api_keys, limits.max_body_bytes, self.tokenizer)
            self.drain = app.state.drain
            return app

        # called by launch.stop through the app's handle (async: on the replica's event loop, as the routes)
        async def begin_drain(self) -> None:
            self.drain.draining = True

        async def requests_in_flight(self) -> int:
            return len(self.drain.calls)

        async def end_requests(self) -> None:
            self.drain.end()

    return Gateway.bind(engines)
