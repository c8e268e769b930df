"""The 304 pull's per-request work: a plain pull with a current ETag is answered before the
request context (with the context's request id header and duration sample), and the cached
config is renewed by reading one row while nothing changed. Neither may weaken what the pull
guarantees: a revoked token is refused, the rate limit holds, a long-poll still waits behind
the context, canary membership decides the set, and a move or canary change made where no
notice reaches this process is read within the cache's age."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event, text

from controlplane.deployments.service import in_canary
from controlplane.edge.pull_fast_path import NotModifiedFastPath
from controlplane.observability import http_request_duration
from exitplane.app import create_app
from tests.support.deployments import DEPLOYMENT

PULL = "/v1/deployments/chat/thresholds"
ROUTE = "/v1/deployments/{name}/thresholds"


def _answered(status: int) -> float:
    """Duration samples observed for the pull route with `status`."""
    for metric in http_request_duration.collect():
        for sample in metric.samples:
            if sample.name.endswith("_count") and sample.labels == {
                    "method": "GET", "route": ROUTE, "status": str(status)}:
                return sample.value
    return 0.0


def _chat(client, tokens) -> tuple[dict, dict, int]:
    """'chat' with its first set (v1) active and a second (v2) published; a runtime token:
    (operator headers, runtime headers, the runtime token's id)."""
    op, admin = tokens.headers(tokens.operator), tokens.headers(tokens.admin)
    assert client.post("/v1/deployments", json=DEPLOYMENT, headers=op).status_code == 201
    assert client.post("/v1/deployments/chat/threshold-sets", headers=op, json={
        "thresholds": {"3": 0.9, "6": 0.9, "9": 0.9}, "reason": "tuned"}).status_code == 201
    created = client.post("/v1/tokens", headers=admin, json={
        "name": "rt-chat", "scope": "runtime", "deployment": "chat"}).json()
    return op, {"Authorization": f"Bearer {created['token']}"}, created["id"]


@pytest.fixture
def hot_app(settings, engine):
    """The API with a config cache that outlives the test, and a counter of the requests that
    reach the request context (everything the front fast path does not answer)."""
    app = create_app(settings.model_copy(update={"config_cache_ttl_s": 30.0}), engine=engine)
    assert isinstance(app.front, NotModifiedFastPath) and app.front.front
    context = app.front.app
    app.state.entered = []

    async def counted(scope, receive, send):
        app.state.entered.append(scope.get("path"))
        await context(scope, receive, send)

    app.front.app = counted
    yield app
    app.state.config_delivery.close()
    app.state.heartbeats.close()


def test_a_plain_304_is_answered_before_the_context_and_what_it_guards_still_holds(
        hot_app, tokens):
    with TestClient(hot_app) as client:
        op, runtime, token_id = _chat(client, tokens)
        etag = client.get(PULL, params={"runtime_id": "r"}, headers=runtime).headers["etag"]
        entered, before = hot_app.state.entered, _answered(304)
        entered.clear()

        offered = client.get(PULL, params={"runtime_id": "r"}, headers={
            **runtime, "If-None-Match": etag, "X-Request-ID": "pull-r-0001"})
        made = client.get(PULL, params={"runtime_id": "r"},
                          headers={**runtime, "If-None-Match": etag})
        assert (offered.status_code, made.status_code) == (304, 304)
        assert offered.headers["etag"] == made.headers["etag"] == etag
        assert offered.headers["x-exitplane-version"] == "1"
        assert offered.headers["x-request-id"] == "pull-r-0001"
        assert len(made.headers["x-request-id"]) == 32
        assert offered.headers["x-request-id"] != made.headers["x-request-id"]
        assert entered == []  # neither reached the context, FastAPI or the store
        assert _answered(304) == before + 2

        # A long-poll is held behind the context (whose duration leaves its wait out).
        held = client.get(PULL, params={"runtime_id": "r", "wait": 0.2},
                          headers={**runtime, "If-None-Match": etag})
        assert held.status_code == 304 and entered == [PULL]
        # A bad parameter is the route's 422, through the context.
        assert client.get(PULL, params={"runtime_id": "bad id"}, headers={
            **runtime, "If-None-Match": etag}).status_code == 422
        assert len(entered) == 2

        # An alias move reaches the next plain pull at once: the route answers the new set.
        assert client.put("/v1/deployments/chat/aliases/active", headers=op, json={
            "version": 2, "reason": "go"}).status_code == 200
        moved = client.get(PULL, params={"runtime_id": "r"},
                           headers={**runtime, "If-None-Match": etag})
        assert moved.status_code == 200 and moved.json()["version"] == 2
        etag = moved.headers["etag"]
        assert client.get(PULL, params={"runtime_id": "r"}, headers={
            **runtime, "If-None-Match": etag}).status_code == 304

        # A revoked token is refused on its next pull (401 from the route).
        assert client.delete(f"/v1/tokens/{token_id}",
                             headers=tokens.headers(tokens.admin)).status_code == 200
        refused = client.get(PULL, params={"runtime_id": "r"},
                             headers={**runtime, "If-None-Match": etag})
        assert refused.status_code == 401


def test_canary_membership_decides_the_set_a_plain_304_confirms(hot_app, tokens):
    inside = next(f"rt-{i}" for i in range(1000) if in_canary(runtime_id=f"rt-{i}",
                                                               fraction=0.5))
    outside = next(f"rt-{i}" for i in range(1000) if not in_canary(runtime_id=f"rt-{i}",
                                                                   fraction=0.5))
    with TestClient(hot_app) as client:
        op, runtime, _ = _chat(client, tokens)
        assert client.patch("/v1/deployments/chat", headers=op,
                            json={"canary_fraction": 0.5}).status_code == 200
        assert client.put("/v1/deployments/chat/aliases/canary", headers=op, json={
            "version": 2, "reason": "try"}).status_code == 200
        active = client.get(PULL, params={"runtime_id": outside}, headers=runtime)
        canary = client.get(PULL, params={"runtime_id": inside}, headers=runtime)
        assert (active.json()["version"], canary.json()["version"]) == (1, 2)
        hot_app.state.entered.clear()

        # Each runtime's own set is 304; the other set's ETag gets the runtime's own set.
        for runtime_id, etag, status in ((outside, active.headers["etag"], 304),
                                         (inside, canary.headers["etag"], 304),
                                         (inside, active.headers["etag"], 200),
                                         (outside, canary.headers["etag"], 200)):
            answer = client.get(PULL, params={"runtime_id": runtime_id},
                                headers={**runtime, "If-None-Match": etag})
            assert answer.status_code == status, (runtime_id, answer.text)
            if status == 200:
                assert answer.json()["version"] == (2 if runtime_id == inside else 1)
        assert len(hot_app.state.entered) == 2  # only the two 200s went past the front


def test_the_pull_rate_limit_holds_for_plain_304s(settings, engine, tokens):
    # Refusals answered at once: a held one would see the bucket refilled after it.
    app = create_app(settings.model_copy(update={"config_cache_ttl_s": 30.0,
                                                 "rate_limit_pull_per_s": 1.0,
                                                 "rate_limit_hold_s": 0}), engine=engine)
    try:
        with TestClient(app) as client:
            _, runtime, _ = _chat(client, tokens)
            etag = client.get(PULL, params={"runtime_id": "r"},
                              headers=runtime).headers["etag"]
            answers = [client.get(PULL, params={"runtime_id": "r"}, headers={
                **runtime, "If-None-Match": etag}) for _ in range(3)]
            # A burst of two (the first pull took one): then 429 with Retry-After.
            assert [answer.status_code for answer in answers][-1] == 429
            assert 304 in [answer.status_code for answer in answers]
            assert int(answers[-1].headers["retry-after"]) >= 1
    finally:
        app.state.config_delivery.close()
        app.state.heartbeats.close()


def test_a_renewal_reads_one_row_and_changes_made_without_a_notice_are_read(
        hot_app, engine, tokens):
    with TestClient(hot_app) as client:
        _chat(client, tokens)
    delivery = hot_app.state.config_delivery
    cached = asyncio.run(delivery.current("chat"))
    statements: list[str] = []

    def count(_conn, _cursor, statement, *_args) -> None:
        if statement.lstrip().upper().startswith("SELECT"):  # not SQLite's BEGIN IMMEDIATE
            statements.append(statement)

    event.listen(engine, "before_cursor_execute", count)
    try:
        renewed = delivery.load("chat")
        assert len(statements) == 1, statements
        assert renewed.active is cached.active and renewed.loaded_at >= cached.loaded_at

        # The canary fraction changed in the store (no revision bump, no notice): read in full.
        with engine.begin() as connection:
            connection.execute(text(
                "UPDATE deployments SET canary_fraction = 0.25 WHERE name = 'chat'"))
        statements.clear()
        changed = delivery.load("chat")
        assert changed.canary_fraction == 0.25 and len(statements) > 1

        # A move committed where no notice reaches this process (another replica without
        # Redis): the revision it bumped is seen, and the new set read.
        with engine.begin() as connection:
            connection.execute(text(
                "UPDATE aliases SET version = 2 WHERE name = 'active' AND deployment_id = "
                "(SELECT id FROM deployments WHERE name = 'chat')"))
            connection.execute(text(
                "UPDATE deployments SET revision = revision + 1 WHERE name = 'chat'"))
        moved = delivery.load("chat")
        assert moved.active.version == 2 and moved.revision == cached.revision + 1
    finally:
        event.remove(engine, "before_cursor_execute", count)
