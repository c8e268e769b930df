"""Pure-ASGI answers for the requests a fleet sends most: `POST /v1/telemetry` and
`POST /v1/deployments/{name}/heartbeats`.

At fleet scale the API's cost is per request, and much of it is FastAPI's routing, dependency
solving and response serialisation around work the services do anyway. This layer sits inside
the body-size gate and inside the request-id/metrics middleware, and does what the routes'
dependencies do, in the same order and with the same functions: the bearer token
(`resolve_principal`, the same cache), the token's rate limit (the shared bucket the route's
policy names), the runtime scope. These come from the headers alone, before a byte of the body
is read: a caller without a valid token, past its rate or without the runtime scope is answered
401, 429 or 403 and never has its body read (the gate counts it against the route's limit as
it is read). A telemetry body over SMALL_BODY_BYTES, or of unknown length, then needs one of the
process's decode slots and its share of the decode budget (`DecodeBudget`: 429 with Retry-After
when either is taken).

The route's own work follows on a worker thread of the layer's own, except that with Redis a
small telemetry batch whose deployment this process has cached is decoded, checked and
appended to the stream on the event loop (`queue_from_cache`), and a heartbeat of a runtime this
process has recorded is held for the next bulk write (`_beat_on_loop`): the same answers
without the thread hand-off, which cost more CPU than the work itself. An error is answered by
the app's own exception handler for it, so status codes, messages and headers
(WWW-Authenticate, Retry-After) are the routes'. A heartbeat whose body is not a plain valid
JSON heartbeat passes on to the route, whose 422 says what is wrong (its rate already taken
here: `RATE_TAKEN`). The routes stay registered: they describe the operations in the OpenAPI
document and serve when the fast path is turned off (`EXITPLANE_TELEMETRY_FAST_PATH=false`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

from anyio import CapacityLimiter, to_thread
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from controlplane.auth.deps import cached_principal, resolve_principal
from controlplane.auth.service import Principal
from controlplane.db import utcnow
from controlplane.deployments.access import visible_deployment
from controlplane.edge.answers import closing, send_json
from controlplane.edge.body import ClientLeft, read_body, replay
from controlplane.edge.handlers import handler_for
from controlplane.guards.budgets import SMALL_BODY_BYTES
from controlplane.guards.policy import RoutePolicy, match, policy_for
from controlplane.guards.rates import RATE_TAKEN, check_rate, check_rate_blocking
from controlplane.runtimes import service as runtimes
from controlplane.runtimes.api import router as runtimes_router
from controlplane.runtimes.schemas import RuntimeRead
from controlplane.telemetry.api import queue_from_cache, store_batch
from controlplane.telemetry.api import router as telemetry_router
from controlplane.telemetry.schemas import IngestAck
from exitplane.kit.json_depth import check_json_depth
from exitplane.wire import Heartbeat

# The routes served here, by their policies (controlplane/guards/policy.py): the bucket each
# takes from, the body read after the caller is checked.
TELEMETRY = policy_for("POST", "/v1/telemetry")
HEARTBEAT = policy_for("POST", "/v1/deployments/{name}/heartbeats")


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
        # The routes' APIRoutes: request metrics, logs and traces name the route.
        [self._telemetry] = [route for route in telemetry_router.routes
                             if route.path == TELEMETRY.template and "POST" in route.methods]
        [self._heartbeat] = [route for route in runtimes_router.routes
                             if route.path == HEARTBEAT.template and "POST" in route.methods]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        route = match("POST", scope["path"].removeprefix(scope.get("root_path", "")))
        if route is None:
            await self.app(scope, receive, send)
        elif route.policy is TELEMETRY:
            await self._telemetry_post(scope, receive, send)
        elif route.policy is HEARTBEAT:
            await self._heartbeat_post(scope, receive, send, route.params["name"])
        else:
            await self.app(scope, receive, send)

    async def _telemetry_post(self, scope, receive, send) -> None:
        scope["route"] = self._telemetry
        authorization, content_type, length = _headers(scope)
        state, pool = scope["app"].state, self._pool()
        content_type = "application/json" if content_type is None else content_type
        read: list[bool] = []  # the body was read whole

        async def serve() -> IngestAck:
            principal = await _caller(state, authorization, TELEMETRY, pool)
            with state.telemetry_decodes.held(length) as charge:
                body = await read_body(receive)
                read.append(True)
                if len(body) <= SMALL_BODY_BYTES and state.redis_async is not None:
                    answer = await queue_from_cache(state, principal, body, content_type)
                    if answer is not None:
                        return answer
                return await to_thread.run_sync(store_batch, state, principal, body,
                                                content_type, charge, limiter=pool)

        await _answer(scope, receive, send, 202, serve, body_read=lambda: bool(read))

    async def _heartbeat_post(self, scope, receive, send, name: str) -> None:
        authorization, content_type, _ = _headers(scope)
        state, pool = scope["app"].state, self._pool()
        refused: list[bytes] = []  # the body of a beat the route must judge
        read: list[bool] = []

        async def serve() -> RuntimeRead | None:
            principal = await _caller(state, authorization, HEARTBEAT, pool)
            body = await read_body(receive)
            read.append(True)
            beat = _plain_heartbeat(content_type, body)
            if beat is None:
                refused.append(body)
                return None
            scope["route"] = self._heartbeat
            return await _loop_first(_beat_on_loop, _serve_heartbeat,
                                     (state, principal, name, beat), pool)()

        if not await _answer(scope, receive, send, 200, serve,
                             body_read=lambda: bool(read)) and refused:
            # The route parses and refuses it, with FastAPI's own 422; its rate is taken.
            scope[RATE_TAKEN] = HEARTBEAT.bucket
            await self.app(scope, replay(refused[0], receive), send)

    def _pool(self) -> CapacityLimiter:
        """The limiter, made on the running event loop (a test may serve from several)."""
        loop = asyncio.get_running_loop()
        if self._limiter is None or self._limiter[0] is not loop:
            self._limiter = (loop, CapacityLimiter(self._threads))
        return self._limiter[1]


def _headers(scope) -> tuple[str, str | None, str | None]:
    """The first Authorization ('' without one), Content-Type and Content-Length headers."""
    authorization = content_type = length = None
    for key, value in scope["headers"]:
        if key == b"authorization" and authorization is None:
            authorization = value.decode("latin-1")
        elif key == b"content-type" and content_type is None:
            content_type = value.decode("latin-1")
        elif key == b"content-length" and length is None:
            length = value.decode("latin-1")
    return authorization or "", content_type, length


async def _caller(state, authorization: str, policy: RoutePolicy,
                  pool: CapacityLimiter) -> Principal:
    """The caller from the headers alone, as the routes' dependencies check it and in their
    order: its token (401), its rate (429, as `policy` says), the runtime scope (403). On the
    event loop when the token cache holds the token, else on a worker thread (the lookup
    blocks)."""
    principal = cached_principal(state, authorization)
    if principal is None:
        return await to_thread.run_sync(_caller_blocking, state, authorization, policy,
                                        limiter=pool)
    await check_rate(state, policy, principal)
    principal.require("runtime")
    return principal


def _caller_blocking(state, authorization: str, policy: RoutePolicy) -> Principal:
    principal = resolve_principal(state, authorization)
    check_rate_blocking(state, policy, principal)
    principal.require("runtime")
    return principal


async def _answer(scope, receive, send, status: int, serve,
                  body_read: Callable[[], bool]) -> bool:
    """Await `serve()`; send its model as JSON, or its error as the app's exception handler
    answers it. False when `serve()` answered None (nothing was sent). An error answered
    before the body was read whole closes the connection, as the body gate's 413 does: the
    rest of the body (up to EXITPLANE_MAX_BODY_BYTES) would otherwise be read and thrown away
    on the event loop, which every pull this process serves waits for."""
    api = scope["app"]
    try:
        answer: BaseModel | None = await serve()
    except ClientLeft:
        return True
    except Exception as error:
        handler = handler_for(api.exception_handlers, error)
        if handler is None:
            raise  # as in the route: the server-error middleware answers 500
        response = await handler(Request(scope, receive), error)
        await response(scope, receive, send if body_read() else closing(send))
        return True
    if answer is None:
        return False
    await send_json(send, status, answer.model_dump_json().encode())
    return True


def _loop_first(on_loop: Callable[..., Awaitable[BaseModel | None]],
                blocking: Callable[..., BaseModel], args: tuple,
                pool: CapacityLimiter) -> Callable[[], Awaitable[BaseModel]]:
    """The answer of `on_loop(*args)` on the event loop (None from it: it could not answer
    without blocking), else of `blocking(*args)` on a worker thread."""
    async def serve() -> BaseModel:
        answer = await on_loop(*args)
        if answer is not None:
            return answer
        return await to_thread.run_sync(blocking, *args, limiter=pool)

    return serve


def _serve_heartbeat(state, principal: Principal, name: str, beat: Heartbeat) -> RuntimeRead:
    """The heartbeat route's work and commit once its caller is known (blocking)."""
    # The deployment's id and name never change: the per-process cache the telemetry checks
    # use answers them, so a beat costs one statement (NotFound, or for a runtime token 403,
    # as the route's checks).
    deployment = visible_deployment(state, principal, name, runtimes.applied_versions(beat))
    runtimes.check_applied_version(target=deployment, beat=beat)
    with state.session_factory() as session:
        try:
            runtime = runtimes.record_heartbeat(
                session=session, deployment=deployment, beat=beat, token_id=principal.token_id,
                claim=principal.scope == "runtime",
                caps=runtimes.RuntimeCaps.from_settings(state.settings))
            answer = RuntimeRead.model_validate(runtime)
            session.commit()  # before the answer, as the route's session dependency does
        except BaseException:
            session.rollback()
            raise
    # its next beats with this token are held (`_beat_on_loop`)
    state.heartbeats.remember(deployment.id, answer, principal.token_id)
    return answer


