"""The pure-ASGI telemetry path answers every request as the FastAPI route does:
the same status, body and headers for good batches, replays, bad bodies, bad tokens, foreign
deployments, unknown content types and rate limits; it never enters the router, and the
request metrics and revocation behave as on the route."""

from __future__ import annotations

import random
import re
import threading
import time

import msgpack
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event
from sqlalchemy.orm import Session

from controlplane.auth.service import create_token
from controlplane.deployments.service import get_deployment
from controlplane.observability import http_request_duration
from exitplane.app import create_app
from tests.support.batches import random_batch
from tests.support.deployments import deploy_for_telemetry
from tests.support.network import RouterSpy

COMPARED_HEADERS = ("content-type", "www-authenticate", "retry-after")




@pytest.fixture
def pair(settings, engine):
    """Two apps on one store: the fast path, and the FastAPI route (fast path off)."""
    made = []

    def start(**update):
        apps = {}
        for fast in (True, False):
            app = create_app(settings.model_copy(update={**update, "telemetry_fast_path": fast}),
                             engine=engine)
            app.router = RouterSpy(app.router)  # before the first request builds the stack
            client = TestClient(app).__enter__()
            made.append((app, client))
            apps[fast] = (app, client)
        return apps

    yield start
    for app, client in made:
        client.__exit__(None, None, None)
        app.state.config_delivery.close()
        app.state.heartbeats.close()


def _shape(response) -> tuple:
    body = response.json()
    if isinstance(body, dict):
        body.pop("batch_id", None)  # each app gets its own batch (one store: no false replay)
    return (response.status_code, body,
            {name: response.headers.get(name) for name in COMPARED_HEADERS})


def _duration_count(status: str) -> float:
    return sum(
        sample.value for metric in http_request_duration.collect() for sample in metric.samples
        if sample.name.endswith("_count") and sample.labels == {
            "method": "POST", "route": "/v1/telemetry", "status": status})


def test_the_fast_path_answers_as_the_route_does(pair, tokens, engine):
    apps = pair()
    fast_app, fast = apps[True]
    route_app, route = apps[False]
    runtime = deploy_for_telemetry(fast, tokens, engine)
    other = deploy_for_telemetry(fast, tokens, engine, name="code")
    operator = tokens.headers(tokens.operator)
    rng = random.Random(14)
    counted_before = _duration_count("202")

    def cases():
        """(headers, body kwargs) per request; a fresh batch each call, replays included."""
        batch = random_batch(rng, n=10)
        bad = random_batch(rng, n=10)
        bad["records"][3]["exit_layer"] = 7
        packed = random_batch(rng, n=10)
        return [
            (runtime, {"json": batch}),
            (runtime, {"json": batch}),  # replay: duplicate=true
            (runtime, {"content": msgpack.packb(packed),
                       "headers": {"Content-Type": "application/msgpack"}}),
            (operator, {"json": random_batch(rng, n=3)}),  # operators may ship too
            (runtime, {"json": bad}),
            (runtime, {"content": b"\xc1\x00",
                       "headers": {"Content-Type": "application/msgpack"}}),
            (runtime, {"content": b"{}",
                       "headers": {"Content-Type": "application/vnd.exitplane.future+json"}}),
            (runtime, {"content": b"not json"}),  # no content type: JSON, as the route reads it
            (other, {"json": random_batch(rng, n=3)}),  # another deployment's token
            ({}, {"json": random_batch(rng, n=3)}),
            ({"Authorization": "Bearer ept_unknown"}, {"json": random_batch(rng, n=3)}),
            ({"Authorization": "Basic abc"}, {"json": random_batch(rng, n=3)}),
        ]

    answers = {}
    for fast_on, client in ((True, fast), (False, route)):
        answers[fast_on] = []
        for headers, kwargs in cases():
            extra = kwargs.pop("headers", {})
            response = client.post("/v1/telemetry", headers={**headers, **extra}, **kwargs)
            assert response.headers.get("x-request-id")
            answers[fast_on].append(_shape(response))
    assert answers[True] == answers[False]
    statuses = [answer[0] for answer in answers[True]]
    assert statuses == [202, 202, 202, 202, 422, 422, 415, 422, 403, 401, 401, 401]
    assert answers[True][1][1]["duplicate"] is True
    assert answers[True][9][2]["www-authenticate"] == "Bearer"
    # The fast path served every telemetry POST; the route app's router saw each one.
    assert "/v1/telemetry" not in fast_app.router.paths
    assert route_app.router.paths.count("/v1/telemetry") == len(statuses)
    # Request metrics name the route template, as they did on the route (4 x 202 per app).
    assert _duration_count("202") - counted_before == 8


