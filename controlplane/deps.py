"""Request dependencies in one place: the DB session (commit at the boundary) and the caller."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Annotated

from anyio import to_thread
from fastapi import Depends, Request, Response, params
from fastapi.routing import APIRoute
from sqlalchemy.orm import Session

from controlplane.auth.service import Principal, active_principals, authenticate, digest
from controlplane.errors import NotFound, RateLimited, Unauthorized
from controlplane.guards.buckets import LocalRateLimiter, RedisRateLimiter, Turns

log = logging.getLogger(__name__)


def get_session(request: Request) -> Iterator[Session]:
    """One unit of work per request: commit when the route returns, roll back on error."""
    session = request.app.state.session_factory()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


# scope="function": the commit happens before the response is sent, so a 2xx means stored.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]


class PrincipalCache:
    """Token digest -> principal for at most `ttl` seconds after the lookup began, so hot paths
    skip the token lookup.

    The age is a hard maximum: reading never extends an entry. A revocation clears the entry
    in every API process (the notification bus: at commit in this process, through Redis pub/sub
    in the others, or through the revocation epoch within `revocation_poll_s` without Redis), so
    a revoked token stops working within `ttl` even if that notice is lost. A lookup that was
    under way when a revocation arrived is not cached (generation check), so it cannot bring
    the old principal back.

    A fleet's runtime sends a request every few seconds, further apart than `ttl`, so a cache
    of single lookups missed on nearly every request. A miss therefore first loads
    every active token in one read (`refresh`, at most once per `ttl`, one thread at a time);
    those entries follow the same rules: they expire `ttl` after that read began, and a
    revocation during it discards them.

    With `load` (the read of every active token), that read is also made ahead: a lookup made
    when the last one is past half the maximum age starts the next on a thread of its own and
    answers from the cache meanwhile. A busy process then never has its entries expire at
    once, so no request waits for the read (every entry expired together every `ttl`, and the
    requests that came then queued on worker threads behind one read: pull latency spikes at
    a 1,000-runtime fleet). A token revoked or gone from the read is not renewed, so the
    maximum age still bounds it; an idle process reads nothing."""

    def __init__(self, ttl: float, load: Callable[[], dict[str, Principal]] | None = None
                 ) -> None:
        self._ttl = ttl
        self._load = load
        self._entries: dict[str, tuple[float, Principal]] = {}
        self._generation = 0
        self._lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._refreshed_at = float("-inf")  # when the last read of every token began
        self._ahead = threading.Lock()  # held while a read ahead runs (at most one)

    def refresh_due(self, age: float | None = None) -> bool:
        """Whether the last read of every token is older than `age` (the maximum age)."""
        age = self._ttl if age is None else age
        return self._ttl > 0 and time.monotonic() >= self._refreshed_at + age

    def refresh(self, load: Callable[[], dict[str, Principal]], *, age: float | None = None
                ) -> None:
        """Cache every principal `load` returns (digest -> principal), unless another thread
        did so less than `age` (the maximum age) ago; callers wait for a refresh under way
        instead of starting their own."""
        with self._refresh_lock:
            if not self.refresh_due(age):
                return
            generation, started = self._generation, time.monotonic()
            principals = load()
            with self._lock:
                self._refreshed_at = started
                if generation != self._generation:
                    return  # a revocation arrived meanwhile: the read may predate it
                expires = started + self._ttl
                if len(self._entries) + len(principals) > 10_000:
                    self._entries = {k: e for k, e in self._entries.items() if e[0] >= started}
                for key, principal in principals.items():
                    self._entries[key] = (expires, principal)

    @property
    def generation(self) -> int:
        """Changes whenever entries are dropped; pass it back to `put`."""
        return self._generation

    def peek(self, key: str) -> Principal | None:
        """The cached principal if it is younger than the maximum age. Never extends an
        entry; may start the read ahead (see the class)."""
        now = time.monotonic()
        if self._load is not None and now >= self._refreshed_at + self._ttl / 2 \
                and self._refreshed_at > float("-inf"):
            self._read_ahead()
        entry = self._entries.get(key)
        if entry is None or entry[0] < now:
            return None
        return entry[1]

    def _read_ahead(self) -> None:
        """Start the next read of every token on a thread of its own, unless one runs."""
        if not self._ahead.acquire(blocking=False):
            return

        def read() -> None:
            try:
                self.refresh(self._load, age=self._ttl / 2)
            except Exception:  # the store is away: requests fall back to their own lookups
                log.warning("reading the API tokens ahead failed", exc_info=True)
                time.sleep(self._ttl / 2)  # not again on every request meanwhile
            finally:
                self._ahead.release()

        threading.Thread(target=read, name="token-read-ahead", daemon=True).start()

    def put(self, key: str, principal: Principal, *, generation: int, started: float) -> None:
        """Cache a lookup that began at `started` (monotonic) under `generation`; ignored when
        something was dropped since, as the lookup may predate a revocation."""
        with self._lock:
            if generation != self._generation:
                return
            if len(self._entries) > 10_000:
                now = time.monotonic()
                self._entries = {k: e for k, e in self._entries.items() if e[0] >= now}
            self._entries[key] = (started + self._ttl, principal)

    def drop(self, key: str) -> None:
        with self._lock:
            self._generation += 1
            self._entries.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._generation += 1
            self._entries.clear()

    def on_revocation(self, token_hash: str | None) -> None:
        """Bus listener: drop one token's entry, or all when the notice names none."""
        if token_hash is None:
            self.clear()
        else:
            self.drop(token_hash)


