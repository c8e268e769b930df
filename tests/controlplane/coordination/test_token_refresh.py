"""The token cache at fleet scale: a fleet's runtimes call further apart than the
cache's maximum age, so a miss reads every active token at once; a fleet then costs one token
read per maximum age, not one per request, and revocation still holds."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient
from sqlalchemy import event, update
from sqlalchemy.orm import Session

from controlplane.auth.deps import PrincipalCache
from controlplane.auth.models import ApiToken
from controlplane.auth.service import Principal, create_token, digest
from controlplane.deployments.service import get_deployment
from exitplane.app import create_app

RUNTIMES = 20


def _runtime_tokens(engine, count: int, prefix: str) -> list[tuple[int, str]]:
    with Session(engine) as session:
        chat = get_deployment(session=session, name="chat")
        made = [create_token(session=session, name=f"{prefix}-{i}", scope="runtime",
                             deployment=chat) for i in range(count)]
        ids = [(token.id, secret) for token, secret in made]  # before the commit expires them
        session.commit()
        return ids


def _token_reads(engine) -> list[str]:
    seen: list[str] = []

    def record(_conn, _cursor, statement, *_args):
        if "FROM api_tokens" in statement:
            seen.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    return seen


def _pull(client, secret: str):
    return client.get("/v1/deployments/chat/thresholds", params={"runtime_id": "rt-1"},
                      headers={"Authorization": f"Bearer {secret}"})


def test_a_fleet_costs_one_token_read_per_maximum_age(settings, engine, tokens):
    with TestClient(create_app(settings, engine=engine)) as setup:
        assert setup.post("/v1/deployments", headers=tokens.headers(tokens.admin), json={
            "name": "chat", "model_ref": "m", "num_layers": 12,
            "exit_layers": [3, 6, 9]}).status_code == 201
    fleet = _runtime_tokens(engine, RUNTIMES, "fleet")
    app = create_app(settings.model_copy(update={"token_cache_ttl_s": 30}), engine=engine)
    with TestClient(app) as client:
        reads = _token_reads(engine)
        assert all(_pull(client, secret).status_code == 200 for _, secret in fleet)
        assert len(reads) == 1  # one read of every token, not one per runtime
        # A token created after that read, an unknown one, a revoked one: each read alone,
        # with the answers a single lookup gives.
        [(_, newcomer)] = _runtime_tokens(engine, 1, "newcomer")
        assert _pull(client, newcomer).status_code == 200
        unknown = _pull(client, "ept_unknown")
        assert unknown.status_code == 401 and unknown.json()["detail"] == "unknown API token"
        assert len(reads) == 3
    app.state.config_delivery.close()


def test_a_revocation_whose_notice_is_lost_holds_within_the_maximum_age(settings, engine,
                                                                         tokens):
    with TestClient(create_app(settings, engine=engine)) as setup:
        assert setup.post("/v1/deployments", headers=tokens.headers(tokens.admin), json={
            "name": "chat", "model_ref": "m", "num_layers": 12,
            "exit_layers": [3, 6, 9]}).status_code == 201
    fleet = _runtime_tokens(engine, 3, "fleet")
    app = create_app(settings.model_copy(update={"token_cache_ttl_s": 0.5}), engine=engine)
    with TestClient(app) as client:
        assert all(_pull(client, secret).status_code == 200 for _, secret in fleet)
        revoked_id, revoked = fleet[0]
        with engine.begin() as connection:  # straight into the store: no notice is sent
            connection.execute(update(ApiToken).where(ApiToken.id == revoked_id)
                               .values(revoked_at=ApiToken.created_at))
        written = time.monotonic()
        while _pull(client, revoked).status_code == 200:
            assert time.monotonic() - written < 0.5 + 0.3, "the revoked token kept working"
            time.sleep(0.05)
        answer = _pull(client, revoked)
        assert answer.status_code == 401
        assert answer.json()["detail"] == "this API token was revoked"
        assert _pull(client, fleet[1][1]).status_code == 200  # the others carry on
    app.state.config_delivery.close()


def test_a_revocation_during_a_refresh_caches_nothing():
    cache = PrincipalCache(ttl=30)
    principal = Principal(token_id=1, name="rt", scope="runtime", deployment_id=1)

    def load():
        cache.on_revocation(digest("another"))  # arrives while the read is under way
        return {"k": principal}

    cache.refresh(load)
    assert cache.peek("k") is None
    assert not cache.refresh_due()  # and the next miss looks up alone, not again in bulk


def test_refreshes_are_at_most_one_per_maximum_age():
    cache = PrincipalCache(ttl=0.3)
    principal = Principal(token_id=1, name="rt", scope="runtime", deployment_id=1)
    loads = []

    def load():
        loads.append(time.monotonic())
        return {"k": principal}

    cache.refresh(load)
    cache.refresh(load)
    assert len(loads) == 1 and cache.peek("k") == principal
    time.sleep(0.35)
    assert cache.peek("k") is None and cache.refresh_due()
    cache.refresh(load)
    assert len(loads) == 2 and cache.peek("k") == principal
    assert not PrincipalCache(ttl=0).refresh_due()  # no cache: nothing to refresh


def test_a_busy_process_reads_every_token_ahead_and_no_request_waits_for_it(settings, engine,
                                                                             tokens):
    """With steady traffic the entries never expire together: after the first miss, every
    read of the tokens runs on the read-ahead thread, never on a request's; an idle process
    reads nothing."""
    import threading

    with TestClient(create_app(settings, engine=engine)) as setup:
        assert setup.post("/v1/deployments", headers=tokens.headers(tokens.admin), json={
            "name": "chat", "model_ref": "m", "num_layers": 12,
            "exit_layers": [3, 6, 9]}).status_code == 201
    fleet = _runtime_tokens(engine, 5, "fleet")
    ttl = 0.6
    app = create_app(settings.model_copy(update={"token_cache_ttl_s": ttl}), engine=engine)
    readers: list[str] = []

    def record(_conn, _cursor, statement, *_args):
        if "FROM api_tokens" in statement:
            readers.append(threading.current_thread().name)

    event.listen(engine, "before_cursor_execute", record)
    try:
        with TestClient(app) as client:
            assert _pull(client, fleet[0][1]).status_code == 200  # the cold miss reads
            first = len(readers)
            assert first == 1
            until = time.monotonic() + 5 * ttl
            while time.monotonic() < until:  # a request every 50 ms, across many maximum ages
                assert all(_pull(client, secret).status_code == 200 for _, secret in fleet)
                time.sleep(0.05)
            ahead = readers[first:]
            assert len(ahead) >= 5  # renewed about every half maximum age
            assert set(ahead) == {"token-read-ahead"}  # no request read them itself
            time.sleep(2 * ttl)  # idle: every entry expires, nothing reads
            idle = len(readers)
            time.sleep(ttl)
            assert len(readers) == idle
    finally:
        event.remove(engine, "before_cursor_execute", record)
    app.state.config_delivery.close()


def test_a_failed_read_ahead_leaves_requests_their_own_lookups():
    principal = Principal(token_id=1, name="rt", scope="runtime", deployment_id=1)
    calls = []

    def load():
        calls.append(time.monotonic())
        if len(calls) > 1:
            raise ConnectionError("the store is away")
        return {"k": principal}

    cache = PrincipalCache(ttl=0.4, load=load)
    cache.refresh(load)
    time.sleep(0.25)
    assert cache.peek("k") == principal  # past half its age: starts the read ahead
    time.sleep(0.2)  # the read failed; the entry expires at its maximum age regardless
    assert len(calls) == 2 and cache.peek("k") is None and cache.refresh_due()