def test_the_fast_path_rate_limits_as_the_route_does(pair, tokens, engine):
    # Bursts of 1: the second request waits 20 s, so a slow machine's half second between
    # the two requests cannot change the rounded Retry-After (at 2 s it could, and did).
    apps = pair(rate_limit_ingest_per_s=0.05)
    _, fast = apps[True]
    _, route = apps[False]
    runtime = deploy_for_telemetry(fast, tokens, engine)
    rng = random.Random(15)
    answers = {}
    for fast_on, client in ((True, fast), (False, route)):
        answers[fast_on] = [_shape(client.post("/v1/telemetry", headers=runtime,
                                               json=random_batch(rng, n=5))) for _ in range(2)]
    # The detail's tenths of a second follow the clock between the two requests (19.9 on a
    # loaded machine): compared rounded, as the Retry-After header is.
    for answer in (*answers[True], *answers[False]):
        if "detail" in answer[1]:
            answer[1]["detail"] = re.sub(r"retry in ([0-9.]+) s", lambda m: (
                f"retry in {round(float(m.group(1)))} s"), answer[1]["detail"])
    assert answers[True] == answers[False]
    limited = answers[True][1]
    assert limited[0] == 429 and limited[2]["retry-after"] == "20"
    assert limited[1]["detail"].startswith("too many ingest requests for this token")


def test_a_revoked_token_stops_on_the_fast_path(pair, tokens, engine):
    apps = pair(token_cache_ttl_s=30)  # long: only the revocation notice can stop it
    fast_app, fast = apps[True]
    deploy_for_telemetry(fast, tokens, engine)
    with Session(engine) as session:
        token, secret = create_token(session=session, name="rt-revoked", scope="runtime",
                                     deployment=get_deployment(session=session, name="chat"))
        session.commit()
        token_id = token.id
    runtime = {"Authorization": f"Bearer {secret}"}
    rng = random.Random(16)
    assert fast.post("/v1/telemetry", headers=runtime,
                     json=random_batch(rng, n=3)).status_code == 202  # now cached
    revoked = fast.delete(f"/v1/tokens/{token_id}", headers=tokens.headers(tokens.admin))
    assert revoked.status_code in (200, 204), revoked.text
    deadline = time.monotonic() + 5
    while True:
        answer = fast.post("/v1/telemetry", headers=runtime, json=random_batch(rng, n=3))
        if answer.status_code == 401 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert answer.status_code == 401
    assert answer.json()["detail"] == "this API token was revoked"
    assert "/v1/telemetry" not in fast_app.router.paths


def _beat_shape(response) -> tuple:
    body = response.json()
    if response.status_code == 200:
        body.pop("first_seen"), body.pop("last_seen")
    return (response.status_code, body,
            {name: response.headers.get(name) for name in COMPARED_HEADERS})


def test_heartbeats_are_answered_as_the_route_does(pair, tokens, engine):
    apps = pair()
    fast_app, fast = apps[True]
    route_app, route = apps[False]
    runtime = deploy_for_telemetry(fast, tokens, engine)
    other = deploy_for_telemetry(fast, tokens, engine, name="code")
    operator = tokens.headers(tokens.operator)
    beat = {"runtime_id": "rt-1", "applied_version": 2, "applied_checksum": "ab" * 32,
            "spooled_batches": 3}
    cases = [
        ("chat", runtime, {"json": beat}),
        ("chat", runtime, {"json": {**beat, "ready": False, "error": "warming up"}}),
        ("chat", operator, {"json": {**beat, "runtime_id": "rt-2"}}),
        ("chat", runtime, {"json": {**beat, "runtime_id": "bad id!"}}),  # the route's 422
        ("chat", runtime, {"json": {**beat, "applied_checksum": "abc"}}),  # not a checksum
        ("chat", runtime, {"json": {**beat, "error": "a\x00b"}}),  # NUL: the store refuses it
        ("chat", runtime, {"content": b"{not json", "headers": {
            "Content-Type": "application/json"}}),
        ("chat", runtime, {"content": b"", "headers": {"Content-Type": "application/json"}}),
        ("nope", runtime, {"json": beat}),  # no such deployment: 403 too, for a runtime token
        ("code", runtime, {"json": beat}),  # another deployment's
        ("chat", other, {"json": beat}),
        ("chat", {}, {"json": beat}),
        ("chat", {"Authorization": "Bearer ept_unknown"}, {"json": beat}),
        ("chat", {}, {"json": {"runtime_id": ""}}),  # bad token and bad body: 401 first
    ]
    answers = {}
    for fast_on, client in ((True, fast), (False, route)):
        answers[fast_on] = []
        for name, headers, kwargs in cases:
            extra = kwargs.get("headers", {})
            response = client.post(f"/v1/deployments/{name}/heartbeats",
                                   headers={**headers, **extra},
                                   **{k: v for k, v in kwargs.items() if k != "headers"})
            answers[fast_on].append(_beat_shape(response))
    assert answers[True] == answers[False]
    assert [answer[0] for answer in answers[True]] == [
        200, 200, 200, 422, 422, 422, 422, 422, 403, 403, 403, 401, 401, 401]
    assert answers[True][1][1]["error"] == "warming up"
    # Valid heartbeats never reached the router; the bodies the route must judge did (a bad
    # body with no token is refused by its headers, before the body is read).
    beats = [path for path in fast_app.router.paths if path.endswith("/heartbeats")]
    assert len(beats) == 5  # the five 422s
    assert sum(path.endswith("/heartbeats") for path in route_app.router.paths) == len(cases)
    listed = fast.get("/v1/deployments/chat/runtimes", headers=operator).json()
    assert {row["runtime_id"]: row["ready"] for row in listed} == {"rt-1": False, "rt-2": True}


