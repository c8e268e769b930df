"""Notifications every API process hears: token revocations and config (alias) changes.

A service calls `notify_after_commit(session=..., topic=..., message=...)`; nothing is sent
unless and until that transaction commits (a rollback drops it), so a listener that re-reads the
store always sees the change. At commit the notification goes to:

- the listeners of every Bus in this process, at once;
- with Redis configured, every other process (API replicas, and from workers to the API)
  through Redis pub/sub on channel ``exitplane:notify:<topic>``;
- without Redis (the embedded default: one API process), topics in `EPOCH_TOPICS` also bump a
  counter row in the same transaction; each API process's Bus polls it every `epoch_poll_s`
  and tells its listeners that anything may have changed (message None).

Pub/sub is fire-and-forget: a subscriber that was disconnected may have missed messages, so
on every (re)subscription the Bus tells its listeners None too (drop every cached entry).
Listeners run on the Bus's thread or the committing thread: they must be thread-safe and quick.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable

import redis
from sqlalchemy import event, select, update
from sqlalchemy.orm import Session, sessionmaker

from controlplane.coordination.models import Epoch

log = logging.getLogger("exitplane.coordination")

CHANNEL_PREFIX = "exitplane:notify:"
TOPICS = ("revocation", "config")
EPOCH_TOPICS = ("revocation",)
# How long the listener blocks on Redis between checks of its stop flag: `close()` (an API
# process shutting down, or each test app) waits for at most this, not a whole second.
LISTEN_WAIT_S = 0.1

Listener = Callable[[str | None], None]

# Weak: an application that is gone (tests build many) takes its bus with it.
_buses: weakref.WeakSet[Bus] = weakref.WeakSet()
_buses_lock = threading.Lock()
_fallback: Bus | None = None


def notify_after_commit(*, session: Session, topic: str, message: str) -> None:
    """Announce `message` on `topic` once `session` commits (bumping the topic's epoch in this
    transaction when it has one)."""
    if topic not in TOPICS:
        raise ValueError(f"unknown notification topic {topic!r}")
    if topic in EPOCH_TOPICS:
        bumped = session.execute(update(Epoch).where(Epoch.topic == topic)
                                 .values(epoch=Epoch.epoch + 1))
        if bumped.rowcount == 0:  # the migration seeds the row; recreate it if it went
            session.add(Epoch(topic=topic, epoch=1))
            session.flush()
    session.info.setdefault("notify_after_commit", []).append((topic, message))


@event.listens_for(Session, "after_commit")
def _send_after_commit(session: Session) -> None:
    pending = session.info.pop("notify_after_commit", None)
    if not pending:
        return
    with _buses_lock:
        buses = list(_buses)
    if not buses:  # a worker process: no API in it, only Redis (if any) to tell the others
        buses = [_fallback_bus()]
    for topic, message in dict.fromkeys(pending):
        for bus in buses:
            bus.publish(topic, message)


@event.listens_for(Session, "after_rollback")
def _drop_after_rollback(session: Session) -> None:
    session.info.pop("notify_after_commit", None)


def _fallback_bus() -> Bus:
    global _fallback
    if _fallback is None:
        from controlplane.settings import get_settings

        _fallback = Bus(redis_url=get_settings().redis_url)
    return _fallback


class Bus:
    """One process's end of the notification bus: local listeners, plus Redis pub/sub (when
    `redis_url`) or the epoch poller (when `session_factory` and no Redis) once started."""

    def __init__(self, *, redis_url: str = "", session_factory: sessionmaker | None = None,
                 epoch_poll_s: float = 0.5) -> None:
        self.redis_url = redis_url
        self._session_factory = session_factory
        self._epoch_poll_s = epoch_poll_s
        self._listeners: dict[str, list[Listener]] = defaultdict(list)
        self._publisher = (redis.Redis.from_url(redis_url, socket_connect_timeout=1,
                                                socket_timeout=1) if redis_url else None)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.subscribed = threading.Event()
        with _buses_lock:  # commits in this process reach this bus's listeners from now on
            _buses.add(self)

    @property
    def shared(self) -> bool:
        """True when other processes hear this one's notifications at once (Redis)."""
        return bool(self.redis_url)

    @property
    def listening(self) -> bool:
        """True while this process hears every other process's notices at once (subscribed
        to Redis); otherwise callers must re-read the store on their own schedule."""
        return self.shared and self.subscribed.is_set()

    def subscribe(self, topic: str, listener: Listener) -> None:
        self._listeners[topic].append(listener)

    def deliver(self, topic: str, message: str | None) -> None:
        """Call this process's listeners of `topic` (None: anything may have changed)."""
        for listener in list(self._listeners.get(topic, ())):
            try:
                listener(message)
            except Exception:  # one broken listener must not silence the others
                log.exception("notification listener failed on %s", topic)

    def publish(self, topic: str, message: str) -> None:
        """Tell this process's listeners, then every other process through Redis."""
        self.deliver(topic, message)
        if self._publisher is None:
            return
        try:
            self._publisher.publish(CHANNEL_PREFIX + topic, message)
        except redis.RedisError as error:
            # The change is committed; other processes' caches still expire by their own
            # bound (token cache max age, config cache TTL), so this only delays them.
            log.warning("could not publish %s notification: %s", topic, type(error).__name__)

    def unsubscribe(self, topic: str, listener: Listener) -> None:
        if listener in self._listeners.get(topic, ()):
            self._listeners[topic].remove(listener)

    def start(self) -> Bus:
        """Start listening to the other processes (Redis pub/sub, else the store's epochs)."""
        if self.redis_url:
            target = self._listen_redis
        elif self._session_factory is not None:
            target = self._poll_epochs
        else:
            return self
        self._thread = threading.Thread(target=target, name="exitplane-bus", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        with _buses_lock:
            _buses.discard(self)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._publisher is not None:
            self._publisher.close()

    def _reset_all(self) -> None:
        for topic in TOPICS:
            self.deliver(topic, None)

    def _listen_redis(self) -> None:
        channels = [CHANNEL_PREFIX + topic for topic in TOPICS]
        while not self._stop.is_set():
            client = redis.Redis.from_url(self.redis_url, socket_connect_timeout=2,
                                          socket_timeout=5, health_check_interval=10)
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(*channels)
                self._reset_all()  # anything published while we were away was missed
                self.subscribed.set()
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=LISTEN_WAIT_S)
                    if message is None:
                        continue
                    topic = message["channel"].decode().removeprefix(CHANNEL_PREFIX)
                    self.deliver(topic, message["data"].decode())
            except (redis.RedisError, OSError) as error:
                if self.subscribed.is_set():
                    self.subscribed.clear()
                    # Wake whoever waits on a notice: until we are back they must re-read.
                    self._reset_all()
                log.warning("notification bus lost Redis (%s); reconnecting",
                            type(error).__name__)
                self._stop.wait(1.0)
            finally:
                pubsub.close()
                client.close()

    def _poll_epochs(self) -> None:
        seen: dict[str, int] | None = None
        while not self._stop.is_set():
            try:
                with self._session_factory() as session:
                    rows = session.execute(select(Epoch.topic, Epoch.epoch))
                    epochs = {row.topic: row.epoch for row in rows}
            except Exception as error:  # the store briefly away: keep the last epochs
                log.warning("could not read coordination epochs: %s", type(error).__name__)
            else:
                if seen is not None:
                    for topic, epoch in epochs.items():
                        if seen.get(topic) != epoch:
                            self.deliver(topic, None)
                seen = epochs
                self.subscribed.set()
            self._stop.wait(self._epoch_poll_s)
