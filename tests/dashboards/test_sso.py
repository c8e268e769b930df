"""Single sign-on to the admin UI, end to end: the control plane served by a real uvicorn, an
OpenID Connect provider in a process of its own (tests/support/oidc_provider.py), and plain
HTTP clients that follow the redirects as a browser would.

OIDC: a user of a mapped group is signed in with the mapped role and created with origin `sso`
(no password signs them in); a forged, expired or foreign-nonce ID token, a state that is not
this browser's, a user without a mapped role and a local user's name are refused with a page
that says why and no session; every sign-in and refusal is an audit event; refused answers
from one address are throttled. Header sign-in: a trusted proxy's header signs the user in; the
same header from another address (even with X-Forwarded-For naming the proxy) is ignored, and
the API never reads it. In Chromium, the login page's "Sign in with ..." goes to the provider
and back to the overview, signed in with the mapped role, and a forged ID token is refused;
Chromium sending a proxy's headers is signed in only by a control plane that trusts its address.
"""

from __future__ import annotations

import logging
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.auth import users
from controlplane.auth.models import AdminEvent, User
from controlplane.auth.sso import RoleMapping
from controlplane.errors import Invalid
from controlplane.settings import Settings
from exitplane.app import create_app
from tests.support.network import start_server
from tests.support.oidc_provider import issuer_url
from tests.support.people import PASSWORD, csrf_of
from tests.support.sso import MAPPING, http_browser, provider_for, served_api, sso_settings

# slow: a provider process and a served API per test
pytestmark = pytest.mark.slow

@pytest.fixture
def issuer() -> str:
    return issuer_url()


@pytest.fixture(name="sso_settings")
def sso_settings_fixture(db_url, tmp_path, issuer) -> Settings:
    return sso_settings(db_url, tmp_path, issuer)


@pytest.fixture
def served(sso_settings, engine):
    with served_api(sso_settings, engine) as url:
        yield url


@pytest.fixture
def provider(served, issuer, tmp_path):
    with provider_for(served, issuer, tmp_path / "oidc-provider.log") as started:
        yield started


@pytest.fixture
def browser(served):
    with http_browser(served) as client:
        yield client


def to_provider(browser: httpx.Client) -> str:
    """Start a sign-in; the provider's answer (the callback URL it sends the browser to)."""
    started = browser.get("/ui/login/oidc", params={"next": "/ui/account"})
    assert started.status_code == 303, started.text
    answered = browser.get(started.headers["location"])
    assert answered.status_code == 302, answered.text
    return answered.headers["location"]


def back_from_provider(browser: httpx.Client, callback: str) -> httpx.Response:
    return browser.get(callback)


def sso_sign_in(browser: httpx.Client) -> httpx.Response:
    return back_from_provider(browser, to_provider(browser))


def signed_in_as(browser: httpx.Client) -> str | None:
    """The username the account page shows, or None when it sends the browser to sign in."""
    page = browser.get("/ui/account")
    if page.status_code == 303:
        assert "/ui/login" in page.headers["location"]
        return None
    assert page.status_code == 200, page.text
    return page.text


def events(engine, action: str) -> list[AdminEvent]:
    with Session(engine) as session:
        return list(session.scalars(select(AdminEvent).where(AdminEvent.action == action)
                                    .order_by(AdminEvent.id)))


def stored_user(engine, username: str) -> User | None:
    with Session(engine) as session:
        return session.scalar(select(User).where(User.username == username))


def test_the_login_page_offers_the_provider(browser, provider):
    page = browser.get("/ui/login", params={"next": "/ui/account"})
    assert page.status_code == 200
    assert 'id="sso-sign-in"' in page.text and "Sign in with Test IdP" in page.text
    assert "/ui/login/oidc?next=/ui/account" in page.text


