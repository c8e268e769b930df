"""One runtime token cannot flood the fleet view, the gauges or the pager:
heartbeats are rate limited per token, runtime ids have a pattern and a length, a deployment
has a cap of runtimes, and the runtime gauges come from the store, so a runtime that is gone
leaves /metrics."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event, update
from sqlalchemy.orm import Session

from controlplane.auth.service import create_token
from controlplane.db import utcnow
from controlplane.deployments.service import get_deployment
from controlplane.runtimes.models import Runtime
from controlplane.telemetry.gauges import store_collector
from exitplane.app import create_app
from tests.support.network import free_port
from tests.support.waiting import wait_until


def _serve(settings, engine, tokens, **overrides):
    app = create_app(settings.model_copy(update=overrides), engine=engine)
    client = TestClient(app)
    client.__enter__()
    assert client.post("/v1/deployments", headers=tokens.headers(tokens.admin), json={
        "name": "chat", "model_ref": "m", "num_layers": 12,
        "exit_layers": [3, 6, 9]}).status_code == 201
    with Session(engine) as session:
        _, secret = create_token(session=session, name="rt", scope="runtime",
                                 deployment=get_deployment(session=session, name="chat"))
        session.commit()
    return app, client, {"Authorization": f"Bearer {secret}"}


@pytest.fixture
def serve(settings, engine, tokens):
    opened = []

    def start(**overrides):
        app, client, auth = _serve(settings, engine, tokens, **overrides)
        opened.append((app, client))
        return client, auth

    yield start
    for app, client in opened:
        client.__exit__(None, None, None)
        app.state.config_delivery.close()


def _beat(client, auth, runtime_id: str, **fields):
    return client.post("/v1/deployments/chat/heartbeats", headers=auth,
                       json={"runtime_id": runtime_id, **fields})


def test_heartbeats_are_rate_limited_per_token(serve):
    client, auth = serve(rate_limit_heartbeat_per_s=1.0)  # a burst of 2
    answers = [_beat(client, auth, f"rt-{i}") for i in range(4)]
    assert [a.status_code for a in answers[:2]] == [200, 200]
    assert answers[2].status_code == 429 and int(answers[2].headers["retry-after"]) >= 1
    assert "too many heartbeat requests" in answers[2].json()["detail"]


@pytest.mark.parametrize("runtime_id", ["<script>alert(1)</script>", "rt 1", "-rt", "a" * 129,
                                        "rt\n1", "ünïcode"])
def test_runtime_ids_have_a_pattern_and_a_length(serve, runtime_id):
    client, auth = serve()
    response = _beat(client, auth, runtime_id)
    assert response.status_code == 422 and "runtime_id" in response.json()["detail"]
    pull = client.get("/v1/deployments/chat/thresholds", headers=auth,
                      params={"runtime_id": runtime_id})
    assert pull.status_code == 422


def test_usual_runtime_ids_are_accepted(serve):
    client, auth = serve()
    for runtime_id in ("rt-1", "gpu-node-07.cluster.local-4711", "pod:vllm_3", "a" * 128):
        assert _beat(client, auth, runtime_id).status_code == 200


def test_a_deployment_has_a_cap_of_runtimes(serve, engine):
    client, auth = serve(max_runtimes_per_deployment=2, rate_limit_hold_s=0.5)
    assert _beat(client, auth, "rt-1").status_code == 200
    assert _beat(client, auth, "rt-2").status_code == 200
    started = time.monotonic()
    refused = _beat(client, auth, "rt-3")
    # Held like a rate refusal: a client making up ids is answered no faster than the hold.
    assert time.monotonic() - started >= 0.5
    assert refused.status_code == 409
    assert "cap is 2" in refused.json()["detail"]
    assert "EXITPLANE_MAX_RUNTIMES_PER_DEPLOYMENT" in refused.json()["detail"]
    assert _beat(client, auth, "rt-1", spooled_batches=4).status_code == 200  # known ones stay
    # A runtime silent for a day is gone and leaves room.
    with engine.begin() as connection:
        connection.execute(update(Runtime).where(Runtime.runtime_id == "rt-2")
                           .values(last_seen=utcnow() - timedelta(days=2)))
    assert _beat(client, auth, "rt-3").status_code == 200


def _runtime_lines(body: str) -> list[str]:
    return [line for line in body.splitlines()
            if line.startswith("exitplane_fleet_runtime_") and 'runtime="' in line]


def test_runtime_gauges_come_from_the_store_and_a_gone_runtime_leaves(serve, engine):
    client, auth = serve(metrics_cache_ttl_s=0)
    assert _beat(client, auth, "rt-gone", applied_version=1, spooled_batches=5,
                 dropped_records=2).status_code == 200
    lines = _runtime_lines(client.get("/metrics").text)
    gone = '{deployment="chat",runtime="rt-gone"}'
    assert f"exitplane_fleet_runtime_spooled_batches{gone} 5.0" in lines
    assert f"exitplane_fleet_runtime_dropped_records_total{gone} 2.0" in lines
    assert f"exitplane_fleet_runtime_applied_version{gone} 1.0" in lines
    with engine.begin() as connection:
        connection.execute(update(Runtime).values(last_seen=utcnow() - timedelta(days=2)))
    assert not [line for line in _runtime_lines(client.get("/metrics").text)
                if "rt-gone" in line]


def test_metrics_can_require_a_token(serve):
    client, _ = serve(metrics_token="scrape-secret-0123456789")
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    scraped = client.get("/metrics", headers={"Authorization": "Bearer scrape-secret-0123456789"})
    assert scraped.status_code == 200 and "exitplane_active_version" in scraped.text


def test_store_gauges_are_cached_between_scrapes(serve, engine):
    client, _ = serve(metrics_cache_ttl_s=60)
    statements = []

    def count(_connection, _cursor, statement, *_args) -> None:
        # Only the gauges' own read: the app's background threads may query the store too.
        if "FROM rollups" in statement:
            statements.append(statement)

    event.listen(engine, "before_cursor_execute", count)
    try:
        client.get("/metrics")
        first = len(statements)
        for _ in range(5):
            assert client.get("/metrics").status_code == 200
    finally:
        event.remove(engine, "before_cursor_execute", count)
    # The rollup gauges' reads (open alerts' layers, the last hour's net saving) run once;
    # five more scrapes run no more queries.
    assert first >= 1 and len(statements) == first


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # a lock another can hold
def test_a_slow_store_does_not_stall_the_event_loop(settings, engine, tokens):
    """A scrape waiting on the store runs in a worker thread: /healthz still answers."""
    import uvicorn

    app = create_app(settings.model_copy(update={"metrics_cache_ttl_s": 0}), engine=engine)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(),
                                           log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    wait_until(lambda: server.started, 30, "the API to start")
    base = f"http://127.0.0.1:{server.config.port}"
    store_collector.bind(app.state.session_factory)
    blocker = engine.connect()
    transaction = blocker.begin()
    blocker.exec_driver_sql("LOCK TABLE runtimes IN ACCESS EXCLUSIVE MODE")
    scrape: list[int] = []
    scraper = threading.Thread(target=lambda: scrape.append(
        httpx.get(f"{base}/metrics", timeout=30).status_code))
    try:
        scraper.start()
        time.sleep(0.5)  # the scrape now waits on the lock
        assert not scrape
        started = time.monotonic()
        assert httpx.get(f"{base}/healthz", timeout=10).status_code == 200
        assert time.monotonic() - started < 1.0
    finally:
        transaction.rollback()
        blocker.close()
        scraper.join(timeout=30)
        server.should_exit = True
        app.state.config_delivery.close()
    assert scrape == [200]
