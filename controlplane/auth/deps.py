"""Who is calling: the bearer token of a request resolved to its principal (cached briefly in
each API process), and the dependencies routes declare for the scope they need."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Annotated

from anyio import to_thread
from fastapi import Depends, Request

from controlplane.auth.service import Principal, active_principals, authenticate, digest
from controlplane.errors import Unauthorized
from exitplane.kit.bearer import bearer_token

log = logging.getLogger(__name__)


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


def _bearer(authorization: str) -> str:
    """The token of an `Authorization` header value, or 401 saying how to send one."""
    secret = bearer_token(authorization)
    if secret is None:
        raise Unauthorized("missing API token: send 'Authorization: Bearer <token>'")
    return secret


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
    secret = bearer_token(authorization)
    if secret is None:
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


# A check of a runtime token against the deployment its path names: (app state, principal,
# name) -> None, or raises (403 for another deployment's).
Reach = Callable[[object, Principal, str], Awaitable[None]]


def require(scope: str, *, reach: Reach | None = None):
    """A dependency answering the caller, refused (403) below `scope`. With `reach`, a runtime
    token on a path naming a deployment (`{name}`) is checked by `reach(state, principal,
    name)` before any route looks the name up, so a missing deployment answers as another one
    does (403, not 404)."""
    async def dependency(request: Request,
                         principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
        principal.require(scope)
        if reach is not None and principal.scope == "runtime":
            name = request.path_params.get("name")
            if name is not None:
                await reach(request.app.state, principal, name)
        return principal

    dependency.required_scope = scope  # the OpenAPI document says so (controlplane/edge/openapi.py)
    return dependency


OperatorPrincipal = Annotated[Principal, Depends(require("operator"))]
AdminPrincipal = Annotated[Principal, Depends(require("admin"))]
