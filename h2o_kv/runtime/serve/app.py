"""The OpenAI-compatible HTTP API over one continuous-batching Engine: `create_app(engine, model_name)`.

Each request is tokenized here, submitted to the engine (which runs in its own thread), and its
events come back to the event loop through `loop.call_soon_threadsafe`. Bad input is answered
with a 400 in OpenAI's error shape before anything reaches the engine; a client that goes away
cancels its request, which frees its rows at the engine's next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import re
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from h2o_kv.model_config import text_config
from h2o_kv.runtime.generation import Sampling
from h2o_kv.runtime.serve import schemas
from h2o_kv.runtime.serve.metrics import CONTENT_TYPE, ServerMetrics
from h2o_kv.runtime.serve.requests import (
    DEFAULT_LIMITS,
    ApiError,
    Limits,
    chat_resend,
    prompt_ids,
    refusal,
    resolve,
    text_resend,
)
from h2o_kv.runtime.serve.timeouts import ABANDON, ClientTimeouts


class _Events:
    """One request's engine events, handed from the engine's thread to the event loop.

    `run` sees each event on the engine's thread first, so metrics count a request's end (and the
    first token's time) even when its client has gone and nobody reads the queue any more.
    """

    def __init__(self, run: _Run) -> None:
        self.run = run
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, event) -> None:  # called on the engine's thread
        self.run.saw(event)
        if self.loop.is_closed():  # the server has stopped; nobody is waiting for this event
            return
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def __aiter__(self):
        while True:
            event = await self.queue.get()
            yield event
            if event.finish_reason is not None:
                return


_UNION_TAG = re.compile(r"^(str|int|float|bool|(list|dict)\[.*\])$")  # pydantic names a union's member in `loc`


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


WRONG_KEY = ApiError(401, "missing or wrong API key: send the header Authorization: Bearer <key>",
                     code="invalid_api_key")  # fmt: skip


def body_refusal(method: str, length: str | None, max_bytes: int) -> ApiError | None:
    """411 for a POST without Content-Length (a chunked body of unknown size is not read), 413 for one over
    `max_bytes`; None when the body may be read."""
    if method == "POST" and length is None:
        return ApiError(411, "send the body with a Content-Length header")
    if length is not None and (not length.isdigit() or int(length) > max_bytes):
        return ApiError(413, f"the body has {length} bytes; this server takes at most {max_bytes} (--max-body)",
                        code="body_too_large")  # fmt: skip
    return None


def error_response(err: ApiError) -> JSONResponse:
    retry = {"Retry-After": "1"} if err.status == 429 else None  # a full queue: worth retrying in a second
    body = schemas.error_body(err.message, type=err.type, param=err.param, code=err.code)
    return JSONResponse(status_code=err.status, content=body, headers=retry)


def _validation_error(err: RequestValidationError) -> ApiError:
    """FastAPI's 422 for a malformed body, as OpenAI's 400 naming the first offending field."""
    first = err.errors()[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body" and not _UNION_TAG.match(str(part))]
    kind = first.get("type")
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", first.get("msg"))
        return ApiError(400, f"the request body is not valid JSON: {detail}", code="json_invalid")
    if not loc:
        return ApiError(400, f"the request body must be a JSON object: {first.get('msg')}", code=kind)
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return ApiError(400, f"{'.'.join(loc)}: {message}", param=loc[0], code=kind)


def create_app(engine, model_name: str, *, tokenizer=None, manage_engine: bool = True,
               api_keys: Sequence[str] = (), limits: Limits = DEFAULT_LIMITS) -> FastAPI:  # fmt: skip
    """An app serving `engine` under `model_name`; with `api_keys`, every route but /health needs
    `Authorization: Bearer KEY` with one of them (401 otherwise); `limits` bound each request.

    With `manage_engine` the app starts the engine's thread on startup and shuts it down (ending
    whatever still runs) on shutdown; uvicorn's graceful shutdown lets open streams finish first.
    """
    tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
    bounds = {name: value for name, value in dataclasses.asdict(limits).items() if value is not None}
    metrics = ServerMetrics(engine, {**bounds, "context_tokens": engine.context_limit})
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_engine:
            engine.start()
        yield
        if manage_engine:
            await asyncio.to_thread(engine.shutdown, drain=False)

    app = FastAPI(title="h2o-kv", lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.limits, app.state.draining = engine, metrics, limits, False

    _guard(app, metrics, limits, api_keys)
    _info_routes(app, engine, metrics, model_name, created)
    _completion_routes(app, engine, tokenizer, metrics, limits, model_name)
    return app


def _guard(app: FastAPI, metrics: ServerMetrics, limits: Limits, api_keys: Sequence[str]) -> None:
    """What every request passes first: the API key, the body's size, the drain, the client timeouts; and the
    errors answered in OpenAI's shape."""
    keys = [key.encode() for key in api_keys]

    @app.middleware("http")
    async def require_a_key(request: Request, call_next):
        if keys and request.url.path != "/health" and not key_matches(request.headers.get("authorization"), keys):
            metrics.rejected.labels("401").inc()
            return error_response(WRONG_KEY)
        return await call_next(request)

    @app.middleware("http")
    async def bound_the_body(request: Request, call_next):
        error = body_refusal(request.method, request.headers.get("content-length"), limits.max_body_bytes)
        if error is not None:
            if error.status == 413:
                metrics.rejected.labels("413").inc()
            return error_response(error)
        return await call_next(request)

    @app.middleware("http")
    async def refuse_while_draining(request: Request, call_next):
        if app.state.draining:  # server.Server sets it on SIGTERM: admitted requests finish, new ones are told
            metrics.rejected.labels("503").inc()
            error = ApiError(503, "the server is shutting down: it finishes the requests it has and takes no new "
                             "ones; retry on another replica or after it restarts", type="server_error",
                             code="shutting_down")  # fmt: skip
            return error_response(error)
        return await call_next(request)

    app.add_middleware(ClientTimeouts, read_timeout=limits.read_timeout, stream_timeout=limits.stream_timeout,
                       max_body_bytes=limits.max_body_bytes, metrics=metrics)  # fmt: skip

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        metrics.rejected.labels(str(err.status)).inc()
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, err: RequestValidationError) -> JSONResponse:
        return await api_error(request, _validation_error(err))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return await api_error(request, ApiError(err.status_code, str(err.detail), type=kind))


