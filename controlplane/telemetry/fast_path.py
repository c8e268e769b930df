"""Pure-ASGI answers for the requests a fleet sends most (issue 14): `POST /v1/telemetry` and
`POST /v1/deployments/{name}/heartbeats`.

At fleet scale the API's cost is per request, and much of it was FastAPI's routing, dependency
solving and response serialisation around work the services do anyway. This layer sits inside
the body-size gate (so 413 and the body read are unchanged) and inside the request-id/metrics
middleware, and does what the routes' dependencies do, in the same order and with the same
functions: the bearer token (`resolve_principal`, the same cache), the token's rate limit (the
same shared bucket), the runtime scope, then the route's own work, all on one worker thread.
With Redis, a small telemetry batch whose token and deployment this process has cached is
answered on the event loop instead, with one Redis script for the rate take and the append
(`_serve_on_loop`): the same answers in the same order, without the thread hand-off and the
second round trip, which cost more CPU than the batch's own checks. An error is answered by the
app's own exception handler for it, so status codes, messages and headers (WWW-Authenticate,
Retry-After) are the routes'. A heartbeat whose body is not a plain valid JSON heartbeat passes
on untouched to the route, whose 422 says what is wrong. The routes stay registered: they
describe the operations in the OpenAPI document and serve when the fast path is turned off
(`EXITPLANE_TELEMETRY_FAST_PATH=false`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import redis
from anyio import CapacityLimiter, to_thread
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from controlplane import metrics
from controlplane.db import utcnow
from controlplane.deps import (
    cached_principal,
    check_rate_blocking,
    refuse_past_rate,
    resolve_principal,
)
from controlplane.errors import DomainError
from controlplane.runtimes import service as runtimes
from controlplane.runtimes.api import router as runtimes_router
from controlplane.runtimes.schemas import RuntimeRead
from controlplane.telemetry import stream
from controlplane.telemetry.api import checked_from_cache, queued_ack, store_batch
from controlplane.telemetry.api import router as telemetry_router
from controlplane.telemetry.schemas import IngestAck
from exitplane.wire import Heartbeat

TELEMETRY_PATH = "/v1/telemetry"
# A telemetry body up to this size is served on the event loop (`_serve_on_loop`): a fleet's
# interval batches (~4 KiB: the counts and 100 sampled records as columns), aggregate batches
# (~0.5 KiB) and sampled-record batches (~13 KiB for 100 records) decode in well under a
# millisecond; larger ones are decoded on a worker thread.
LOOP_BODY_BYTES = 32 << 10
HEARTBEATS = ("/v1/deployments/", "/heartbeats")  # around the deployment's name


class TelemetryFastPath:
    """Serve telemetry POSTs and heartbeats without entering the router; everything else
    passes on."""

    def __init__(self, app, *, threads: int = 16) -> None:
        self.app = app
        # Telemetry and heartbeats run on threads of their own (a CapacityLimiter apart from
        # the default one the routes' dependencies and sync routes use): at fleet scale they
        # would otherwise fill the shared pool, and a config pull whose token must be looked
        # up, or an operator's alias move, would wait behind seconds of telemetry.
        self._threads = threads
        self._limiter: tuple[object, CapacityLimiter] | None = None  # (its loop, it)
        # The routes' APIRoutes: request metrics, logs and traces name the route as before.
        [self._telemetry] = [route for route in telemetry_router.routes
                             if route.path == TELEMETRY_PATH and "POST" in route.methods]
        [self._heartbeat] = [route for route in runtimes_router.routes
                             if route.path == "".join((HEARTBEATS[0], "{name}", HEARTBEATS[1]))
                             and "POST" in route.methods]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path == TELEMETRY_PATH:
            await self._telemetry_post(scope, receive, send)
        elif path.startswith(HEARTBEATS[0]) and path.endswith(HEARTBEATS[1]) and "/" not in (
                name := path[len(HEARTBEATS[0]):-len(HEARTBEATS[1])]) and name:
            await self._heartbeat_post(scope, receive, send, name)
        else:
            await self.app(scope, receive, send)

    async def _telemetry_post(self, scope, receive, send) -> None:
        scope["route"] = self._telemetry
        authorization, content_type = _headers(scope)
        # The body first: the size gate outside has already read and buffered all of it, so
        # nothing is spent on a refused request that the route would not have spent.
        body = await _read_body(receive)
        if body is None:
            return  # the client left before its body was complete: nobody to answer
        state, pool = scope["app"].state, self._pool()
        content_type = "application/json" if content_type is None else content_type

        on_loop = _serve_on_loop if len(body) <= LOOP_BODY_BYTES and state.redis is not None \
            else None
        await _answer(scope, receive, send, 202, _loop_first(
            on_loop, _serve, (state, authorization, content_type, body), pool))

    async def _heartbeat_post(self, scope, receive, send, name: str) -> None:
        authorization, content_type = _headers(scope)
        body = await _read_body(receive)
        if body is None:
            return
        beat = _plain_heartbeat(content_type, body)
        if beat is None:  # the route parses and refuses it, with FastAPI's own 422
            await self.app(scope, _replay(body, receive), send)
            return
        scope["route"] = self._heartbeat
        state, pool = scope["app"].state, self._pool()
        await _answer(scope, receive, send, 200, _loop_first(
            _beat_on_loop, _serve_heartbeat, (state, authorization, name, beat), pool))

    def _pool(self) -> CapacityLimiter:
        """The limiter, made on the running event loop (a test may serve from several)."""
        loop = asyncio.get_running_loop()
        if self._limiter is None or self._limiter[0] is not loop:
            self._limiter = (loop, CapacityLimiter(self._threads))
        return self._limiter[1]


def _headers(scope) -> tuple[str, str | None]:
    """The first Authorization ('' without one) and Content-Type headers."""
    authorization = content_type = None
    for key, value in scope["headers"]:
        if key == b"authorization" and authorization is None:
            authorization = value.decode("latin-1")
        elif key == b"content-type" and content_type is None:
            content_type = value.decode("latin-1")
    return authorization or "", content_type


async def _answer(scope, receive, send, status: int, serve) -> None:
    """Await `serve()`; send its model as JSON, or its error as the app's exception handler
    answers it."""
    api = scope["app"]
    try:
        answer: BaseModel = await serve()
    except Exception as error:
        handler = _handler_for(api.exception_handlers, error)
        if handler is None:
            raise  # as in the route: the server-error middleware answers 500
        response = await handler(Request(scope, receive), error)
        await response(scope, receive, send)
        return
    payload = answer.model_dump_json().encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-length", str(len(payload)).encode()),
                            (b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": payload})


def _serve(state, authorization: str, content_type: str, body: bytes) -> IngestAck:
    """The telemetry route's dependencies and body, in their order (blocking)."""
    principal = resolve_principal(state, authorization)
    check_rate_blocking(state, "ingest", principal)
    principal.require("runtime")
    return store_batch(state, principal, body, content_type)


