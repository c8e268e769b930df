"""Config delivery: which threshold set each runtime should apply, cached, with long-poll, and
the rules of a pull (ETag match, headers, the wait) that the pull route and the edge's fast
path both apply.

The resolved state of a deployment (active set, canary set and fraction) is cached for
`ttl` seconds per API process. A commit that moves an alias announces it on the notification
bus ("config" topic, after the commit): this process's cache is dropped and its long-polls
wake at once. With Redis configured the same notice reaches every other API process through
pub/sub, whether the move was made by an API replica or a Celery worker, so long-polls simply
wait for it. Without Redis (one API process, workers elsewhere), or while Redis is away, a
long-poll also re-reads the state every `ttl`, which is how moves made elsewhere are seen.
Re-reading a cached state costs one row (the deployment's revision, canary fraction and shadow
rates) while none changed; the sets are read and serialised again only when one did.

The shadow rate the control plane decided (controlplane/deployments/shadow_rate.py) goes out
with the set, outside its checksum (`ThresholdPull.shadow_rate`). A runtime that applies it
says so (`applies_shadow_rate=true`) and gets the ETag `pull_etag(checksum, rate)`, so a change
of rate alone changes what its If-None-Match compares; any other runtime gets the set's
checksum alone. A change of rate is announced on the bus like an alias move. The share of
whole requests the deployment asks runtimes to serve as shadow requests
(`Deployment.shadow_request_rate`, `ThresholdPull.shadow_request_rate`) goes out the same way;
its `.r<rate>` part of the ETag goes only to runtimes that say they serve shadow requests
(`applies_shadow_requests=true`), so a runtime that knows the shadow rate alone keeps the tag
it computes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

from anyio import to_thread
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from controlplane.coordination.bus import Bus
from controlplane.deployments.models import Alias, Deployment, ThresholdSet
from controlplane.deployments.service import get_deployment, in_canary, to_wire
from controlplane.observability import long_poll_waited
from exitplane.wire import ThresholdPull, ThresholdSetWire, pull_etag

log = logging.getLogger("exitplane.delivery")


@dataclass(frozen=True)
class DeliveryState:
    """A deployment's resolved config at one revision."""

    deployment_id: int
    revision: int
    active: ThresholdSetWire
    canary: ThresholdSetWire | None
    canary_fraction: float
    loaded_at: float
    # The sets' pull bodies (`ThresholdPull`, the shadow rate in), serialised once per state:
    # an alias move answers every waiting long-poll of this process at once with one of these.
    active_json: str = ""
    canary_json: str = ""
    shadow_rate: float | None = None  # what the control plane asks runtimes to apply
    shadow_request_rate: float | None = None  # likewise, the share of shadow requests

    def for_runtime(self, runtime_id: str) -> ThresholdSetWire:
        if self.canary is not None and _in_canary(runtime_id, self.canary_fraction):
            return self.canary
        return self.active

    def body(self, chosen: ThresholdSetWire) -> str:
        """The JSON pull body of `chosen` (this state's active or canary set)."""
        if chosen is self.active and self.active_json:
            return self.active_json
        if chosen is self.canary and self.canary_json:
            return self.canary_json
        return pull_body(chosen, self.shadow_rate, self.shadow_request_rate)

    def etag(self, chosen: ThresholdSetWire, applies_shadow_rate: bool,
             applies_shadow_requests: bool = False) -> str:
        """The entity tag of `chosen` for a runtime that applies the shadow rate, serves shadow
        requests at the control plane's rate, both or neither (`pull_etag` of the rates it
        applies)."""
        return pull_etag(chosen.checksum, self.shadow_rate if applies_shadow_rate else None,
                         self.shadow_request_rate if applies_shadow_requests else None)


def pull_body(chosen: ThresholdSetWire, shadow_rate: float | None,
              shadow_request_rate: float | None = None) -> str:
    """The JSON a pull answers with: the set and the shadow rates (each absent when none)."""
    if shadow_rate is None and shadow_request_rate is None:
        return chosen.model_dump_json()
    return ThresholdPull(**chosen.model_dump(), shadow_rate=shadow_rate,
                         shadow_request_rate=shadow_request_rate).model_dump_json()


