"""Request dependencies in one place: the DB session (commit at the boundary) and the caller."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Annotated

from anyio import to_thread
from fastapi import Depends, Request
from sqlalchemy.orm import Session

from controlplane.auth.service import Principal, authenticate, digest
from controlplane.coordination.limits import LocalRateLimiter, RedisRateLimiter
from controlplane.errors import RateLimited, Unauthorized


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
    the old principal back."""

    def __init__(self, ttl: float) -> None:
        self._ttl = ttl
        self._entries: dict[str, tuple[float, Principal]] = {}
        self._generation = 0
        self._lock = threading.Lock()

    @property
    def generation(self) -> int:
        """Changes whenever entries are dropped; pass it back to `put`."""
        return self._generation

    def peek(self, key: str) -> Principal | None:
        """The cached principal if it is younger than the maximum age; no side effects."""
        entry = self._entries.get(key)
        if entry is None or entry[0] < time.monotonic():
            return None
        return entry[1]

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


def rate_limited(kind: str):
    """A dependency that refuses a token's request with 429 + Retry-After past its rate."""

    async def dependency(request: Request, principal: Annotated[Principal, Depends(
            get_principal)]) -> None:
        await check_rate(request.app.state, kind, principal)

    return Depends(dependency)


async def check_rate(state, kind: str, principal: Principal) -> None:
    """Take one `kind` request from the token's bucket, or RateLimited with the wait."""
    limiter: RateLimiter = state.rate_limiters[kind]
    wait = await limiter.retry_after(str(principal.token_id))
    if wait is not None:
        raise RateLimited(f"too many {kind} requests for this token; retry in {wait:.1f} s",
                          retry_after=wait)


def _bearer(header: str) -> str:
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise Unauthorized("missing API token: send 'Authorization: Bearer <token>'")
    return secret.strip()


def _lookup(factory, secret: str) -> Principal:
    with factory() as session:
        return authenticate(session=session, secret=secret)


async def principal_for(state, authorization: str) -> Principal:
    """The caller behind an `Authorization` header value (cached briefly), or 401; `state` is
    the app's state (the request path and the telemetry fast path share this)."""
    secret = _bearer(authorization)
    cache: PrincipalCache = state.principal_cache
    key = digest(secret)
    principal = cache.peek(key)
    if principal is None:
        generation, started = cache.generation, time.monotonic()
        principal = await to_thread.run_sync(_lookup, state.session_factory, secret)
        cache.put(key, principal, generation=generation, started=started)
    return principal


async def get_principal(request: Request) -> Principal:
    """The caller behind the bearer token (cached briefly), or 401."""
    return await principal_for(request.app.state, request.headers.get("authorization", ""))


def require(scope: str):
    async def dependency(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
        principal.require(scope)
        return principal

    return dependency


RuntimePrincipal = Annotated[Principal, Depends(require("runtime"))]
OperatorPrincipal = Annotated[Principal, Depends(require("operator"))]
AdminPrincipal = Annotated[Principal, Depends(require("admin"))]
