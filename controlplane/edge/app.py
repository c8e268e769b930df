"""The control plane's HTTP API: routers, error mapping, health and readiness (the admin UI is
mounted on it by the composition root, `exitplane.app`)."""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Annotated

import redis
import redis.asyncio
from anyio import to_thread
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy.engine import Engine
from starlette.exceptions import HTTPException

from controlplane import collector, metrics, observability
from controlplane.alerts.api import router as alerts_router
from controlplane.auth.service import digest
from controlplane.coordination.bus import Bus
from controlplane.db import (
    get_engine,
    out_of_range_errors,
    session_factory,
    store_away,
    store_errors,
)
from controlplane.deployments.api import router as deployments_router
from controlplane.deployments.cache import DeploymentCache
from controlplane.deployments.delivery import ConfigDelivery, NotModifiedFastPath
from controlplane.deployments.tokens_api import router as auth_router
from controlplane.deps import (
    HEAVY_READS_AT_ONCE,
    HEAVY_READS_WAITING,
    PrincipalCache,
    ReadLimited,
    is_json_media,
    takes_json_body,
    token_reader,
)
from controlplane.edge.telemetry_fast_path import TelemetryFastPath, reads_after_auth
from controlplane.errors import (
    ERROR_SCHEMA,
    NOT_JSON,
    VALIDATION_ERROR,
    DomainError,
    Unauthorized,
    error_answer,
)
from controlplane.flows import fallback
from controlplane.flows.api import router as calibration_router
from controlplane.guards.buckets import RefusalHold, Turns, make_rate_limiters
from controlplane.health import Readiness
from controlplane.keys import weak_secret_problem
from controlplane.memory import return_large_blocks_to_the_os
from controlplane.runtimes.api import router as runtimes_router
from controlplane.runtimes.beats import HeartbeatBuffer
from controlplane.runtimes.outlier_api import router as outliers_router
from controlplane.runtimes.witnesses import ClaimCache
from controlplane.settings import Settings, get_settings
from controlplane.telemetry.api import DecodeBudget
from controlplane.telemetry.api import router as telemetry_router
from controlplane.telemetry.gauges import store_collector
from controlplane.telemetry.service import ensure_partitions
from exitplane import __version__
from exitplane.kit import tracing
from exitplane.kit.logs import access_log_enabled

log = logging.getLogger("exitplane.api")