RateLimiter = LocalRateLimiter | RedisRateLimiter


# Scope key: the kind of rate an ASGI layer below the router already took for this request
# (the telemetry fast path hands a heartbeat it cannot parse on to the route).
RATE_TAKEN = "exitplane.rate_taken"


def rate_limited(kind: str):
    """A dependency that refuses a token's request with 429 + Retry-After past its rate."""

    async def dependency(request: Request, principal: Annotated[Principal, Depends(
            get_principal)]) -> None:
        if request.scope.get(RATE_TAKEN) == kind:
            return
        await check_rate(request.app.state, kind, principal)

    dependency.rate_kind = kind  # the OpenAPI document lists its 429 (controlplane/edge/app.py)
    return Depends(dependency)


# Reads take from the token's "read" bucket (EXITPLANE_RATE_LIMIT_READ_PER_S units a second)
# by what they cost the API. Before it runs, a lookup by key takes one unit, and a read that
# scans telemetry, rollups, logs or history, or renders a report, takes HEAVY_READ_COST. When it
# has been answered, a read on a metered route (`MeteredRoute`) also owes what it kept the API
# busy past what it took, into debt (the token's next reads wait until it is paid): a light
# read one unit per READ_UNIT_S, a heavy one a unit per HEAVY_READ_UNIT_S. At the default rate a
# token's reads keep an API busy for at most about one second a second, a quarter of it with
# heavy reads, whatever the store holds or the query asks for; one client that reads one thing
# at a time (pausing three times as long as a heavy read took after it) never waits. A token runs
# HEAVY_READS_AT_ONCE heavy reads at once per API process; HEAVY_READS_WAITING more wait their
# turn, and past them 429. Route paths as FastAPI names them; every GET route of the API not
# listed here is a light read.
HEAVY_READ_COST = 5
READ_UNIT_S = 0.01
HEAVY_READ_UNIT_S = 0.0025
HEAVY_READS_AT_ONCE = 1
HEAVY_READS_WAITING = 8
HEAVY_READS = frozenset({
    "/v1/deployments/{name}/telemetry/exit-rates",
    "/v1/deployments/{name}/telemetry/disagreement",
    "/v1/deployments/{name}/telemetry/signal-histogram",
    "/v1/deployments/{name}/telemetry/count",
    "/v1/deployments/{name}/segments",
    "/v1/deployments/{name}/audit",
    "/v1/deployments/{name}/threshold-sets",
    "/v1/deployments/{name}/runtimes",
    "/v1/deployments/{name}/calibrations",
    "/v1/deployments/{name}/calibrations/{job_id}",
    "/v1/deployments/{name}/canary",
    "/v1/alerts",
    "/v1/alerts/{alert_id}/report",
    "/v1/alerts/{alert_id}/deliveries",
    "/v1/hooks/{hook_id}/deliveries",
})
# Reads with a bucket of their own: a runtime's threshold pull ("pull").
OWN_BUCKET_READS = frozenset({"/v1/deployments/{name}/thresholds"})
READ_METER = "exitplane.read_meter"  # the scope key of a metered request's `ReadMeter`