def test_a_mapped_user_is_signed_in_created_and_kept_up_to_date(browser, provider, engine):
    provider.steer(username="Alice", groups=["ops", "ops-admins", "unrelated"])
    back = sso_sign_in(browser)
    assert back.status_code == 303, back.text
    assert back.headers["location"] == "/ui/account"
    account = signed_in_as(browser)
    assert account is not None and "alice" in account and "role-admin" in account
    alice = stored_user(engine, "alice")
    assert (alice.origin, alice.role, alice.last_login_at is not None) == ("sso", "admin", True)
    [signed] = events(engine, "user.sso_sign_in")
    assert (signed.actor, signed.target) == ("user:alice", "user:alice")
    assert signed.details["method"] == "oidc" and signed.details["role"] == "admin"
    assert [e.actor for e in events(engine, "user.create")] == ["user:alice"]

    # What exitplane sent: PKCE with S256 and a nonce; the token request carried the verifier.
    authorize, token = provider.requests()
    assert authorize["code_challenge_method"] == "S256" and authorize["nonce"]
    assert authorize["scope"].split()[0] == "openid"
    assert token["grant_type"] == "authorization_code" and len(token["code_verifier"]) >= 43

    # The same session signs out like any other.
    signed_out = browser.post("/ui/logout",
                              data={"csrf_token": csrf_of(browser.get("/ui/account").text)})
    assert signed_out.status_code == 303
    assert signed_in_as(browser) is None

    # The next sign-in applies the groups the provider says now, but never demotes the last
    # enabled admin: a local (break-glass) admin must exist first.
    provider.steer(username="alice", groups=["readers"])
    kept = sso_sign_in(browser)
    assert kept.status_code == 403 and "last enabled admin" in kept.text
    with Session(engine) as session:
        users.create_user(session=session, username="root", password=PASSWORD, role="admin")
        session.commit()
    assert sso_sign_in(browser).status_code == 303
    assert "role-viewer" in signed_in_as(browser)
    assert stored_user(engine, "alice").role == "viewer"
    [changed] = events(engine, "user.role")
    assert (changed.actor, changed.details) == ("user:alice", {"from": "admin", "to": "viewer"})


def test_no_password_signs_an_sso_user_in(browser, provider, engine):
    provider.steer(username="alice", groups=["ops"])
    assert sso_sign_in(browser).status_code == 303
    account = signed_in_as(browser)  # no password to change there
    assert "single sign-on" in account and "Change your password" not in account
    with httpx.Client(base_url=str(browser.base_url), follow_redirects=False) as other:
        token = csrf_of(other.get("/ui/login").text)
        refused = other.post("/ui/login", data={"username": "alice", "password": PASSWORD,
                                                "csrf_token": token})
        assert refused.status_code == 401 and "Wrong username or password" in refused.text
    with Session(engine) as session:
        alice = session.scalar(select(User).where(User.username == "alice"))
        with pytest.raises(Invalid, match="single sign-on"):
            users.set_password(session=session, user=alice,
                               password_hash=users.hash_password(PASSWORD))


@pytest.mark.parametrize(("id_token", "says"), [
    ("forged", "signature does not verify"),
    ("expired", "ID token has expired"),
    ("wrong_nonce", "nonce mismatch"),
])
def test_a_bad_id_token_is_refused_without_a_session(browser, provider, engine, id_token, says):
    provider.steer(username="alice", groups=["ops-admins"], id_token=id_token)
    back = sso_sign_in(browser)
    assert back.status_code == 401, back.text
    assert "Single sign-on refused" in back.text and says in back.text
    assert 'id="login-error"' in back.text
    assert signed_in_as(browser) is None
    assert stored_user(engine, "alice") is None
    [refused] = events(engine, "user.sso_refused")
    assert refused.actor == "sso:unverified" and says in refused.reason
    assert refused.details == {"method": "oidc", "address": "127.0.0.1"}


def test_a_rotated_key_is_fetched_at_most_once_per_refresh_interval(browser, provider,
                                                                    monkeypatch):
    from controlplane.auth import oidc

    provider.steer(username="alice")
    assert sso_sign_in(browser).status_code == 303  # the key set is cached now
    provider.steer(username="alice", id_token="rotated")
    # Within KEYS_REFRESH_MIN_S of the last fetch an unknown key id fetches nothing: refused.
    early = sso_sign_in(browser)
    assert early.status_code == 401 and "a key the provider does not publish" in early.text
    monkeypatch.setattr(oidc, "KEYS_REFRESH_MIN_S", 0.0)
    assert sso_sign_in(browser).status_code == 303