async def _serve_on_loop(state, authorization: str, content_type: str,
                         body: bytes) -> IngestAck | None:
    """`_serve` on the event loop for a small batch whose token and deployment this process
    has cached, with one Redis round trip (the rate take and the append in one script,
    `stream.append_within_rate`); None sends the request to `_serve` on a worker thread
    (anything that would read the store, an unlimited token, Redis unreachable).

    At fleet scale most telemetry POSTs are small interval (or aggregate and sampled-record)
    batches, and the hand-off to a worker thread and back, with two blocking Redis calls
    there, cost more CPU than the work itself. Decoding a body of at most LOOP_BODY_BYTES
    holds the loop well under a millisecond. The answers are `_serve`'s, in its order: a
    request past its rate is 429 whatever else is wrong with it, so a bad request takes from
    the bucket first."""
    limiter = state.rate_limiters["ingest"]
    principal = cached_principal(state, authorization)
    shared = getattr(limiter, "shared_bucket", None)
    bucket = shared(str(principal.token_id)) if principal and shared else None
    if bucket is None:
        return None
    try:
        principal.require("runtime")
    except DomainError:
        refuse_past_rate("ingest", await limiter.retry_after(str(principal.token_id)))
        raise
    try:
        batch = checked_from_cache(state, principal, body, content_type)
    except Exception as error:
        refuse_past_rate("ingest", await limiter.retry_after(str(principal.token_id)))
        if isinstance(error, DomainError):
            metrics.rejected_batches.labels(type(error).__name__).inc()
        raise
    if batch is None:
        return None
    try:
        added, wait = await stream.append_within_rate(
            bucket, batch, body if "msgpack" in content_type else None)
    except (redis.RedisError, OSError):
        # `_serve` answers it: the limiter's in-process fallback, then the queue's 503.
        return None
    refuse_past_rate("ingest", wait)
    return queued_ack(batch, added)


