"""Single sign-on against a real server (uvicorn) and a real OpenID Connect provider process
(tests/support/oidc_provider.py), on the edges an attacker reaches:

- the callback looks only at the answer to a sign-in this browser started (its signed flow
  cookie): any other request there (an image tag on another site's page, a replayed link) is
  refused at once with 400, neither counted by the sign-in throttle nor recorded, so it cannot
  lock single sign-on for an address; refused answers of real sign-ins still count;
- a user who signed in through OpenID Connect is refused through the trusted proxy's header,
  and a user the proxy created is refused through OpenID Connect.
"""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.auth.models import AdminEvent, User
from tests.support.oidc_provider import issuer_url
from tests.support.sso import http_browser, provider_for, served_api, sso_settings

# slow: a provider process and a served API per test
pytestmark = pytest.mark.slow

NO_FLOW = "no single sign-on under way"


@pytest.fixture
def issuer() -> str:
    return issuer_url()


@pytest.fixture
def served(db_url, tmp_path, issuer, engine):
    with served_api(sso_settings(db_url, tmp_path, issuer), engine) as url:
        yield url


@pytest.fixture
def provider(served, issuer, tmp_path):
    with provider_for(served, issuer, tmp_path / "oidc-provider.log") as started:
        yield started


@pytest.fixture
def browser(served):
    with http_browser(served) as client:
        yield client


def start_flow(browser: httpx.Client) -> str:
    """Start a sign-in (the flow cookie is set); where the browser is sent."""
    started = browser.get("/ui/login/oidc", params={"next": "/ui/account"})
    assert started.status_code == 303, started.text
    return started.headers["location"]


def sso_sign_in(browser: httpx.Client) -> httpx.Response:
    answered = browser.get(start_flow(browser))
    assert answered.status_code == 302, answered.text
    return browser.get(answered.headers["location"])


def refusals(engine) -> list[AdminEvent]:
    with Session(engine) as session:
        return list(session.scalars(select(AdminEvent).where(
            AdminEvent.action == "user.sso_refused").order_by(AdminEvent.id)))


def stored_user(engine, username: str) -> User | None:
    with Session(engine) as session:
        return session.scalar(select(User).where(User.username == username))


def test_callbacks_without_a_started_sign_in_neither_count_nor_lock(browser, provider,
                                                                    engine):
    for query in ["error=x"] * 5 + ["code=x&state=y"] * 5:
        refused = browser.get(f"/ui/login/oidc/callback?{query}")
        assert refused.status_code == 400, refused.text
        assert NO_FLOW in refused.text and "Start again" in refused.text
    assert refusals(engine) == []
    # A real sign-in from the same address goes through.
    provider.steer(username="alice", groups=["ops"])
    back = sso_sign_in(browser)
    assert back.status_code == 303 and back.headers["location"] == "/ui/account"
    assert stored_user(engine, "alice").role == "operator"


def test_a_flow_cookie_is_answered_once(browser, provider, engine):
    provider.steer(username="alice", groups=["ops"])
    answered = browser.get(start_flow(browser))
    callback = answered.headers["location"]
    assert browser.get(callback).status_code == 303
    browser.cookies.clear()
    replayed = browser.get(callback)
    assert replayed.status_code == 400 and NO_FLOW in replayed.text
    assert refusals(engine) == []


def test_refused_answers_of_started_sign_ins_still_count(browser, provider, engine):
    for _ in range(5):  # the pair (single sign-on, address) has five free failures
        start_flow(browser)
        refused = browser.get("/ui/login/oidc/callback?error=access_denied")
        assert refused.status_code == 401 and "did not sign you in (access_denied)" in refused.text
    assert len(refusals(engine)) == 5
    provider.steer(username="alice", groups=["ops"])
    held = sso_sign_in(browser)
    assert held.status_code == 429 and int(held.headers["retry-after"]) >= 1
    assert "too many refused single sign-ons" in held.text.lower()


def test_a_user_of_openid_connect_is_refused_through_the_proxy(browser, provider, served,
                                                               engine):
    provider.steer(username="bob", groups=["ops-admins"])
    assert sso_sign_in(browser).status_code == 303
    with httpx.Client(base_url=served, follow_redirects=False, timeout=30,
                      headers={"X-Forwarded-User": "bob",
                               "X-Forwarded-Groups": "ops-admins"}) as proxied:
        refused = proxied.get("/ui/account")
    assert refused.status_code == 403
    assert "signs in through the OpenID Connect provider" in refused.text
    [event] = refusals(engine)
    assert (event.actor, event.details["method"]) == ("user:bob", "proxy")


def test_a_user_the_proxy_created_is_refused_through_openid_connect(browser, provider, served,
                                                                    engine):
    with httpx.Client(base_url=served, follow_redirects=False, timeout=30,
                      headers={"X-Forwarded-User": "carol",
                               "X-Forwarded-Groups": "ops"}) as proxied:
        assert proxied.get("/ui/account").status_code == 200
    provider.steer(username="carol", groups=["ops-admins"])
    refused = sso_sign_in(browser)
    assert refused.status_code == 403
    assert "signs in through the authenticating proxy" in refused.text
    carol = stored_user(engine, "carol")
    assert (carol.role, carol.sso_subject) == ("operator", None)
    [event] = refusals(engine)
    assert (event.actor, event.details["method"]) == ("user:carol", "oidc")