def test_an_answer_to_another_sign_in_is_refused(browser, provider, engine):
    provider.steer(username="alice")
    callback = to_provider(browser)
    parts = urlsplit(callback)
    query = dict(parse_qsl(parts.query))
    tampered = urlunsplit(parts._replace(query=urlencode({**query, "state": "x" * 43})))
    back = back_from_provider(browser, tampered)
    assert back.status_code == 401 and "state mismatch" in back.text
    assert signed_in_as(browser) is None

    # The genuine answer, in a browser that did not start this sign-in: refused too (400,
    # neither counted nor recorded: no sign-in of that browser is under way).
    with httpx.Client(base_url=str(browser.base_url), follow_redirects=False) as elsewhere:
        other = elsewhere.get(callback)
        assert other.status_code == 400 and "no single sign-on under way" in other.text
    # The flow cookie went with the first refusal: the genuine answer is refused here now too.
    assert back_from_provider(browser, callback).status_code == 400
    assert stored_user(engine, "alice") is None
    assert len(events(engine, "user.sso_refused")) == 1


def test_a_provider_error_is_shown_by_its_code_only(browser, provider):
    to_provider(browser)
    back = browser.get("/ui/login/oidc/callback", params={
        "error": "access_denied", "error_description": "Call +1 555 0100 to unlock"})
    assert back.status_code == 401 and "did not sign you in (access_denied)" in back.text
    assert "555" not in back.text
    to_provider(browser)  # the refusal ended that sign-in: a new one
    odd = browser.get("/ui/login/oidc/callback", params={"error": "<b>Call us</b>"})
    assert odd.status_code == 401 and "did not sign you in (an error)" in odd.text
    assert "Call us" not in odd.text


def test_a_user_without_a_mapped_role_is_refused(browser, provider, engine):
    provider.steer(username="carol", groups=["strangers"])
    back = sso_sign_in(browser)
    assert back.status_code == 403
    assert "none of your groups (strangers)" in back.text
    assert signed_in_as(browser) is None and stored_user(engine, "carol") is None
    [refused] = events(engine, "user.sso_refused")
    assert (refused.actor, refused.details["groups"]) == ("user:carol", ["strangers"])


def test_a_user_is_bound_to_the_provider_account_that_first_signed_in(browser, provider,
                                                                      engine, issuer):
    provider.steer(username="dave", groups=["ops"], subject="account-1")
    assert sso_sign_in(browser).status_code == 303
    assert stored_user(engine, "dave").sso_subject == f"{issuer} account-1"
    browser.cookies.clear()
    # Another account at the provider renamed to "dave" is not dave.
    provider.steer(username="dave", groups=["ops-admins"], subject="account-2")
    back = sso_sign_in(browser)
    assert back.status_code == 403 and "belongs to another account" in back.text
    assert signed_in_as(browser) is None
    dave = stored_user(engine, "dave")
    assert (dave.role, dave.sso_subject) == ("operator", f"{issuer} account-1")
    assert events(engine, "user.sso_refused")[-1].actor == "user:dave"
    # The first account still signs in.
    provider.steer(username="dave", groups=["ops"], subject="account-1")
    assert sso_sign_in(browser).status_code == 303


def test_single_sign_on_never_takes_a_local_users_name(browser, provider, engine):
    with Session(engine) as session:
        users.create_user(session=session, username="admin", password=PASSWORD, role="admin")
        session.commit()
    provider.steer(username="admin", groups=["readers"])
    back = sso_sign_in(browser)
    assert back.status_code == 403 and "is a local exitplane user" in back.text
    assert signed_in_as(browser) is None
    local = stored_user(engine, "admin")
    assert (local.origin, local.role) == ("local", "admin")