def create_api(settings: Settings | None = None, engine: Engine | None = None) -> FastAPI:
    """Build the API for `settings` (default: the environment's), optionally on `engine`."""
    settings = settings or get_settings()
    problem = weak_secret_problem(settings, settings.host)
    if problem:
        raise RuntimeError(problem)
    engine = engine or get_engine(settings.effective_database_url)
    factory = session_factory(engine)
    fallback.install()  # alerts this process fires get the automatic fallback
    return_large_blocks_to_the_os()  # controlplane/memory.py: freed bodies and hashes

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await to_thread.run_sync(_prepare_store, factory)
        app.state.bus.start()
        collector.freeze_startup()  # controlplane/collector.py: the pull tail at fleet load
        async with (observability.loop_lag_watcher(),
                    collector.scheduled_full_collections(settings.api_gc_full_interval_s)):
            yield
        app.state.bus.close()
        app.state.config_delivery.close()
        await to_thread.run_sync(app.state.heartbeats.close)

    app = ControlPlaneAPI(title="exitplane control plane", version=__version__,
                          lifespan=lifespan)
    app.openapi = _documenting_our_validation_errors(app.openapi, app)
    app.state.settings = settings
    app.state.engine = engine
    app.state.session_factory = factory
    store_collector.bind(factory)  # /metrics reads alert-rule gauges from this store
    # Whatever limits, revokes or wakes up is shared by every API process (Redis, else the
    # store's epochs); see controlplane/coordination/.
    # Without Redis the bus polls the store's epochs, except on SQLite: the embedded default
    # runs one API process (told in process), and every SQLite transaction takes the write
    # lock; there a second process still honours the token cache's maximum age.
    polled = factory if engine.dialect.name != "sqlite" else None
    app.state.bus = Bus(redis_url=settings.redis_url, session_factory=polled,
                        epoch_poll_s=settings.revocation_poll_s)
    app.state.principal_cache = PrincipalCache(settings.token_cache_ttl_s,
                                               load=token_reader(factory))
    app.state.bus.subscribe("revocation", app.state.principal_cache.on_revocation)
    app.state.rate_limiters = make_rate_limiters(redis_url=settings.redis_url, rates={
        "pull": settings.rate_limit_pull_per_s, "ingest": settings.rate_limit_ingest_per_s,
        "heartbeat": settings.rate_limit_heartbeat_per_s, "read": settings.rate_limit_read_per_s})
    app.state.refusal_hold = RefusalHold(settings.rate_limit_hold_s)
    app.state.heavy_read_turns = Turns(HEAVY_READS_AT_ONCE, HEAVY_READS_WAITING)
    app.state.config_delivery = ConfigDelivery(
        factory, settings.config_cache_ttl_s, bus=app.state.bus,
        long_polls_per_token=settings.long_polls_per_token)
    app.state.deployment_cache = DeploymentCache(factory)  # the stream path's batch checks
    app.state.heartbeats = HeartbeatBuffer(factory, interval_s=settings.heartbeat_flush_s)
    app.state.runtime_claims = ClaimCache()  # which runtime ids each token reports under
    # Bounded waits: a Redis that is away answers 503 quickly instead of holding a worker thread.
    app.state.redis = (redis.Redis.from_url(settings.redis_url, socket_connect_timeout=2,
                                            socket_timeout=5)
                       if settings.redis_url else None)

    # An asyncio client for what the event loop sends itself (the telemetry fast path).
    app.state.redis_async = (redis.asyncio.Redis.from_url(
        settings.redis_url, socket_connect_timeout=2, socket_timeout=5)
        if settings.redis_url else None)
    app.state.telemetry_decodes = DecodeBudget.from_settings(settings)

    if settings.telemetry_fast_path:  # inside the body gate: its limits stay the gate's
        app.add_middleware(TelemetryFastPath, threads=settings.telemetry_threads)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_control_body_bytes,
                       routes={TELEMETRY_PATH: settings.max_body_bytes},
                       read_after_auth=reads_after_auth)
    fast_pull = {"delivery": app.state.config_delivery, "principals": app.state.principal_cache,
                 "digest": digest, "limiter": app.state.rate_limiters["pull"],
                 "long_poll_max_s": settings.long_poll_max_s,
                 "route": next(route for route in deployments_router.routes
                               if route.path == "/v1/deployments/{name}/thresholds")}
    if tracing.enabled():  # every request a span: the pull's fast path inside the tracing layer
        app.add_middleware(NotModifiedFastPath, **fast_pull)
        behind_context = app.behind_front
    else:
        behind_context = NotModifiedFastPath(app.behind_front, **fast_pull)
    # Outermost: request id, access log and duration cover every layer below.
    access_lines = settings.access_log if settings.access_log is not None \
        else access_log_enabled(settings.environment)
    app.front = observability.RequestContext(behind_context, access_log=access_lines)
    if not tracing.enabled() and not access_lines:
        # A plain 304 pull is answered before the context, with its request id and duration.
        app.front = NotModifiedFastPath(app.front, **fast_pull, front=True)

    @app.exception_handler(DomainError)
    async def domain_error(request: Request, error: DomainError) -> JSONResponse:
        if error.held:  # a cap reached; rate refusals were held where they were found
            await request.app.state.refusal_hold()
        headers = {}
        if error.status_code == 401:
            headers["WWW-Authenticate"] = "Bearer"
        if hasattr(error, "retry_after"):
            headers["Retry-After"] = str(max(1, round(error.retry_after)))
        # Answered: its frames (a request's body among them) would otherwise wait for a full
        # garbage collection, held in reference cycles through the thread hand-off.
        error.__traceback__ = None
        return JSONResponse(status_code=error.status_code,
                            content={"detail": str(error), **error.extra}, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        media = request.headers.get("content-type", "")
        if takes_json_body(request.scope.get("route")) and not is_json_media(media):
            # FastAPI reads such a body as bytes and fails on its type: say what is wrong.
            return JSONResponse(status_code=415, content={"detail": (
                f"this route takes a JSON body: send Content-Type: application/json, not "
                f"{media[:100] or 'none'}")})
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ()))
        message = f"{where}: {first.get('msg', 'invalid input')}" if where else "invalid input"
        return JSONResponse(status_code=422, content={
            "detail": message, "errors": _jsonable(error.errors())})

    async def out_of_range(_request: Request, error: Exception) -> JSONResponse:
        # A value the schema allows but the store cannot hold (a number past 64 bits, a sum
        # past a counter's end, text too long for its column).
        return JSONResponse(status_code=422, content={
            "detail": "a value in the request cannot be stored: out of range or too long"})

    async def store_error(_request: Request, error: Exception) -> JSONResponse:
        # The store away or busy (whichever layer raised it: a COPY runs on the driver's own
        # connection) is 503, so runtimes retry and keep their order; anything else about
        # the store is a fault of ours, 500.
        if store_away(error):
            log.warning("store unavailable: %s", type(error).__name__)
            return JSONResponse(status_code=503, headers={"Retry-After": "2"},
                                content={"detail": "the store is unavailable; retry shortly"})
        log.error("store error", exc_info=error)
        return JSONResponse(status_code=500, content={"detail": "internal error"})

    for kind in store_errors():  # the most specific handler applies: DataError's is 422
        app.add_exception_handler(kind, store_error)
    for kind in out_of_range_errors():
        app.add_exception_handler(kind, out_of_range)

    # Redis refusing or away (a restart, a failover's READONLY, maxmemory): the queue is
    # unavailable, never the batch's fault.
    @app.exception_handler(redis.RedisError)
    async def queue_unavailable(_request: Request, error: Exception) -> JSONResponse:
        log.warning("telemetry queue unavailable: %s", type(error).__name__)
        return JSONResponse(status_code=503, headers={"Retry-After": "2"},
                            content={"detail": "the telemetry queue is unavailable; "
                                               "retry shortly"})

    store_collector.ttl = settings.metrics_cache_ttl_s

    @app.get("/metrics", tags=["health"], include_in_schema=False)
    async def prometheus_metrics(request: Request) -> Response:
        if settings.metrics_token:
            _require_metrics_token(request, settings.metrics_token)
        # The store-backed gauges query the store: off the event loop (and cached briefly).
        body = await to_thread.run_sync(generate_latest, metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict:
        """The process is up (liveness); no token, no store read."""
        return {"status": "ok", "version": __version__}

    readiness = Readiness(engine, app.state.redis)

    @app.get("/readyz", tags=["health"])
    async def readyz(deep: Annotated[bool, Query(description=(
            "ask the store and Redis now (for operators and monitors, not the probe)"))] = False,
    ) -> JSONResponse:
        """Readiness: 200 once the store has answered this process, and through later store or
        Redis outages (its caches answer pulls, the rest gets 503 with Retry-After), so an
        outage never takes every replica out of the Service at once. `deep=true`: 503 with
        Retry-After while the store or Redis does not answer now."""
        return await (readiness.deep() if deep else readiness.ready())

    tracing.instrument_app(app, engine)  # OpenTelemetry, when OTEL_* configures it
    # Every GET of the API takes its cost from the caller's read bucket (controlplane/deps.py).
    for router in (deployments_router, runtimes_router, auth_router, telemetry_router,
                   alerts_router, calibration_router, outliers_router):
        app.include_router(router, dependencies=[ReadLimited])
    return app


class ControlPlaneAPI(FastAPI):
    """The FastAPI app behind a front door: `front` (set by `create_api`) sees each HTTP request
    before FastAPI's and Starlette's own layers do: the request context (id, access line,
    duration), then the config pull's fast path, then `behind_front` (FastAPI as usual). A 304
    answered at the door skips those layers, about a tenth of what the pull costs the
    process. While no access line is written, a plain 304 pull (no `wait`) is answered before
    the request context, which the fast path stands in for (request id, duration)."""

    front = None

    async def __call__(self, scope, receive, send) -> None:
        if self.front is None or scope["type"] == "lifespan":
            await super().__call__(scope, receive, send)
        else:
            await self.front(scope, receive, send)

    async def behind_front(self, scope, receive, send) -> None:
        """The app without its front door."""
        await super().__call__(scope, receive, send)


def _require_metrics_token(request: Request, token: str) -> None:
    """Refuse a scrape without `Authorization: Bearer <EXITPLANE_METRICS_TOKEN>`."""
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                             token.encode()):
        raise Unauthorized("/metrics needs 'Authorization: Bearer <EXITPLANE_METRICS_TOKEN>'")