def _loop_first(on_loop: Callable[..., Awaitable[BaseModel | None]] | None,
                blocking: Callable[..., BaseModel], args: tuple,
                pool: CapacityLimiter) -> Callable[[], Awaitable[BaseModel]]:
    """The answer of `on_loop(*args)` on the event loop (None from it, or no `on_loop`: it
    could not answer without blocking), else of `blocking(*args)` on a worker thread."""
    async def serve() -> BaseModel:
        if on_loop is not None:
            answer = await on_loop(*args)
            if answer is not None:
                return answer
        return await to_thread.run_sync(blocking, *args, limiter=pool)

    return serve


def _serve_heartbeat(state, authorization: str, name: str, beat: Heartbeat) -> RuntimeRead:
    """The heartbeat route's dependencies, work and commit, in their order (blocking)."""
    principal = resolve_principal(state, authorization)
    check_rate_blocking(state, "heartbeat", principal)
    principal.require("runtime")
    # The deployment's id and name never change: the per-process cache the telemetry checks
    # use answers them, so a beat costs one statement (NotFound as the route's lookup).
    deployment = state.ingest_targets.get(name, ())
    principal.require_deployment(deployment.id)
    with state.session_factory() as session:
        try:
            runtime = runtimes.record_heartbeat(
                session=session, deployment=deployment, beat=beat,
                max_runtimes=state.settings.max_runtimes_per_deployment)
            answer = RuntimeRead.model_validate(runtime)
            session.commit()  # before the answer, as the route's session dependency does
        except BaseException:
            session.rollback()
            raise
    state.heartbeats.remember(deployment.id, answer)  # its next beats are held (`_beat_on_loop`)
    return answer


async def _beat_on_loop(state, authorization: str, name: str,
                        beat: Heartbeat) -> RuntimeRead | None:
    """`_serve_heartbeat` on the event loop for a runtime this process has recorded, whose
    token and deployment are cached: the same checks in the same order, then the beat is held
    for the next bulk write (controlplane/runtimes/beats.py). None sends the beat to
    `_serve_heartbeat` (a first beat, which the deployment's cap on runtimes must see, or
    anything that would read the store)."""
    buffer = state.heartbeats
    if not buffer.enabled:
        return None
    principal = cached_principal(state, authorization)
    target = state.ingest_targets.peek(name, ())
    if principal is None or target is None:
        return None
    first_seen = buffer.first_seen(target.id, beat.runtime_id)
    if first_seen is None:
        return None
    limiter = state.rate_limiters["heartbeat"]
    refuse_past_rate("heartbeat", await limiter.retry_after(str(principal.token_id)))
    principal.require("runtime")
    principal.require_deployment(target.id)
    return buffer.hold(target.id, beat, utcnow(), first_seen)


def _plain_heartbeat(content_type: str | None, body: bytes) -> Heartbeat | None:
    """The heartbeat in a JSON body the route would take as it is, else None."""
    media = (content_type or "").split(";")[0].strip().lower()
    if media != "application/json":
        return None
    try:
        payload = json.loads(body)
        return Heartbeat.model_validate(payload) if isinstance(payload, dict) else None
    except (ValueError, ValidationError):
        return None


def _replay(body: bytes, receive):
    """A receive channel that hands `body` on once, then the client's own messages."""
    replayed = False

    async def replay():
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def _read_body(receive) -> bytes | None:
    """The whole body (the size gate outside has already bounded and buffered it), or None
    when the client disconnected."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _handler_for(handlers: dict, error: Exception):
    """The app's handler for `error`'s class or its nearest base, as Starlette looks it up."""
    for cls in type(error).__mro__:
        if cls in handlers:
            return handlers[cls]
    return None
