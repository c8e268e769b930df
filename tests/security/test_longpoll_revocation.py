"""A held long-poll checks its token again before it answers with a new set: a poll opened
before its token was revoked must not deliver the set an alias move publishes afterwards (it
did, up to the poll's whole wait after the revocation). Both ways a pull is served: the
pure-ASGI fast path (state cached) and the FastAPI route (nothing cached)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session

from controlplane.auth.models import ApiToken
from tests.support.deployments import issue_runtime_token, tuned_deployment
from tests.support.waiting import wait_until

PULL = "/v1/deployments/chat/thresholds"


@pytest.fixture(params=[30.0, 0.0], ids=["fast-path", "route"])
def settings(settings, request):
    # 30 s: every poll finds the config cached (the fast path holds it); 0: never cached,
    # every poll goes through the route. A short token cache for the silent revocation.
    return settings.model_copy(update={"config_cache_ttl_s": request.param,
                                       "token_cache_ttl_s": 0.5})


def _hold(url: str, headers: dict, etag: str, runtime_id: str, answers: dict
          ) -> threading.Thread:
    """A long-poll (20 s) in a thread of its own; its answer lands in answers[runtime_id]."""
    def poll() -> None:
        with httpx.Client(base_url=url, timeout=30) as own:
            started = time.monotonic()
            answers[runtime_id] = own.get(PULL, params={"runtime_id": runtime_id, "wait": 20},
                                          headers={**headers, "If-None-Match": etag})
            answers[f"{runtime_id}-s"] = time.monotonic() - started

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    return thread


def _held_polls(app) -> int:
    return sum(app.state.config_delivery._held.values())


def _move_to_v2(http: httpx.Client, op: dict) -> None:
    moved = http.put("/v1/deployments/chat/aliases/active", headers=op,
                     json={"version": 2, "reason": "tuned"})
    assert moved.status_code == 200, moved.text


def test_a_poll_held_across_its_tokens_revocation_gets_no_new_set(live_server, tokens, engine,
                                                                   app):
    with httpx.Client(base_url=live_server.url, timeout=30) as http:
        op, honest, etag = tuned_deployment(http, tokens, engine)  # v1 active, v2 published
        revoked_id, revoked = issue_runtime_token(engine, name="rt-leaked")
        answers: dict = {}
        polls = [_hold(live_server.url, revoked, etag, "leaked", answers),
                 _hold(live_server.url, honest, etag, "honest", answers)]
        wait_until(lambda: _held_polls(app) == 2, message="both polls held")

        gone = http.delete(f"/v1/tokens/{revoked_id}", headers=tokens.headers(tokens.admin))
        assert gone.status_code == 200, gone.text
        _move_to_v2(http, op)
        for poll in polls:
            poll.join(timeout=20)

        # The move woke both: the honest runtime gets v2 at once, the revoked token nothing.
        assert answers["honest"].status_code == 200
        assert answers["honest"].json()["version"] == 2
        leaked = answers["leaked"]
        assert leaked.status_code == 401, leaked.text
        assert "revoked" in leaked.json()["detail"]
        assert "thresholds" not in leaked.json() and "etag" not in leaked.headers
        assert answers["leaked-s"] < 10  # answered at the move, not held to the wait's end


def test_a_poll_whose_cached_lookup_aged_out_is_looked_up_again(live_server, tokens, engine,
                                                                 app, settings):
    """Revoked without a notice reaching this process (a direct store update: as a process
    that missed the message sees it): the token cache's maximum age still bounds it."""
    with httpx.Client(base_url=live_server.url, timeout=30) as http:
        op, _, etag = tuned_deployment(http, tokens, engine)
        revoked_id, revoked = issue_runtime_token(engine, name="rt-silent")
        answers: dict = {}
        poll = _hold(live_server.url, revoked, etag, "silent", answers)
        wait_until(lambda: _held_polls(app) == 1, message="the poll held")

        with Session(engine) as session:
            session.execute(update(ApiToken).where(ApiToken.id == revoked_id)
                            .values(revoked_at=ApiToken.created_at))
            session.commit()
        time.sleep(settings.token_cache_ttl_s * 2 + 0.2)  # past the cached lookup's age
        _move_to_v2(http, op)
        poll.join(timeout=20)

        assert answers["silent"].status_code == 401, answers["silent"].text
        assert "thresholds" not in answers["silent"].json()