def _prepare_store(factory) -> None:
    """Create the coming days' telemetry partitions (PostgreSQL); a failure only logs."""
    try:
        with factory() as session:
            ensure_partitions(session=session)
            session.commit()
    except Exception as error:  # the API must start even when the store is briefly away
        log.warning("could not prepare telemetry partitions: %s", error)


TELEMETRY_PATH = "/v1/telemetry"


class BodyTooLarge(HTTPException):
    """A body that passed its route's limit while the route read it (413; the rest is never
    read, so the connection closes)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds the limit of {limit} bytes for this route",
                         headers={"Connection": "close"})


class BodySizeLimit:
    """Refuse a request body over its route's limit with 413 before anything parses it (pure
    ASGI: no cost on the hot GET paths). Control routes get `max_bytes` (kilobytes: nothing
    there needs more, and auth runs only after the body is read); `routes` maps paths (and
    what lies below them) to their own limit, e.g. telemetry batches.

    A declared Content-Length is refused at once. Otherwise the body is read here, counted
    chunk by chunk (chunked uploads declare no length), and handed to the app only once it is
    complete and within the limit: no route, form parser or middleware sees a byte before.
    A path for which `read_after_auth(path)` holds (telemetry, heartbeats) is the exception:
    its route checks the caller from the headers and only then reads the body, through a
    channel that counts it and raises BodyTooLarge past the limit, so a caller without a valid
    token, or past its rate, never has its body read."""

    def __init__(self, app, max_bytes: int, routes: dict[str, int] | None = None,
                 read_after_auth: Callable[[str], bool] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.routes = routes or {}
        self.read_after_auth = read_after_auth or (lambda _path: False)

    def limit_for(self, scope) -> int:
        path = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        for prefix, limit in self.routes.items():
            if path == prefix or path.startswith(prefix + "/"):
                return limit
        return self.max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope)
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await self._refuse(send, f"request body of {int(value)} bytes exceeds the "
                                         f"limit of {limit} bytes for this route")
                return
        if self.read_after_auth(scope["path"].removeprefix(scope.get("root_path", ""))):
            await self.app(scope, _counted(receive, limit), send)
            return
        chunks, received = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body was complete: nobody to answer
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > limit:
                await self._refuse(send, f"request body exceeds the limit of {limit} bytes "
                                         "for this route")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # http.disconnect, when the client goes
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(send, message: str) -> None:
        body = json.dumps({"detail": message}).encode()
        # Connection: close, as the rest of the body is never read.
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _counted(receive, limit: int):
    """`receive`, raising BodyTooLarge once the body it has handed on passes `limit` bytes."""
    received = 0

    async def counted():
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise BodyTooLarge(limit)
        return message

    return counted


def _documenting_our_validation_errors(build: Callable[[], dict],
                                       app: FastAPI) -> Callable[[], dict]:
    """FastAPI's OpenAPI document, completed for client generators: the `Error` body
    (`ERROR_SCHEMA`, which `error_answer` refers to) on every error answer, the 422 that
    `validation_error` (above) sends wherever FastAPI documented its own list-of-errors body
    (which this app never answers), the bearer scheme on every operation that needs a token
    with its 401 and 403, 404 where the path or a `deployment` field names something, 413
    where a body is read, 415 on JSON bodies, 429 on rate-limited operations, 503 (the store
    away), a description on every operation and the route's name as its operationId; the
    bodies a route spells out itself are moved into components (`_hoist_body_schemas`)."""
    def openapi() -> dict:
        schema = build()  # FastAPI builds it once and caches it
        components = schema.setdefault("components", {})
        if "Error" not in components.setdefault("schemas", {}):  # not yet rewritten
            components["schemas"]["Error"] = ERROR_SCHEMA
            components["schemas"].pop("HTTPValidationError", None)
            components["schemas"].pop("ValidationError", None)
            components["securitySchemes"] = {BEARER: {
                "type": "http", "scheme": "bearer",
                "description": "an API token (`exitplane token create`): runtime tokens for "
                               "pulls, heartbeats and telemetry, operator or admin tokens for "
                               "the rest"}}
            for route, method, operation in _operations(app, schema):
                _complete(route, method, operation)
            _hoist_body_schemas(schema)
        return schema

    return openapi


def _hoist_body_schemas(schema: dict) -> None:
    """Move the request-body schemas a route spells out itself (telemetry's, one per content
    type) and the `$defs` inside them into components, referred to by `$ref` as FastAPI refers
    to its own: client generators resolve no `#/$defs/...` inside an operation."""
    components = schema["components"]["schemas"]

    def keep(name: str, definition: dict) -> dict:
        if components.setdefault(name, definition) != definition:
            raise ValueError(f"two OpenAPI schemas named {name!r} differ")
        return {"$ref": f"#/components/schemas/{name}"}

    for methods in schema["paths"].values():
        for operation in methods.values():
            for media in operation.get("requestBody", {}).get("content", {}).values():
                body = media.get("schema", {})
                if "$defs" not in body and not ("title" in body and "properties" in body):
                    continue
                body = json.loads(json.dumps(body).replace('"#/$defs/',
                                                           '"#/components/schemas/'))
                for name, definition in body.pop("$defs", {}).items():
                    keep(name, definition)
                media["schema"] = keep(body["title"], body)


BEARER = "bearerAuth"
_SCOPE_SENTENCE = {"runtime": "Needs a token: any scope, a runtime token only on its own "
                              "deployment.",
                   "operator": "Needs an operator (or admin) token.",
                   "admin": "Needs an admin token."}


def _operations(app: FastAPI, schema: dict):
    """(route, method, operation) of every operation in the document."""
    from fastapi import routing
    from fastapi.openapi.utils import _get_api_route_for_openapi

    for context in routing.iter_route_contexts(app.routes):
        route = _get_api_route_for_openapi(context)
        if route is None or not route.include_in_schema:
            continue
        for method in sorted(route.methods):
            operation = schema["paths"].get(route.path_format, {}).get(method.lower())
            if operation is not None:
                yield route, method, operation


def _dependency_calls(dependant) -> list:
    calls = [dependant.call]
    for sub in dependant.dependencies:
        calls += _dependency_calls(sub)
    return calls


def _complete(route, method: str, operation: dict) -> None:
    from controlplane.deps import get_principal, read_cost

    calls = _dependency_calls(route.dependant)
    scopes = [call.required_scope for call in calls if hasattr(call, "required_scope")]
    read_limited = any(getattr(call, "rate_kind", None) == "read" for call in calls)
    needs_token = get_principal in calls or bool(scopes) or \
        (read_limited and read_cost(method, route.path) > 0)
    responses = operation["responses"]
    operation["operationId"] = route.name
    if needs_token:
        operation["security"] = [{BEARER: []}]
        responses.setdefault("401", error_answer("no token, or one that is unknown or "
                                                 "revoked"))
        responses.setdefault("403", error_answer("the token's scope (or deployment) does "
                                                 "not allow this"))
    if "HTTPValidationError" in str(responses.get("422", "")) or \
            ("422" not in responses and ("parameters" in operation or "requestBody" in operation)):
        responses["422"] = VALIDATION_ERROR
    if "{" in route.path or _names_a_deployment(route):
        responses.setdefault("404", error_answer("what the path (or the deployment the request "
                                                 "names) refers to does not exist"))
    if method not in ("GET", "HEAD"):  # BodySizeLimit reads every other request's body
        responses.setdefault("413", error_answer("the request body is over this route's "
                                                 "size limit"))
    if takes_json_body(route):
        responses.setdefault("415", NOT_JSON)
    if any(getattr(call, "rate_kind", None) not in (None, "read") for call in calls) or \
            (read_limited and read_cost(method, route.path) > 0):
        responses.setdefault("429", error_answer("rate limited: wait Retry-After seconds"))
    responses.setdefault("503", error_answer("the store (or Redis) is unavailable: wait "
                                             "Retry-After seconds"))
    for status, answer in responses.items():
        if status.isdigit() and int(status) >= 400 and "content" not in answer:
            answer["content"] = error_answer("")["content"]
        for media in answer.get("content", {}).values():
            if media.get("schema", {}).get("title", "").startswith("Response "):
                # FastAPI titles an unnamed answer after its path and method; generators
                # prefix the operation to the title ("SignalHistogramResponse")
                media["schema"]["title"] = "Response"
    description = (operation.get("description") or operation.get("summary", "")).strip()
    sentence = next((_SCOPE_SENTENCE[scope] for scope in scopes if scope in _SCOPE_SENTENCE),
                    "Needs a token." if needs_token else "")
    if sentence and sentence not in description:
        description = f"{description.rstrip('.')}. {sentence}"
    operation["description"] = description


def _names_a_deployment(route) -> bool:
    """Whether a query parameter or a field of the JSON body names a deployment (which may not
    exist: 404)."""
    if any(param.name == "deployment" for param in route.dependant.query_params):
        return True
    return any("deployment" in getattr(param.field_info.annotation, "model_fields", ())
               for param in route.dependant.body_params)


def _jsonable(errors: list[dict]) -> list[dict]:
    """Pydantic's errors as JSON: `loc` a list of keys and indexes, `msg`, `type` (the
    offending `input` is not echoed back)."""
    return [{"loc": [part if isinstance(part, int) else str(part) for part in err.get("loc", ())],
             "msg": str(err.get("msg", "")), "type": str(err.get("type", ""))}
            for err in errors]