class ConfigDelivery:
    """Per-process cache of DeliveryState plus wake-ups for long-polling runtimes."""

    def __init__(self, session_factory: sessionmaker[Session], ttl: float, *, bus: Bus,
                 long_polls_per_token: int = 0) -> None:
        self._session_factory = session_factory
        self._ttl = ttl
        self._bus = bus
        # Long-polls held per token id in this process, capped (0: no cap) so that one token
        # cannot hold every socket and file descriptor the process has.
        self.long_polls_per_token = long_polls_per_token
        self._held: collections.Counter[int] = collections.Counter()
        self._states: dict[str, DeliveryState] = {}
        self._events: dict[str, asyncio.Event] = {}
        self._refreshing: dict[str, asyncio.Future[DeliveryState]] = {}
        self._ahead_after: dict[str, float] = {}  # no read ahead of a deployment before then
        # Bumped by every notice (any deployment): a store read that began before a move
        # may return the state from before it, and must not be cached as fresh after it.
        self._generation = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        bus.subscribe("config", self.invalidate)

    def close(self) -> None:
        self._bus.unsubscribe("config", self.invalidate)

    def load(self, name: str) -> DeliveryState:
        """Read the deployment's aliases and sets from the store (blocking).

        While a state of `name` is cached, one row is read first: the deployment's id,
        revision (every alias move bumps it, in the move's transaction) and canary fraction.
        Unchanged, the cached state is current and is renewed as it is (the sets are
        immutable); only a change (an alias move, the canary fraction, the shadow rate) reads
        the aliases and sets and serialises them again."""
        with self._session_factory() as session:
            previous = self._states.get(name)
            if previous is not None:
                started = time.monotonic()
                row = session.execute(select(
                    Deployment.id, Deployment.revision, Deployment.canary_fraction,
                    Deployment.shadow_rate, Deployment.shadow_request_rate,
                ).where(Deployment.name == name)).one_or_none()
                if row is not None and tuple(row) == (previous.deployment_id, previous.revision,
                                                      previous.canary_fraction,
                                                      previous.shadow_rate,
                                                      previous.shadow_request_rate):
                    return replace(previous, loaded_at=started)
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
            rates = (deployment.shadow_rate, deployment.shadow_request_rate)
            return DeliveryState(deployment_id=deployment.id, revision=deployment.revision,
                                 active=active, canary=canary,
                                 canary_fraction=deployment.canary_fraction,
                                 loaded_at=time.monotonic(),
                                 active_json=pull_body(active, *rates),
                                 canary_json=pull_body(canary, *rates) if canary else "",
                                 shadow_rate=rates[0], shadow_request_rate=rates[1])

    def cached(self, name: str) -> DeliveryState | None:
        """The cached state if it is fresh, without touching the store (on the event loop).

        Past half its age a read of the next state starts in the background, so a busy
        process swaps states before one expires; should the read take longer (it waits for
        the interpreter behind a busy event loop), the state is answered until it is back,
        as `current` answers the route meanwhile. Expired, every request until the read came
        back took the full route (about six times the cost of this path, and the read then
        competes with them for the interpreter: at 10,000 pulls/s an eighth of them went that
        way). A notice (an alias move) drops the state at once either way."""
        state = self._states.get(name)
        if state is None:
            return None
        now = time.monotonic()
        age = now - state.loaded_at
        if self._ttl > 0 and age > self._ttl / 2 and name not in self._refreshing \
                and now >= self._ahead_after.get(name, 0.0):
            self._read_ahead(name, now)
        if age <= self._ttl or (self._ttl > 0 and name in self._refreshing):
            return state  # while the read runs, as `current` answers the route meanwhile
        return None

    def _read_ahead(self, name: str, now: float) -> None:
        """Start reading `name`'s state in the background (at most once per half age, so a
        store that is away is not asked again on every request)."""
        self._ahead_after[name] = now + self._ttl / 2
        self._loop = asyncio.get_running_loop()
        refresh = asyncio.ensure_future(self._refresh(name))
        self._refreshing[name] = refresh
        refresh.add_done_callback(_log_failed_read)

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
        """Read the state and cache it; read again while a notice arrived during the read.

        A read that began before a move's commit can finish after the move's notice has
        dropped the cache and woken the long-polls: cached, that old state would answer them
        (and every pull, for the cache's TTL) as current, and with Redis a woken long-poll
        waits for the next notice only, so it would hold the old set until its wait ends."""
        try:
            while True:
                generation = self._generation
                state = await to_thread.run_sync(self.load, name)
                if self._generation == generation:
                    self._states[name] = state
                    return state
        finally:
            self._refreshing.pop(name, None)

    @contextlib.contextmanager
    def holding(self, token_id: int) -> Iterator[bool]:
        """Count a long-poll held for `token_id` while inside; yields False (and counts
        nothing) when the token already holds its cap."""
        if self.long_polls_per_token and self._held[token_id] >= self.long_polls_per_token:
            yield False
            return
        self._held[token_id] += 1
        try:
            yield True
        finally:
            self._held[token_id] -= 1
            if not self._held[token_id]:
                del self._held[token_id]

    async def wait_for_change(self, name: str, runtime_id: str, etag: str,
                              timeout: float, *, applies_shadow_rate: bool = False,
                              applies_shadow_requests: bool = False) -> DeliveryState:
        """Return as soon as this runtime's entity tag (`DeliveryState.etag`: its set, and
        the shadow rate when it applies one) differs from `etag`, or after `timeout`. The
        time spent here is the long-poll's wait (its own histogram; not the pull's latency)."""
        started = time.monotonic()
        deadline = started + timeout
        try:
            while True:
                # Subscribed to Redis, every move (any process, any worker) wakes us; otherwise
                # a move made elsewhere is only seen by re-reading the store.
                recheck = float("inf") if self._bus.listening else max(self._ttl, 0.05)
                wake = self._events.setdefault(name, asyncio.Event())
                state = await self.current(name)
                remaining = deadline - time.monotonic()
                if state.etag(state.for_runtime(runtime_id), applies_shadow_rate,
                              applies_shadow_requests) != etag \
                        or remaining <= 0:
                    return state
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), timeout=min(recheck, remaining))
        finally:
            long_poll_waited(time.monotonic() - started)

    def invalidate(self, name: str | None) -> None:
        """Drop the cached state of `name` (None: of every deployment) and wake its long-polls
        (safe to call from any thread)."""
        self._generation += 1  # before the drop: a read finishing now must read again
        if name is None:
            self._states.clear()
        else:
            self._states.pop(name, None)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._wake, name)

    def _wake(self, name: str | None) -> None:
        names = list(self._events) if name is None else [name]
        for each in names:
            self._states.pop(each, None)
            wake = self._events.pop(each, None)
            if wake is not None:
                wake.set()


