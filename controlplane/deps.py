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
    """Token digest -> principal for `ttl` seconds, so hot paths skip the token lookup.

    When an entry expires, the first caller re-checks the store while the others keep using
    the entry for up to a second; a revoked token therefore stops working within ttl + 1 s
    (at once in the process that revoked it)."""

    def __init__(self, ttl: float) -> None:
        self._ttl = ttl
        self._entries: dict[str, tuple[float, Principal]] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> Principal | None:
        """A usable principal, or None when the caller must look the token up."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        expires, principal = entry
        now = time.monotonic()
        if expires >= now:
            return principal
        with self._lock:
            if self._entries.get(key) is entry:  # we are first past expiry: we refresh
                self._entries[key] = (now + 1.0, principal)
                return None
        return principal

    def put(self, key: str, principal: Principal) -> None:
        with self._lock:
            if len(self._entries) > 10_000:
                self._entries.clear()
            self._entries[key] = (time.monotonic() + self._ttl, principal)

    def drop(self, key: str) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


class RateLimiter:
    """A token bucket per key: `rate` requests per second with bursts of 2 x rate."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.burst = max(1.0, 2 * rate)
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def retry_after(self, key: str) -> float | None:
        """Take one request from `key`'s bucket; the seconds to wait when it is empty."""
        if self.rate <= 0:
            return None
        now = time.monotonic()
        with self._lock:
            level, last = self._buckets.get(key, (self.burst, now))
            level = min(self.burst, level + (now - last) * self.rate)
            if level < 1.0:
                self._buckets[key] = (level, now)
                return (1.0 - level) / self.rate
            self._buckets[key] = (level - 1.0, now)
            if len(self._buckets) > 100_000:
                self._buckets.clear()
            return None


def rate_limited(kind: str):
    """A dependency that refuses a token's request with 429 + Retry-After past its rate."""

    async def dependency(request: Request, principal: Annotated[Principal, Depends(
            get_principal)]) -> None:
        limiter: RateLimiter = request.app.state.rate_limiters[kind]
        wait = limiter.retry_after(str(principal.token_id))
        if wait is not None:
            raise RateLimited(f"too many {kind} requests for this token; retry in {wait:.1f} s",
                              retry_after=wait)

    return Depends(dependency)


def _bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise Unauthorized("missing API token: send 'Authorization: Bearer <token>'")
    return secret.strip()


def _lookup(request: Request, secret: str) -> Principal:
    with request.app.state.session_factory() as session:
        return authenticate(session=session, secret=secret)


async def get_principal(request: Request) -> Principal:
    """The caller behind the bearer token (cached briefly), or 401."""
    secret = _bearer(request)
    cache: PrincipalCache = request.app.state.principal_cache
    key = digest(secret)
    principal = cache.get(key)
    if principal is None:
        try:
            principal = await to_thread.run_sync(_lookup, request, secret)
        except Unauthorized:
            cache.drop(key)
            raise
        cache.put(key, principal)
    return principal


def require(scope: str):
    async def dependency(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
        principal.require(scope)
        return principal

    return dependency


RuntimePrincipal = Annotated[Principal, Depends(require("runtime"))]
OperatorPrincipal = Annotated[Principal, Depends(require("operator"))]
AdminPrincipal = Annotated[Principal, Depends(require("admin"))]