def read_cost(method: str, route_path: str) -> int:
    """Units a request takes from its token's read bucket (0: not a read, or one with a
    bucket of its own)."""
    if method != "GET" or route_path in OWN_BUCKET_READS:
        return 0
    return HEAVY_READ_COST if route_path in HEAVY_READS else 1


class ReadMeter:
    """One metered read: the heavy-read turn it holds and what it took from its token's bucket,
    settled by `settle` once the route has answered (or failed)."""

    __slots__ = ("key", "limiter", "started", "taken", "turns")

    def __init__(self) -> None:
        self.turns: Turns | None = None
        self.limiter: RateLimiter | None = None
        self.key, self.taken, self.started = "", 0, 0.0

    async def settle(self) -> None:
        """Give the turn back, then owe what the read cost past what it took."""
        if self.turns is not None:
            self.turns.give_back(self.key)
            self.turns = None
        if self.limiter is None:
            return
        unit = HEAVY_READ_UNIT_S if self.taken >= HEAVY_READ_COST else READ_UNIT_S
        owed = (time.monotonic() - self.started) / unit - self.taken
        limiter, self.limiter = self.limiter, None
        if owed >= 1:
            await limiter.owe(self.key, owed)


class MeteredRoute(APIRoute):
    """An API route whose reads are metered (`ReadMeter`): `_read_limit` takes the turn and the
    cost, and this settles them once the route's handler has answered, before the answer is
    sent. Every router of the API uses it (`APIRouter(route_class=MeteredRoute)`)."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()
        if not read_cost("GET", self.path) or "GET" not in self.methods:
            return handler

        async def metered(request: Request) -> Response:
            meter = request.scope[READ_METER] = ReadMeter()
            try:
                return await handler(request)
            finally:
                await meter.settle()

        return metered


async def _read_limit(request: Request) -> None:
    cost = read_cost(request.method, getattr(request.scope.get("route"), "path", ""))
    if not cost:
        return
    state = request.app.state
    principal = await principal_for(state, request.headers.get("authorization", ""))
    key = str(principal.token_id)
    meter: ReadMeter | None = request.scope.get(READ_METER)
    if meter is not None and cost >= HEAVY_READ_COST:
        turns: Turns = state.heavy_read_turns
        if not await turns.take(key):
            await state.refusal_hold()
            raise RateLimited(f"too many heavy reads at once for this token (this process runs "
                              f"{turns.at_once} and queues {turns.waiting}); retry in 1 s",
                              retry_after=1.0)
        meter.turns, meter.key = turns, key
    limiter: RateLimiter = state.rate_limiters["read"]
    wait = await limiter.retry_after(key, cost)
    if wait is not None:
        await state.refusal_hold()
        raise RateLimited(f"too many reads for this token (this one costs {cost} of "
                          f"EXITPLANE_RATE_LIMIT_READ_PER_S, and more if it keeps the API "
                          f"busy longer); retry in {wait:.1f} s", retry_after=wait)
    if meter is not None:
        meter.limiter, meter.key, meter.taken = limiter, key, cost
        meter.started = time.monotonic()


# For the API's routers (`include_router(..., dependencies=[ReadLimited])`): every GET route
# takes its cost from the caller's read bucket, shared by every API process like the others.
_read_limit.rate_kind = "read"  # the OpenAPI document lists its 429 (controlplane/edge/app.py)
ReadLimited = Depends(_read_limit)


async def check_rate(state, kind: str, principal: Principal) -> None:
    """Take one `kind` request from the token's bucket, or RateLimited with the wait once the
    refusal has been held (`RefusalHold`: EXITPLANE_RATE_LIMIT_HOLD_S)."""
    limiter: RateLimiter = state.rate_limiters[kind]
    wait = await limiter.retry_after(str(principal.token_id))
    if wait is not None:
        await state.refusal_hold()
    refuse_past_rate(kind, wait)


def check_rate_blocking(state, kind: str, principal: Principal) -> None:
    """`check_rate` for code already on a worker thread (the same shared bucket)."""
    limiter: RateLimiter = state.rate_limiters[kind]
    refuse_past_rate(kind, limiter.take(str(principal.token_id)))


def refuse_past_rate(kind: str, wait: float | None) -> None:
    """RateLimited (429, Retry-After) when a bucket answered a wait."""
    if wait is not None:
        raise RateLimited(f"too many {kind} requests for this token; retry in {wait:.1f} s",
                          retry_after=wait)


def _bearer(header: str) -> str:
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise Unauthorized("missing API token: send 'Authorization: Bearer <token>'")
    return secret.strip()


# Tokens one refresh reads at most (the cache's own bound); any beyond are looked up singly.
REFRESH_LIMIT = 10_000


def token_reader(factory) -> Callable[[], dict[str, Principal]]:
    """The read of every active token (digest -> principal) the cache refreshes with."""
    def load() -> dict[str, Principal]:
        with factory() as session:
            return active_principals(session=session, limit=REFRESH_LIMIT)

    return load


def _lookup(factory, cache: PrincipalCache, key: str, secret: str) -> Principal:
    """A cache miss (blocking): refresh every active token when due, else look this one up."""
    if cache.refresh_due():
        cache.refresh(token_reader(factory))
        principal = cache.peek(key)
        if principal is not None:
            return principal
    # Not among them: a token created since, a revoked or unknown one (its own message).
    generation, started = cache.generation, time.monotonic()
    with factory() as session:
        principal = authenticate(session=session, secret=secret)
    cache.put(key, principal, generation=generation, started=started)
    return principal


def resolve_principal(state, authorization: str) -> Principal:
    """`principal_for` for code already on a worker thread (blocking)."""
    secret = _bearer(authorization)
    cache: PrincipalCache = state.principal_cache
    key = digest(secret)
    principal = cache.peek(key)
    if principal is None:
        principal = _lookup(state.session_factory, cache, key, secret)
    return principal


def cached_principal(state, authorization: str) -> Principal | None:
    """The caller behind an `Authorization` header value if the token cache holds it; None
    otherwise (a bad header too: `resolve_principal` says what is wrong). Never reads the
    store, so the event loop may call it."""
    try:
        secret = _bearer(authorization)
    except Unauthorized:
        return None
    return state.principal_cache.peek(digest(secret))


async def principal_for(state, authorization: str) -> Principal:
    """The caller behind an `Authorization` header value (cached briefly), or 401; `state` is
    the app's state (the request path and the telemetry fast path share this)."""
    secret = _bearer(authorization)
    cache: PrincipalCache = state.principal_cache
    key = digest(secret)
    principal = cache.peek(key)
    if principal is None:
        principal = await to_thread.run_sync(_lookup, state.session_factory, cache, key,
                                             secret)
    return principal