@pytest.mark.parametrize(("values", "says"), [
    ({"oidc_issuer": "http://idp.example.com"}, "is not https"),
    ({"oidc_issuer": "http://idp.example.com", "oidc_allow_insecure_http": True},
     "plain http off loopback"),
    ({"oidc_issuer": "https://idp.example.com"}, "EXITPLANE_OIDC_CLIENT_ID is empty"),
    ({"oidc_issuer": "https://idp.example.com", "oidc_client_id": "x",
      "oidc_scopes": "profile"}, "must include `openid`"),
    ({"proxy_user_header": "X-Forwarded-User"}, "needs EXITPLANE_TRUSTED_PROXIES"),
    ({"proxy_user_header": "Cookie", "trusted_proxies": "10.0.0.1"}, "not a header"),
    ({"sso_role_mapping": {"ops": "root"}}, "sso_role_mapping"),
])
def test_incomplete_single_sign_on_settings_stop_the_start(values, says, tmp_path):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=says):
        Settings(var_dir=tmp_path, **values)


def test_the_client_secret_stays_out_of_reprs():
    settings = Settings(oidc_issuer="https://idp.example.com", oidc_client_id="x",
                        oidc_client_secret="s3cret-value")
    assert "s3cret-value" not in repr(settings)
    assert settings.oidc_client_secret.get_secret_value() == "s3cret-value"


def test_the_role_mapping_takes_the_strongest_role_or_the_default():
    mapping = RoleMapping(groups=MAPPING)
    assert mapping.role_of(["readers", "ops"]) == "operator"
    assert mapping.role_of(["nobody"]) is None
    assert RoleMapping(groups=MAPPING, default_role="viewer").role_of([]) == "viewer"


# -- header sign-in behind a trusted proxy ---------------------------------------------------

PROXIED = {"X-Forwarded-User": "bob", "X-Forwarded-Groups": "readers, ops"}


def test_a_trusted_proxys_header_signs_the_user_in(browser, engine):
    browser.headers.update(PROXIED)
    account = signed_in_as(browser)
    assert account is not None and "bob" in account and "role-operator" in account
    bob = stored_user(engine, "bob")
    assert (bob.origin, bob.role) == ("sso", "operator")
    # One sign-in: the session it started carries the next pages.
    assert signed_in_as(browser) is not None
    [signed] = events(engine, "user.sso_sign_in")
    assert signed.actor == "user:bob" and signed.details["method"] == "proxy"
    # Forms work as in any session (same CSRF rules).
    token = csrf_of(browser.get("/ui/account").text)
    assert browser.post("/ui/logout", data={"csrf_token": "wrong"}).status_code == 403
    assert browser.post("/ui/logout", data={"csrf_token": token}).status_code == 303

    # The API never reads the header: it answers who has a token.
    api = browser.get("/v1/deployments")
    assert api.status_code == 401

    # A user the groups give no role is refused, and nothing is created.
    refused = browser.get("/ui/account", headers={"X-Forwarded-User": "dave",
                                                   "X-Forwarded-Groups": "strangers"})
    assert refused.status_code == 403 and "none of your groups" in refused.text
    assert stored_user(engine, "dave") is None
    # Refused on every request, recorded once a minute.
    again = browser.get("/ui/", headers={"X-Forwarded-User": "dave",
                                         "X-Forwarded-Groups": "strangers"})
    assert again.status_code == 403
    assert [e.actor for e in events(engine, "user.sso_refused")] == ["user:dave"]


def test_the_header_from_an_untrusted_address_is_ignored(served, engine, caplog):
    # 127.0.0.2 is this host too, but not in EXITPLANE_TRUSTED_PROXIES (127.0.0.1/32).
    transport = httpx.HTTPTransport(local_address="127.0.0.2")
    with httpx.Client(base_url=served, transport=transport, follow_redirects=False,
                      timeout=30) as elsewhere, \
            caplog.at_level(logging.WARNING, logger="exitplane.auth"):
        for headers in (PROXIED, {**PROXIED, "X-Forwarded-For": "127.0.0.1"}):
            elsewhere.headers.update(headers)
            assert signed_in_as(elsewhere) is None
            login = elsewhere.get("/ui/login")
            assert login.status_code == 200 and 'name="password"' in login.text
            assert elsewhere.get("/v1/deployments").status_code == 401
    assert stored_user(engine, "bob") is None
    assert events(engine, "user.sso_sign_in") == []
    ignored = [r.getMessage() for r in caplog.records if r.name == "exitplane.auth"]
    assert ignored and all("127.0.0.2" in line and "bob" not in line for line in ignored)


