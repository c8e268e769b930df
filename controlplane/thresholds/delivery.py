"""Config delivery: which threshold set each runtime should apply, cached, with long-poll.

The resolved state of a deployment (active set, canary set and fraction) is cached for
`ttl` seconds per API process. A commit that moves an alias in this process invalidates the
cache and wakes the long-polls at once; moves made by other processes (workers) are seen
within `ttl`, because a long-poll re-reads the state that often.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from anyio import to_thread
from sqlalchemy import event, select
from sqlalchemy.orm import Session, sessionmaker

from controlplane.thresholds.models import Alias, ThresholdSet
from controlplane.thresholds.service import get_deployment, in_canary, to_wire
from exitplane.wire import ThresholdSetWire

_change_listeners: list[Callable[[str], None]] = []


@event.listens_for(Session, "after_commit")
def _announce_config_changes(session: Session) -> None:
    changed = session.info.pop("config_changed", None)
    for name in changed or ():
        for listener in list(_change_listeners):
            listener(name)


@event.listens_for(Session, "after_rollback")
def _forget_config_changes(session: Session) -> None:
    session.info.pop("config_changed", None)


@dataclass(frozen=True)
class DeliveryState:
    """A deployment's resolved config at one revision."""

    deployment_id: int
    revision: int
    active: ThresholdSetWire
    canary: ThresholdSetWire | None
    canary_fraction: float
    loaded_at: float

    def for_runtime(self, runtime_id: str) -> ThresholdSetWire:
        if self.canary is not None and in_canary(runtime_id=runtime_id,
                                                 fraction=self.canary_fraction):
            return self.canary
        return self.active


class ConfigDelivery:
    """Per-process cache of DeliveryState plus wake-ups for long-polling runtimes."""

    def __init__(self, session_factory: sessionmaker[Session], ttl: float) -> None:
        self._session_factory = session_factory
        self._ttl = ttl
        self._states: dict[str, DeliveryState] = {}
        self._events: dict[str, asyncio.Event] = {}
        self._refreshing: dict[str, asyncio.Future[DeliveryState]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        _change_listeners.append(self.invalidate)

    def close(self) -> None:
        if self.invalidate in _change_listeners:
            _change_listeners.remove(self.invalidate)

    def load(self, name: str) -> DeliveryState:
        """Read the deployment's aliases and sets from the store (blocking)."""
        with self._session_factory() as session:
            deployment = get_deployment(session=session, name=name)
            aliases = dict(session.execute(select(Alias.name, Alias.version)
                                           .where(Alias.deployment_id == deployment.id)).all())
            wanted = {aliases["active"], aliases.get("canary", aliases["active"])}
            sets = {s.version: s for s in session.scalars(select(ThresholdSet).where(
                ThresholdSet.deployment_id == deployment.id, ThresholdSet.version.in_(wanted)))}
            active = to_wire(deployment=deployment, threshold_set=sets[aliases["active"]])
            canary = None
            if "canary" in aliases and aliases["canary"] != aliases["active"]:
                canary = to_wire(deployment=deployment, threshold_set=sets[aliases["canary"]])
            return DeliveryState(deployment_id=deployment.id, revision=deployment.revision,
                                 active=active, canary=canary,
                                 canary_fraction=deployment.canary_fraction,
                                 loaded_at=time.monotonic())

    def cached(self, name: str) -> DeliveryState | None:
        """The cached state if it is fresh, without touching the store."""
        state = self._states.get(name)
        if state is None or time.monotonic() - state.loaded_at > self._ttl:
            return None
        return state

    async def current(self, name: str, *, max_age: float | None = None) -> DeliveryState:
        """The cached state, refreshed by one caller at a time (stale-while-revalidate).

        While a refresh runs, other callers get the previous state, so a cache expiry under
        load costs one store read, not one per waiting request."""
        self._loop = asyncio.get_running_loop()
        max_age = self._ttl if max_age is None else max_age
        state = self._states.get(name)
        if state is not None and time.monotonic() - state.loaded_at <= max_age:
            return state
        refresh = self._refreshing.get(name)
        if refresh is None:
            refresh = asyncio.ensure_future(self._refresh(name))
            self._refreshing[name] = refresh
        if state is not None and not refresh.done():
            return state
        return await asyncio.shield(refresh)

    async def _refresh(self, name: str) -> DeliveryState:
        try:
            state = await to_thread.run_sync(self.load, name)
            self._states[name] = state
            return state
        finally:
            self._refreshing.pop(name, None)

    async def wait_for_change(self, name: str, runtime_id: str, etag: str,
                              timeout: float) -> DeliveryState:
        """Return as soon as this runtime's set differs from `etag`, or after `timeout`."""
        deadline = time.monotonic() + timeout
        recheck = max(self._ttl, 0.05)
        while True:
            wake = self._events.setdefault(name, asyncio.Event())
            state = await self.current(name)
            remaining = deadline - time.monotonic()
            if state.for_runtime(runtime_id).checksum != etag or remaining <= 0:
                return state
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout=min(recheck, remaining))

    def invalidate(self, name: str) -> None:
        """Drop the cached state and wake long-polls (safe to call from any thread)."""
        self._states.pop(name, None)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake, name)

    def _wake(self, name: str) -> None:
        self._states.pop(name, None)
        wake = self._events.pop(name, None)
        if wake is not None:
            wake.set()



class NotModifiedFastPath:
    """Pure-ASGI answer for the hottest request in the system: a runtime polling with a
    current ETag and no long-poll. When the caller's token and the deployment's state are both
    in the caches, it answers 304 without entering FastAPI; anything else (a miss, a changed
    set, a long-poll, a bad token) falls through to the full route, which decides."""

    def __init__(self, app, *, delivery: ConfigDelivery, principals, digest, limiter) -> None:
        self.app = app
        self.delivery = delivery
        self.principals = principals
        self.digest = digest
        self.limiter = limiter

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET":
            path: str = scope["path"]
            if path.startswith("/v1/deployments/") and path.endswith("/thresholds"):
                headers = await self._answer(scope)
                if headers is not None:
                    await send({"type": "http.response.start", "status": 304,
                                "headers": headers})
                    await send({"type": "http.response.body", "body": b""})
                    return
        await self.app(scope, receive, send)

    async def _answer(self, scope) -> list[tuple[bytes, bytes]] | None:
        name = scope["path"][len("/v1/deployments/"):-len("/thresholds")]
        state = self.delivery.cached(name)
        if state is None:
            return None
        query = dict(part.partition("=")[::2]
                     for part in scope["query_string"].decode("latin-1").split("&") if part)
        runtime_id = query.get("runtime_id", "")
        if not runtime_id or "%" in runtime_id or query.get("wait", "0") not in ("", "0"):
            return None
        auth = etag = None
        for key, value in scope["headers"]:
            if key == b"authorization":
                auth = value.decode("latin-1")
            elif key == b"if-none-match":
                etag = value.decode("latin-1")
        if not auth or not etag or auth[:7].lower() != "bearer ":
            return None
        principal = self.principals.get(self.digest(auth[7:].strip()))
        if principal is None or (principal.scope == "runtime"
                                 and principal.deployment_id != state.deployment_id):
            return None
        chosen = state.for_runtime(runtime_id)
        if etag.strip().removeprefix("W/").strip('"') != chosen.checksum:
            return None
        if self.limiter.retry_after(str(principal.token_id)) is not None:
            return None  # the full route answers 429
        return [(b"etag", f'"{chosen.checksum}"'.encode()), (b"cache-control", b"no-cache"),
                (b"x-exitplane-version", str(chosen.version).encode())]
