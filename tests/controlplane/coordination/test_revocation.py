"""Revocation that holds inside one API process: the token cache has a hard
maximum age that polling cannot extend, it is dropped only after the revoke commits, and a
lookup under way during a revocation cannot bring the old principal back."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update
from sqlalchemy.orm import Session

from controlplane.auth.deps import PrincipalCache
from controlplane.auth.models import ApiToken
from controlplane.auth.service import Principal, create_token, digest, revoke_token
from controlplane.coordination.models import Epoch
from controlplane.deployments.service import get_deployment
from exitplane.app import create_app

PRINCIPAL = Principal(token_id=1, name="rt", scope="runtime", deployment_id=1)


def test_peeking_never_extends_an_expired_entry():
    cache = PrincipalCache(ttl=0.2)
    cache.put("k", PRINCIPAL, generation=cache.generation, started=time.monotonic())
    assert cache.peek("k") == PRINCIPAL
    time.sleep(0.25)
    # A cache that dropped the entry too early would hand the first caller None and keep
    # serving everyone else for 1 s more.
    assert [cache.peek("k") for _ in range(5)] == [None] * 5


def test_a_lookup_under_way_during_a_revocation_is_not_cached():
    cache = PrincipalCache(ttl=30)
    generation, started = cache.generation, time.monotonic()
    cache.on_revocation(digest("the-token"))  # arrives while the lookup reads the store
    cache.put("k", PRINCIPAL, generation=generation, started=started)
    assert cache.peek("k") is None


def test_the_maximum_age_counts_from_the_lookup_not_the_put():
    cache = PrincipalCache(ttl=0.2)
    cache.put("k", PRINCIPAL, generation=cache.generation, started=time.monotonic() - 0.3)
    assert cache.peek("k") is None


@pytest.fixture
def served(settings, engine, tokens):
    """The API with a short token cache, deployment `chat` and a runtime token."""
    app = create_app(settings.model_copy(update={"token_cache_ttl_s": 0.5}), engine=engine)
    with TestClient(app) as client:
        assert client.post("/v1/deployments", headers=tokens.headers(tokens.admin), json={
            "name": "chat", "model_ref": "m", "num_layers": 12,
            "exit_layers": [3, 6, 9]}).status_code == 201
        with Session(engine) as session:
            token, secret = create_token(session=session, name="rt", scope="runtime",
                                         deployment=get_deployment(session=session, name="chat"))
            session.commit()
            token_id = token.id
        yield app, client, token_id, secret
    app.state.config_delivery.close()


def _poll(client, secret: str, etag: str | None = None):
    headers = {"Authorization": f"Bearer {secret}"}
    if etag:
        headers["If-None-Match"] = etag
    return client.get("/v1/deployments/chat/thresholds", params={"runtime_id": "rt-1"},
                      headers=headers)


def test_polling_cannot_keep_a_revoked_token_alive(served, engine):
    """A revocation whose notice never arrives (written straight into the store, as by a
    process that crashed before publishing) still holds within the cache's maximum age."""
    _app, client, token_id, secret = served
    etag = _poll(client, secret).headers["etag"]
    assert _poll(client, secret, etag).status_code == 304  # the cached fast path
    with engine.begin() as connection:
        connection.execute(update(ApiToken).where(ApiToken.id == token_id)
                           .values(revoked_at=ApiToken.created_at))
    revoked_at = time.monotonic()
    statuses = []
    while time.monotonic() - revoked_at < 2.0:  # a client polling every 0.2 s
        statuses.append((time.monotonic() - revoked_at, _poll(client, secret, etag).status_code))
        time.sleep(0.2)
    first = next(t for t, status in statuses if status == 401)
    assert first <= 0.5 + 0.3  # the maximum age, plus one poll and some slack
    assert all(status == 401 for t, status in statuses if t >= first)


def test_the_cache_is_dropped_after_the_revoke_commits_not_before(served, engine):
    app, client, token_id, secret = served
    assert _poll(client, secret).status_code == 200
    cache: PrincipalCache = app.state.principal_cache
    key = digest(secret)
    assert cache.peek(key) is not None
    with Session(engine) as session:
        revoke_token(session=session, token_id=token_id)
        # Not committed: a lookup now would still read the old row, so dropping the entry
        # here would only let that lookup cache it again.
        assert cache.peek(key) is not None
        generation = cache.generation
        session.commit()
    assert cache.peek(key) is None and cache.generation != generation
    assert _poll(client, secret).status_code == 401


def test_a_rolled_back_revocation_announces_nothing(served, engine):
    app, client, token_id, secret = served
    assert _poll(client, secret).status_code == 200
    generation = app.state.principal_cache.generation
    with Session(engine) as session:
        revoke_token(session=session, token_id=token_id)
        session.rollback()
    assert app.state.principal_cache.generation == generation
    assert _poll(client, secret).status_code == 200


def test_a_revocation_moves_the_epoch_once(session, tokens):
    row = session.get(Epoch, "revocation")  # the migration seeds it; a truncate removes it
    before = row.epoch if row else 0
    token, _ = create_token(session=session, name="t", scope="operator")
    revoke_token(session=session, token_id=token.id)
    revoke_token(session=session, token_id=token.id)  # already revoked: nothing new to say
    session.commit()
    session.expire_all()
    assert session.get(Epoch, "revocation").epoch == before + 1