# -- in a real browser -----------------------------------------------------------------------

@pytest.mark.browser
def test_signing_in_with_the_provider_in_chromium(served, provider, engine):
    from selenium.webdriver.common.by import By

    from tests.support.browser import (
        check_page_quality,
        console_errors,
        navigate,
        screenshot,
        start_chromium,
        wait_for,
    )

    provider.steer(username="erin", groups=["ops"])
    driver = start_chromium()
    try:
        driver.get(f"{served}/ui/")
        button = wait_for(driver, "a#sso-sign-in")
        assert button.text == "Sign in with Test IdP"
        check_page_quality(driver, "login-sso")
        screenshot(driver, "login-sso")
        navigate(driver, button)  # to the provider, which approves erin, and back
        who = wait_for(driver, ".whoami .who")
        assert driver.current_url == f"{served}/ui/"
        assert "erin" in who.text
        assert who.find_element(By.CSS_SELECTOR, ".role").text.lower() == "operator"
        assert driver.get_cookie("exitplane_oidc") is None  # the flow is consumed
        check_page_quality(driver, "overview-after-sso")

        # Refused: the page says why, and nothing is signed in.
        driver.delete_all_cookies()
        provider.steer(username="erin", groups=["ops"], id_token="forged")
        driver.get(f"{served}/ui/login")
        navigate(driver, wait_for(driver, "a#sso-sign-in"))
        error = wait_for(driver, "#login-error")
        assert "signature does not verify" in error.text
        assert driver.find_elements(By.CSS_SELECTOR, ".whoami") == []
        # The console's one error is the answer's own status (401), nothing the page did.
        logged = console_errors(driver)
        assert len(logged) == 1 and "401" in logged[0], logged
        check_page_quality(driver, "login-sso-refused")
        screenshot(driver, "login-sso-refused")
    finally:
        driver.quit()
    assert stored_user(engine, "erin").role == "operator"


@pytest.mark.browser
def test_header_sign_in_in_chromium_only_behind_a_trusted_proxy(served, engine, db_url, issuer,
                                                                 tmp_path):
    """Chromium sends the proxy's headers (as an authenticating proxy in front of it would):
    the control plane that trusts this address signs bob in; one whose trusted proxies do not
    include it shows the login page and signs no one in."""
    from selenium.webdriver.common.by import By

    from tests.support.browser import start_chromium, wait_for

    elsewhere = create_app(Settings(
        database_url=db_url, var_dir=tmp_path / "var-elsewhere", config_cache_ttl_s=0.2,
        sso_role_mapping=MAPPING, trusted_proxies="10.0.0.0/8",
        proxy_user_header="X-Forwarded-User", proxy_groups_header="X-Forwarded-Groups"),
        engine=engine)
    live = start_server(elsewhere)
    driver = start_chromium()
    try:
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": PROXIED})
        driver.get(f"{live.url}/ui/")  # untrusted here: the header counts for nothing
        wait_for(driver, "input[name=password]")
        assert driver.find_elements(By.CSS_SELECTOR, ".whoami") == []
        assert stored_user(engine, "bob") is None

        driver.get(f"{served}/ui/")  # trusted here: signed in as the header says
        who = wait_for(driver, ".whoami .who")
        assert "bob" in who.text
        assert who.find_element(By.CSS_SELECTOR, ".role").text.lower() == "operator"
    finally:
        driver.quit()
        live.stop()
        elsewhere.state.config_delivery.close()
        elsewhere.state.heartbeats.close()
    assert stored_user(engine, "bob").origin == "sso"
