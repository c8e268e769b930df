"""A config read that began before an alias move and ends after the move's notice must not be
cached as current (one behaviour across API replicas). With Redis the bus is the only
thing that wakes a held long-poll, so a woken poll that read the old state again would hold the
old set until its wait ended: in the fleet benchmark every long-poll of one API process missed
a move that way and waited out its 60 s."""

from __future__ import annotations

import threading
import time

from fastapi.testclient import TestClient

from exitplane.app import create_app
from tests.support.waiting import wait_until


class HeldRead:
    """Wraps ConfigDelivery.load: once armed, the next read reads the store, then waits for
    `release` before handing its (by then old) state back."""

    def __init__(self, load) -> None:
        self.load, self.armed = load, False
        self.read, self.release = threading.Event(), threading.Event()

    def __call__(self, name: str):
        state = self.load(name)
        if self.armed:
            self.armed = False
            self.read.set()
            assert self.release.wait(15), "the test never released the held read"
        return state


def test_a_read_from_before_a_move_does_not_answer_the_polls_it_woke(
        settings, engine, tokens, private_redis):
    app = create_app(settings.model_copy(update={"redis_url": private_redis.url,
                                                 "config_cache_ttl_s": 0.2}), engine=engine)
    admin = tokens.headers(tokens.admin)
    delivery = app.state.config_delivery
    held = HeldRead(delivery.load)
    delivery.load = held
    with TestClient(app) as client:
        wait_until(lambda: app.state.bus.listening, 10, "the bus to subscribe")
        assert client.post("/v1/deployments", headers=admin, json={
            "name": "chat", "model_ref": "m", "num_layers": 12,
            "exit_layers": [3, 6, 9]}).status_code == 201
        assert client.post("/v1/deployments/chat/threshold-sets", headers=admin, json={
            "thresholds": {"3": 0.9, "6": 0.9, "9": 0.9}, "reason": "v2",
            "activate": True}).status_code == 201
        etag = client.get("/v1/deployments/chat/thresholds", headers=admin,
                          params={"runtime_id": "rt-1"}).headers["etag"]

        answers: list = []
        polling = threading.Thread(target=lambda: answers.append(client.get(
            "/v1/deployments/chat/thresholds", headers={**admin, "If-None-Match": etag},
            params={"runtime_id": "rt-1", "wait": 20})))
        polling.start()
        time.sleep(0.5)  # held; the cached state is older than its TTL now
        assert not answers

        # A plain pull refreshes the stale cache; the read behind it is held after reading v2.
        held.armed = True
        pulling = threading.Thread(target=lambda: client.get(
            "/v1/deployments/chat/thresholds", headers={**admin, "If-None-Match": etag},
            params={"runtime_id": "rt-2"}))
        pulling.start()
        assert held.read.wait(10), "the pull did not read the store"

        moved_at = time.monotonic()
        moved = client.put("/v1/deployments/chat/aliases/active", headers=admin,
                           json={"version": 1, "reason": "back"})
        assert moved.status_code == 200
        time.sleep(0.3)  # the notice has woken the poll, which waits on the held read
        held.release.set()
        polling.join(timeout=25)
        pulling.join(timeout=25)

        assert answers and answers[0].status_code == 200, answers[0].status_code
        assert answers[0].json()["version"] == 1
        assert time.monotonic() - moved_at < 10  # woken by the move, not at the 20 s wait end
        current = client.get("/v1/deployments/chat/thresholds", headers=admin,
                             params={"runtime_id": "rt-3"})
        assert current.json()["version"] == 1
