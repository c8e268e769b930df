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

    async def current(self, name: str, *, max_age: float | None = None) -> DeliveryState:
        self._loop = asyncio.get_running_loop()
        max_age = self._ttl if max_age is None else max_age
        state = self._states.get(name)
        if state is None or time.monotonic() - state.loaded_at > max_age:
            state = await to_thread.run_sync(self.load, name)
            self._states[name] = state
        return state

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