async def _beat_on_loop(state, principal: Principal, name: str,
                        beat: Heartbeat) -> RuntimeRead | None:
    """`_serve_heartbeat` on the event loop for a runtime this process has recorded, whose
    deployment is cached: the beat is held for the next bulk write
    (controlplane/runtimes/beats.py). None sends the beat to `_serve_heartbeat` (a first beat,
    which the deployment's cap on runtimes must see, or anything that would read the store)."""
    buffer = state.heartbeats
    if not buffer.enabled:
        return None
    target = state.deployment_cache.peek(name, runtimes.applied_versions(beat))
    if target is None:  # not cached, or the version is not known here yet: the store says
        return None
    first_seen = buffer.first_seen(target.id, beat.runtime_id, principal.token_id,
                                   beat.applied_version)
    if first_seen is None:
        return None
    principal.require_deployment(target.id)
    return buffer.keep(target.id, beat, utcnow(), first_seen)


def _plain_heartbeat(content_type: str | None, body: bytes) -> Heartbeat | None:
    """The heartbeat in a JSON body the route would take as it is, else None."""
    media = (content_type or "").split(";")[0].strip().lower()
    if media != "application/json":
        return None
    try:
        check_json_depth(body)
        payload = json.loads(body)
        return Heartbeat.model_validate(payload) if isinstance(payload, dict) else None
    except (ValueError, ValidationError):  # TooDeep is a ValueError
        return None