async def get_principal(request: Request) -> Principal:
    """The caller behind the bearer token (cached briefly), or 401."""
    return await principal_for(request.app.state, request.headers.get("authorization", ""))


def visible_deployment(state, principal: Principal, name: str, versions=()):
    """The deployment `name` as the process caches it (`CachedDeployment`), if `principal` may
    see it (blocking: may read the store). A runtime token is refused alike (403) for
    another deployment and for one that does not exist, so it cannot learn which exist;
    others get NotFound for a missing one."""
    try:
        target = state.deployment_cache.get(name, versions)
    except NotFound:
        if principal.scope == "runtime":
            principal.require_deployment(None)  # no deployment: not the token's own
        raise
    principal.require_deployment(target.id)
    return target


async def _require_visible(state, principal: Principal, name: str) -> None:
    target = state.deployment_cache.peek(name, ())
    if target is None:
        await to_thread.run_sync(visible_deployment, state, principal, name)
    else:
        principal.require_deployment(target.id)


def require(scope: str):
    async def dependency(request: Request,
                         principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
        principal.require(scope)
        # A runtime token sees only its own deployment: refused before any route looks the
        # name up, so a missing deployment answers as another one does (403, not 404).
        name = request.path_params.get("name")
        if principal.scope == "runtime" and name is not None:
            await _require_visible(request.app.state, principal, name)
        return principal

    dependency.required_scope = scope  # the OpenAPI document says so (controlplane/edge/app.py)
    return dependency


RuntimePrincipal = Annotated[Principal, Depends(require("runtime"))]
OperatorPrincipal = Annotated[Principal, Depends(require("operator"))]
AdminPrincipal = Annotated[Principal, Depends(require("admin"))]


def is_json_media(content_type: str) -> bool:
    """Whether a Content-Type names JSON: application/json or application/*+json (any
    parameters, such as a charset)."""
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                            and media.endswith("+json"))


def takes_json_body(route) -> bool:
    """Whether a route reads a JSON body (a body model, not a form; the telemetry route reads
    its content types itself)."""
    body = getattr(route, "body_field", None)
    return body is not None and not isinstance(body.field_info, params.Form)