def _info_routes(app: FastAPI, engine, metrics: ServerMetrics, model_name: str, created: int) -> None:
    """/health, /metrics, /reset_peaks and /v1/models."""

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": model_name}

    @app.get("/metrics")
    async def prometheus() -> Response:
        # off the event loop: reading the engine's stats waits for the step in flight, and streams must not
        return Response(await asyncio.to_thread(metrics.render), media_type=CONTENT_TYPE)

    @app.post("/reset_peaks", status_code=204)
    async def reset_peaks() -> Response:
        """Restart the peak gauges (a load generator calls it before each configuration)."""
        await asyncio.to_thread(engine.reset_peaks)
        return Response(status_code=204)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [schemas.model_card(model_name, created)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict:
        _check_model(name, model_name)
        return schemas.model_card(model_name, created)


def _completion_routes(app: FastAPI, engine, tokenizer, metrics: ServerMetrics, limits: Limits,
                       model_name: str) -> None:  # fmt: skip
    """/v1/completions and /v1/chat/completions: tokenize, check (`requests.resolve`), submit, answer or stream.
    With prefix reuse on, each request says what its next turn resends (`requests.chat_resend`, `text_resend`)."""
    reusing = getattr(engine, "prefixes", None) is not None

    @app.post("/v1/completions")
    async def completions(body: schemas.CompletionRequest, request: Request):
        _check_model(body.model, model_name)
        ids = prompt_ids(tokenizer, body.prompt, vocab_size=_vocab_size(engine, tokenizer))
        resend = text_resend(tokenizer, body.prompt) if reusing and isinstance(body.prompt, str) else None
        return await _serve(request, body, ids, chat=False, resend=resend)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: schemas.ChatRequest, request: Request):
        _check_model(body.model, model_name)
        if not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, f"model {model_name!r} has no chat template; use /v1/completions", param="messages")
        messages = [message.template_dict() for message in body.messages]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        return await _serve(request, body, ids, chat=True, resend=chat_resend(tokenizer, messages) if reusing else None)

    async def _serve(request: Request, body: schemas._Request, ids: list[int], *, chat: bool, resend=None):
        arrived = time.perf_counter()
        prompt_param = "messages" if chat else "prompt"
        job = resolve(engine, body, ids, limits, prompt_param=prompt_param)
        run = _Run(metrics, arrived)
        events = _Events(run)
        sampling = Sampling(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=body.seed,
        )
        stop = tuple(body.stop)
        try:
            req = engine.submit(
                ids, max_tokens=job.max_tokens, sampling=sampling, stop=stop, policy=job.policy,
                ignore_eos=body.ignore_eos, on_event=events.put, kv_inspect=body.kv_inspect, resend=resend,
            )  # fmt: skip
        except ValueError as err:  # too long for the context (ContextTooLong) or the KV memory (KVMemoryExceeded)
            raise refusal(err, prompt_param=prompt_param) from None
        except RuntimeError as err:  # the engine is shutting down
            raise ApiError(503, str(err), type="server_error", code="shutting_down") from None
        metrics.prompt_tokens.inc(len(ids))
        rid = schemas.new_id("chatcmpl" if chat else "cmpl")
        run.req = req
        warning = job.warning
        warned = {} if warning is None else {"X-KV-Warning": warning}
        if body.stream:
            request.scope[ABANDON] = run.abandon  # ClientTimeouts cancels the request of a stream left unread
            stream = _stream(run, events, rid, model_name, chat=chat, include_usage=body.include_usage)
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **warned}
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        text, finish = await _collect(request, run, events)
        if finish == "error":
            raise ApiError(500, f"generation failed: {req.error}", type="server_error", code="generation_failed")
        use = schemas.usage(req.prompt_tokens, run.tokens, req.reused_tokens)
        build = schemas.chat_completion if chat else schemas.completion
        reply = build(rid, model_name, text, finish, use)
        if warning is not None:  # an extra field: OpenAI clients keep it (the Python client in `model_extra`)
            reply["kv_warning"] = warning
        if body.kv_inspect:  # an answer's map is recorded by the engine just after its last token's event
            stats = await asyncio.to_thread(req.stats, 30.0) if finish in ("stop", "length") else {}
            reply["kv_inspect"] = stats.get("kept_map")
        return JSONResponse(reply, headers=warned)


