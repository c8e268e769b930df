"""The notification bus: a commit's notice reaches listeners only after the commit, other
processes hear it through Redis pub/sub, and a subscriber that lost Redis tells its listeners
to drop everything once it is back (it may have missed notices meanwhile)."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy.orm import Session

from controlplane.coordination.bus import Bus, notify_after_commit
from tests.conftest import wait_until
from tests.reliability.conftest import PrivateRedis


@pytest.fixture
def private_redis():
    server = PrivateRedis()
    server.start()
    yield server
    server.cleanup()


class Heard:
    def __init__(self) -> None:
        self.messages: list[str | None] = []
        self._lock = threading.Lock()

    def __call__(self, message: str | None) -> None:
        with self._lock:
            self.messages.append(message)


def test_notices_wait_for_the_commit(engine):
    bus, heard = Bus(), Heard()
    bus.subscribe("config", heard)
    with Session(engine) as session:
        notify_after_commit(session=session, topic="config", message="chat")
        session.flush()
        assert heard.messages == []
        session.rollback()
    assert heard.messages == []
    with Session(engine) as session:
        notify_after_commit(session=session, topic="config", message="chat")
        session.commit()
    assert heard.messages == ["chat"]
    with pytest.raises(ValueError, match="unknown notification topic"):
        notify_after_commit(session=Session(engine), topic="nonsense", message="x")


def test_other_processes_hear_through_redis_and_reset_after_an_outage(private_redis):
    sender, receiver = Bus(redis_url=private_redis.url), Bus(redis_url=private_redis.url)
    heard = Heard()
    receiver.subscribe("revocation", heard)
    receiver.start()
    try:
        wait_until(receiver.subscribed.is_set, 10, "the receiver to subscribe")
        heard.messages.clear()  # the reset every (re)subscription starts with
        sender.publish("revocation", "digest-1")
        wait_until(lambda: "digest-1" in heard.messages, 5, "the notice over pub/sub")
        private_redis.kill()
        wait_until(lambda: not receiver.subscribed.is_set(), 15, "the receiver to lose Redis")
        heard.messages.clear()
        private_redis.start()
        wait_until(lambda: None in heard.messages, 15, "a reset after resubscribing")
    finally:
        receiver.close()
        sender.close()