def _statements(engine, act) -> list[str]:
    """The SQL statements `act()` sends to `engine` (SQLite's writer lock left out)."""
    statements: list[str] = []

    def seen(conn, cursor, statement, parameters, context, executemany) -> None:
        statements.append(" ".join(statement.split()))

    event.listen(engine, "before_cursor_execute", seen)
    try:
        act()
    finally:
        event.remove(engine, "before_cursor_execute", seen)
    return [text for text in statements if text != "BEGIN IMMEDIATE"]


def test_a_known_runtimes_heartbeat_is_held_and_written_in_bulk(pair, tokens, engine):
    """At fleet scale heartbeats were the API's costliest request. A runtime's first beat goes
    to the store (under the deployment's cap of runtimes); its next ones are answered on the
    event loop without a statement and written together, one statement per flush."""
    apps = pair(heartbeat_flush_s=60.0)  # flushed by hand below
    fast_app, fast = apps[True]
    runtime = deploy_for_telemetry(fast, tokens, engine)
    # Heartbeats name published versions only: v2 is the active set, v3 is published here.
    assert fast.post("/v1/deployments/chat/threshold-sets", headers=tokens.headers(
        tokens.operator), json={"thresholds": {"3": 0.8, "6": 0.7, "9": 0.6},
                                "reason": "next"}).json()["version"] == 3
    path = "/v1/deployments/chat/heartbeats"
    first = fast.post(path, headers=runtime, json={"runtime_id": "rt-1", "applied_version": 3})
    assert first.status_code == 200
    fast.post(path, headers=runtime, json={"runtime_id": "rt-2", "applied_version": 3})
    answers = []
    queries = _statements(engine, lambda: answers.extend(fast.post(path, headers=runtime, json={
        "runtime_id": runtime_id, "applied_version": 3, "spooled_batches": 7, "ready": False,
        "error": "warming up"}) for runtime_id in ("rt-1", "rt-2", "rt-1")))
    assert [answer.status_code for answer in answers] == [200, 200, 200]
    assert queries == []  # answered without the store
    body, before = answers[-1].json(), first.json()
    assert (body["applied_version"], body["spooled_batches"], body["ready"], body["error"]) == (
        3, 7, False, "warming up")
    assert body["first_seen"] == before["first_seen"]
    assert body["last_seen"] > before["last_seen"]

    written = []
    queries = _statements(engine, lambda: written.append(fast_app.state.heartbeats.flush()))
    assert written == [2]  # the newest beat of each runtime
    assert len(queries) == 1 and queries[0].startswith("UPDATE runtimes SET"), queries
    listed = {row["runtime_id"]: row for row in fast.get(
        "/v1/deployments/chat/runtimes", headers=tokens.headers(tokens.operator)).json()}
    assert listed["rt-1"] == body  # what the runtime was told is what is stored
    # A beat naming a newly applied version goes to the store at once: the runtime's evidence
    # at that version counts from then on.
    moved = []
    queries = _statements(engine, lambda: moved.append(fast.post(
        path, headers=runtime, json={"runtime_id": "rt-1", "applied_version": 2})))
    assert moved[0].status_code == 200 and moved[0].json()["applied_version"] == 2
    assert any(query.startswith("INSERT INTO runtime_versions") for query in queries), queries

    # A new runtime still takes the insert path, under the deployment's cap of runtimes.
    capped = pair(max_runtimes_per_deployment=2)
    _, full = capped[True]
    refused = full.post(path, headers=runtime, json={"runtime_id": "rt-3"})
    assert refused.status_code == 409 and "cap is 2" in refused.json()["detail"]
    assert full.post(path, headers=runtime, json={"runtime_id": "rt-1"}).status_code == 200