def _check_model(name: str, model_name: str) -> None:
    if name != model_name:
        raise ApiError(
            404, f"the model {name!r} does not exist; this server serves {model_name!r}", param="model",
            code="model_not_found", type="not_found_error",
        )  # fmt: skip


def key_matches(header: str | None, keys: list[bytes]) -> bool:
    """Whether an Authorization header carries one of `keys`: every key compared in constant time, none skipped,
    so the time says nothing about which key or how much of it matched."""
    scheme, _, given = (header or "").partition(" ")
    given_bytes = given.strip().encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given_bytes, key)
    return scheme.lower() == "bearer" and matched


def _vocab_size(engine, tokenizer) -> int:
    return int(getattr(text_config(engine.model.config), "vocab_size", None) or len(tokenizer))


class _Run:
    """Bookkeeping of one submitted request: token count, first-token time, metrics at the end."""

    def __init__(self, metrics: ServerMetrics, arrived: float) -> None:
        self.metrics, self.arrived, self.req = metrics, arrived, None
        self.tokens, self.first_at, self.finished = 0, None, False

    def saw(self, event) -> None:
        if event.token_id is not None:
            self.tokens += 1
            if self.first_at is None:
                self.first_at = time.perf_counter()
                self.metrics.ttft.observe(self.first_at - self.arrived)
        if event.finish_reason is not None:
            self.finished = True
            self.metrics.requests.labels(event.finish_reason).inc()
            self.metrics.latency.observe(time.perf_counter() - self.arrived)

    def abandon(self) -> None:
        """The client went away (or the server is stopping): free the request's rows."""
        if not self.finished:
            self.req.cancel()


async def _collect(request: Request, run: _Run, events: _Events) -> tuple[str, str]:
    """The whole completion; cancels the request if the client disconnects while waiting."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        run.abandon()

    watcher = asyncio.create_task(watch())
    parts: list[str] = []
    finish = "length"
    try:
        async for event in events:
            parts.append(event.text)
            finish = event.finish_reason or finish
    finally:
        watcher.cancel()
        run.abandon()
    return "".join(parts), finish


async def _stream(
    run: _Run, events: _Events, rid: str, model: str, *, chat: bool, include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk shape, ending in `data: [DONE]`.

    If the client disconnects, Starlette cancels this generator and `finally` cancels the request.
    """
    try:
        if chat:
            yield _sse(schemas.chat_chunk(rid, model, {"role": "assistant", "content": ""}, None, include_usage))
        async for event in events:
            if event.finish_reason == "error":  # OpenAI's in-stream error shape; the stream still ends cleanly
                failure = f"generation failed: {run.req.error}"
                yield _sse(schemas.error_body(failure, type="server_error", code="generation_failed"))
                break
            if not event.text and event.finish_reason is None:
                continue  # a token whose text is held back (a partial character or a possible stop string)
            if chat:
                delta = {"content": event.text} if event.text else {}
                yield _sse(schemas.chat_chunk(rid, model, delta, event.finish_reason, include_usage))
            else:
                yield _sse(schemas.completion_chunk(rid, model, event.text, event.finish_reason, include_usage))
        if include_usage:
            use = schemas.usage(run.req.prompt_tokens, run.tokens, run.req.reused_tokens)
            yield _sse(schemas.usage_chunk(rid, "chat.completion.chunk" if chat else "text_completion", model, use))
        yield _sse("[DONE]")
    finally:
        run.abandon()
