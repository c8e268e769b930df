"""The notification bus: a commit's notice reaches listeners only after the commit, other
processes hear it through Redis pub/sub, and a subscriber that lost Redis tells its listeners
to drop everything once it is back (it may have missed notices meanwhile)."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy.orm import Session

from controlplane.coordination.bus import Bus, notify_after_commit
from tests.support.waiting import wait_until


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


@pytest.mark.slow  # a redis-server process, killed and restarted
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


@pytest.mark.slow  # a redis-server and a Python process
def test_long_polls_reread_the_store_while_redis_is_away(settings, engine, tokens,
                                                         private_redis, tmp_path):
    """A move whose notice cannot travel (Redis is down) still reaches a waiting long-poll,
    within the config cache's TTL, because the poll re-reads while not subscribed."""
    import os
    import subprocess
    import sys
    import time

    from fastapi.testclient import TestClient

    from exitplane.app import create_app
    from tests.support.processes import ROOT

    app = create_app(settings.model_copy(update={"redis_url": private_redis.url,
                                                 "config_cache_ttl_s": 0.2}), engine=engine)
    admin = tokens.headers(tokens.admin)
    with TestClient(app) as client:
        wait_until(app.state.bus.subscribed.is_set, 10, "the bus to subscribe")
        assert client.post("/v1/deployments", headers=admin, json={
            "name": "chat", "model_ref": "m", "num_layers": 12,
            "exit_layers": [3, 6, 9]}).status_code == 201
        assert client.post("/v1/deployments/chat/threshold-sets", headers=admin, json={
            "thresholds": {"3": 0.9, "6": 0.9, "9": 0.9}, "reason": "v2",
            "activate": True}).status_code == 201
        etag = client.get("/v1/deployments/chat/thresholds", headers=admin,
                          params={"runtime_id": "rt-1"}).headers["etag"]
        private_redis.kill()
        wait_until(lambda: not app.state.bus.listening, 15, "the bus to notice Redis is gone")
        answers: list = []
        waiting = threading.Thread(target=lambda: answers.append(client.get(
            "/v1/deployments/chat/thresholds", headers={**admin, "If-None-Match": etag},
            params={"runtime_id": "rt-1", "wait": 20})))
        waiting.start()
        time.sleep(0.5)
        moved_at = time.monotonic()
        env = {**os.environ, "EXITPLANE_DATABASE_URL": settings.database_url,
               "EXITPLANE_REDIS_URL": private_redis.url, "EXITPLANE_VAR_DIR": str(tmp_path)}
        subprocess.run([sys.executable, "-c", (
            "from sqlalchemy.orm import Session\n"
            "from controlplane.db import make_engine\n"
            "from controlplane.settings import get_settings\n"
            "from controlplane.deployments import service\n"
            "with Session(make_engine(get_settings().database_url)) as session:\n"
            "    d = service.get_deployment(session=session, name='chat', lock=True)\n"
            "    service.move_alias(session=session, deployment=d, alias='active', version=1,\n"
            "                       actor='worker', reason='fallback')\n"
            "    session.commit()\n")], cwd=ROOT, env=env, check=True, timeout=60)
        waiting.join(timeout=25)
        assert answers and answers[0].status_code == 200
        assert answers[0].headers["etag"] != etag
        assert time.monotonic() - moved_at < 10  # not the 20 s wait