def test_with_no_flush_interval_a_known_runtimes_beat_is_one_statement(pair, tokens, engine):
    apps = pair(heartbeat_flush_s=0)
    _, fast = apps[True]
    runtime = deploy_for_telemetry(fast, tokens, engine)
    path = "/v1/deployments/chat/heartbeats"
    assert fast.post(path, headers=runtime, json={"runtime_id": "rt-1",
                                                  "applied_version": 2}).status_code == 200
    answers = []
    queries = _statements(engine, lambda: answers.append(fast.post(
        path, headers=runtime, json={"runtime_id": "rt-1", "applied_version": 2})))
    assert answers[0].status_code == 200 and answers[0].json()["applied_version"] == 2
    assert len(queries) == 1 and queries[0].startswith("UPDATE runtimes SET"), queries


def test_heartbeats_are_rate_limited_as_the_route_does(pair, tokens, engine):
    apps = pair(rate_limit_heartbeat_per_s=0.05)  # a 20 s wait: see the telemetry case
    _, fast = apps[True]
    _, route = apps[False]
    runtime = deploy_for_telemetry(fast, tokens, engine)
    answers = {}
    for fast_on, client in ((True, fast), (False, route)):
        answers[fast_on] = [_beat_shape(client.post(
            "/v1/deployments/chat/heartbeats", headers=runtime,
            json={"runtime_id": f"rt-{fast_on}"})) for _ in range(2)]
    assert [answer[0] for answer in answers[True]] == [200, 429]
    # The detail's tenths of a second follow the clock: status and headers are compared.
    assert (answers[True][1][0], answers[True][1][2]) == (answers[False][1][0],
                                                          answers[False][1][2])
    assert answers[True][1][2]["retry-after"] == "20"
    assert answers[False][1][1]["detail"].startswith("too many heartbeat requests")


def test_telemetry_cannot_take_the_threads_the_routes_need(settings, engine, tokens,
                                                           monkeypatch):
    """Telemetry runs on threads of its own: with more stuck batches in flight than the
    routes' whole thread pool (anyio's 40), a sync route and a config pull still answer."""
    from concurrent.futures import ThreadPoolExecutor

    import anyio.to_thread

    from controlplane.edge import telemetry_fast_path as fast_path

    release = threading.Event()
    entered = threading.Semaphore(0)

    def stuck(*_args, **_kwargs):
        entered.release()
        release.wait(30)
        raise RuntimeError("released")

    app = create_app(settings.model_copy(update={"telemetry_threads": 4}), engine=engine)
    with TestClient(app, raise_server_exceptions=False) as client:
        runtime = deploy_for_telemetry(client, tokens, engine)
        monkeypatch.setattr(fast_path, "store_batch", stuck)
        shared = anyio.to_thread.current_default_thread_limiter
        burst = 50  # over the shared pool's 40 threads
        pool = ThreadPoolExecutor(burst)
        try:
            posts = [pool.submit(client.post, "/v1/telemetry", headers=runtime,
                                 json=random_batch(random.Random(i), n=2)) for i in range(burst)]
            assert all(entered.acquire(timeout=10) for _ in range(4))  # its threads are busy
            assert not entered.acquire(timeout=0.3)  # and the others wait, holding none
            # The routes' pool is untouched: every one of its threads is free.
            assert client.portal.call(lambda: (shared().available_tokens,
                                               shared().total_tokens)) == (40, 40)
            listed = client.get("/v1/deployments", headers=tokens.headers(tokens.operator))
            assert listed.status_code == 200 and [d["name"] for d in listed.json()] == ["chat"]
            pulled = client.get("/v1/deployments/chat/thresholds",
                                params={"runtime_id": "rt-1"}, headers=runtime)
            assert pulled.status_code == 200 and pulled.json()["version"] == 2
        finally:
            release.set()
            answered = [post.result(timeout=60).status_code for post in posts]
            pool.shutdown()
    app.state.config_delivery.close()
    assert answered == [500] * burst  # every stuck batch was answered once released