@functools.lru_cache(maxsize=16_384)
def _in_canary(runtime_id: str, fraction: float) -> bool:
    """`in_canary`, hashed once per runtime and fraction (a runtime pulls for its whole life)."""
    return in_canary(runtime_id=runtime_id, fraction=fraction)


def _log_failed_read(refresh: asyncio.Future) -> None:
    """Done callback of a read ahead: nobody awaits it, so its failure is logged here (the
    requests go on with the cached state, then with the route, which answers for the store)."""
    if not refresh.cancelled() and refresh.exception() is not None:
        log.warning("reading a deployment's config ahead failed: %s",
                    type(refresh.exception()).__name__)


# The longest wait (seconds) a pull may ask for; EXITPLANE_LONG_POLL_MAX_S caps what it gets.
MAX_WAIT_S = 300


def etag_matches(if_none_match: str | None, etag: str) -> bool:
    """Whether an If-None-Match value names the answer of entity tag `etag`
    (`DeliveryState.etag`): one entity tag or a list, weak (`W/"..."`) or strong, or `*`."""
    if not if_none_match:
        return False
    if "," not in if_none_match:  # one tag, as runtimes send it: no list built
        tag = if_none_match.strip().removeprefix("W/").strip('"')
        return tag == etag or tag == "*"
    tags = {tag.strip().removeprefix("W/").strip('"') for tag in if_none_match.split(",")}
    return "*" in tags or etag in tags


@functools.lru_cache(maxsize=256)
def pull_headers(etag: str, version: int) -> tuple[tuple[bytes, bytes], ...]:
    """The headers of every pull answer (200 or 304) for one set: its ETag (`etag`, the set's
    checksum with the shadow rate when the runtime applies one), `no-cache` and its version
    (built once per answer, not per request)."""
    return ((b"etag", f'"{etag}"'.encode()), (b"cache-control", b"no-cache"),
            (b"x-exitplane-version", str(version).encode()))


def long_poll_timeout(wait: float, settings) -> float:
    """How long a pull asking to `wait` seconds is held: at most EXITPLANE_LONG_POLL_MAX_S."""
    return min(wait, settings.long_poll_max_s)
