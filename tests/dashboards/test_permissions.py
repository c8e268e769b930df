"""Every UI action checks the role and the CSRF token server-side; a table lists them all and a
test proves the table covers every POST route the UI serves."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controlplane.auth import users
from controlplane.auth.models import User
from controlplane.db import make_engine
from controlplane.deployments.models import AuditEvent
from tests.support.dashboards import (
    Seeded,
    create_dead_hook,
    fire_drift_alert,
    queue_calibration,
    seed_deployment,
)
from tests.support.people import PASSWORD, create_people, csrf_of, quick_hasher, sign_in

# (route template, concrete path, form, weakest role allowed)
ACTIONS = [
    ("/deployments/{name}/act/{key}", "/ui/deployments/chat/act/activate",
     {"version": "4", "reason": "approve"}, "operator"),
    ("/deployments/{name}/act/{key}", "/ui/deployments/chat/act/rollback",
     {"reason": "bad"}, "operator"),
    ("/deployments/{name}/act/{key}", "/ui/deployments/chat/act/canary",
     {"version": "4", "reason": "try"}, "operator"),
    ("/deployments/{name}/act/{key}", "/ui/deployments/chat/act/canary-stop",
     {"reason": "stop"}, "operator"),
    ("/deployments/{name}/act/{key}", "/ui/deployments/chat/act/promote",
     {"reason": "ship"}, "operator"),
    ("/deployments/{name}/versions", "/ui/deployments/chat/versions",
     {"layer_3": "0.9", "layer_6": "0.9", "layer_9": "0.9", "reason": "manual"}, "operator"),
    ("/deployments/{name}/settings", "/ui/deployments/chat/settings",
     {"policy": "approval", "delta": "0.02"}, "operator"),
    ("/deployments/{name}/segments", "/ui/deployments/chat/segments",
     {"segment": "support", "reason": "declare"}, "operator"),
    ("/deployments/{name}/segments/{segment}/remove",
     "/ui/deployments/chat/segments/support/remove", {"reason": "retire"}, "operator"),
    ("/deployments/{name}/segments/auto", "/ui/deployments/chat/segments/auto",
     {"auto_segments": "on"}, "operator"),
    ("/deployments/{name}/outliers/{outlier_id}/clear",
     "/ui/deployments/chat/outliers/1/clear", {"reason": "checked"}, "operator"),
    ("/deployments/{name}/runtimes/{runtime_id}/remove",
     "/ui/deployments/chat/runtimes/rt-a/remove", {"reason": "decommissioned"}, "operator"),
    ("/tokens", "/ui/tokens", {"name": "ci", "scope": "operator"}, "admin"),
    ("/tokens/{token_id}/revoke", "/ui/tokens/1/revoke", {}, "admin"),
    ("/users", "/ui/users", {"username": "eve", "password": PASSWORD, "role": "viewer"},
     "admin"),
    ("/users/{user_id}/role", "/ui/users/1/role", {"role": "viewer"}, "admin"),
    ("/users/{user_id}/disabled", "/ui/users/1/disabled", {"disabled": "true"}, "admin"),
    ("/users/{user_id}/password", "/ui/users/1/password", {"password": PASSWORD + "!"},
     "admin"),
    ("/deployments/{name}/calibrations", "/ui/deployments/chat/calibrations",
     {"hours": "24", "reason": "drift"}, "operator"),
    ("/deployments/{name}/calibrations/{job_id}/{decision}",
     "/ui/deployments/chat/calibrations/1/approve", {"reason": "ok"}, "operator"),
    ("/deployments/{name}/calibrations/{job_id}/{decision}",
     "/ui/deployments/chat/calibrations/1/reject", {"reason": "no"}, "operator"),
    ("/alerts/{alert_id}/ack", "/ui/alerts/1/ack", {"note": "on it"}, "operator"),
    ("/alerts/{alert_id}/resolve", "/ui/alerts/1/resolve", {"reason": "fixed"}, "operator"),
    ("/hooks", "/ui/hooks", {"name": "pager", "kind": "slack",
                             "url": "https://hooks.slack.com/services/T0/B0/x"}, "admin"),
    ("/hooks/{hook_id}/test", "/ui/hooks/1/test", {}, "admin"),
    ("/hooks/{hook_id}/enabled", "/ui/hooks/1/enabled", {"enabled": "false"}, "admin"),
    ("/hooks/{hook_id}/delete", "/ui/hooks/1/delete", {}, "admin"),
    ("/account/password", "/ui/account/password",
     {"current": PASSWORD, "new": PASSWORD + "+", "confirm": PASSWORD + "+"}, "viewer"),
    ("/logout", "/ui/logout", {}, "viewer"),
]
PUBLIC_POSTS = {"/login"}  # checked for CSRF in test_login_needs_csrf
ROLE_RANK = {"viewer": 0, "operator": 1, "admin": 2}
ACTION_IDS = [path.removeprefix("/ui/") for _, path, _, _ in ACTIONS]

# Every test here has a deployment, a firing alert, a hook and a calibration job (id 1 each).
pytestmark = pytest.mark.usefixtures("seeded", "firing_alert", "dead_hook", "queued_job")


@dataclass
class Store:
    """The store every test here starts from: a SQLite file (the alert's report inside)."""

    path: Path
    seeded: Seeded
    alert_id: int
    hook_id: int
    job_id: int
    people: dict[str, str]


@pytest.fixture(scope="module")
def store(sqlite_template, tmp_path_factory) -> Iterator[Store]:
    """The seeded deployment, firing alert, dead hook, queued job and people of
    tests/dashboards/conftest.py, stored once (in the order those fixtures store them) rather
    than for each of the ~180 tests: each test gets a copy (`db_url`, `firing_alert`)."""
    folder = tmp_path_factory.mktemp("permissions")
    path = folder / "seeded.db"
    shutil.copy(sqlite_template, path)
    engine = make_engine(f"sqlite:///{path}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(users, "_hasher", quick_hasher())  # as the tests' quick_hashing
        seeded = seed_deployment(engine, minutes=3)  # what `seeded` stores outside the browser
        alert_id = fire_drift_alert(engine, name=seeded.name)
        hook_id = create_dead_hook(engine)
        job_id = queue_calibration(engine, name=seeded.name)
        people = create_people(engine)
    engine.dispose()
    yield Store(path=path, seeded=seeded, alert_id=alert_id, hook_id=hook_id,
                job_id=job_id, people=people)


@pytest.fixture
def db_url(store, tmp_path) -> str:
    """Roles and CSRF do not depend on the store, so this module runs on SQLite only (the
    action, alert and calibration tests run on every backend)."""
    path = tmp_path / "exitplane.db"
    shutil.copy(store.path, path)
    return f"sqlite:///{path}"


@pytest.fixture
def seeded(store) -> Seeded:
    return store.seeded


@pytest.fixture
def firing_alert(store) -> int:
    return store.alert_id


@pytest.fixture
def dead_hook(store) -> int:
    return store.hook_id


@pytest.fixture
def queued_job(store) -> int:
    return store.job_id


@pytest.fixture
def people(store) -> dict[str, str]:
    return store.people


def _ui_app(app):
    return next(route.app for route in app.routes if getattr(route, "path", "") == "/ui")


def _routes(routes):
    """Routes, looking inside included routers (FastAPI keeps them as wrappers)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from _routes(inner.routes)
        else:
            yield route


def test_the_table_covers_every_post_route(app):
    posts = {route.path for route in _routes(_ui_app(app).routes)
             if "POST" in getattr(route, "methods", ())}
    assert posts == {template for template, *_ in ACTIONS} | PUBLIC_POSTS


def _audit_count(engine) -> int:
    with Session(engine) as session:
        return session.scalar(select(func.count()).select_from(AuditEvent))


def _csrf(client) -> str:
    return csrf_of(client.get("/ui/login" if "exitplane_session" not in client.cookies
                              else "/ui/").text)


@pytest.mark.parametrize(("template", "path", "form", "needed"), ACTIONS, ids=ACTION_IDS)
def test_actions_refuse_missing_wrong_or_foreign_csrf(as_role, seeded, engine, template, path,
                                                       form, needed):
    client = as_role("admin")
    before = _audit_count(engine)
    missing = client.post(path, data=form, follow_redirects=False)
    wrong = client.post(path, data={**form, "csrf_token": "forged"}, follow_redirects=False)
    foreign = client.post(path, data={**form, "csrf_token": _csrf(client)},
                          headers={"Origin": "https://evil.example"}, follow_redirects=False)
    for response in (missing, wrong, foreign):
        assert response.status_code == 403, response.text
        assert "Not allowed" in response.text
    assert _audit_count(engine) == before
    assert client.get("/ui/").status_code == 200  # still signed in


@pytest.mark.parametrize(("template", "path", "form", "needed"), ACTIONS, ids=ACTION_IDS)
@pytest.mark.parametrize("role", ["viewer", "operator", "admin"])
def test_actions_need_their_role(as_role, seeded, engine, template, path, form, needed, role):
    client = as_role(role)
    before = _audit_count(engine)
    response = client.post(path, data={**form, "csrf_token": _csrf(client)},
                           follow_redirects=False)
    if ROLE_RANK[role] < ROLE_RANK[needed]:
        assert response.status_code == 403
        assert f"needs the {needed} role" in response.text
        assert _audit_count(engine) == before
    else:
        assert response.status_code in (201, 303), response.text


@pytest.mark.parametrize(("template", "path", "form", "needed"), ACTIONS, ids=ACTION_IDS)
def test_signed_out_actions_go_to_login(ui, seeded, people, template, path, form, needed):
    token = csrf_of(ui.get("/ui/login").text)  # an anonymous session's valid token
    response = ui.post(path, data={**form, "csrf_token": token}, follow_redirects=False)
    assert response.status_code == 303
    assert response.headers["location"].startswith("/ui/login")


@pytest.mark.parametrize(("path", "needed"), [
    ("/ui/", "viewer"), ("/ui/deployments/chat", "viewer"),
    ("/ui/deployments/chat/charts.json", "viewer"), ("/ui/deployments/chat/versions", "viewer"),
    ("/ui/deployments/chat/diff?a=2&b=3", "viewer"),
    ("/ui/deployments/chat/act/rollback", "operator"),
    ("/ui/deployments/chat/act/activate?version=4", "operator"),
    ("/ui/deployments/chat/versions/new", "operator"),
    ("/ui/tokens", "admin"), ("/ui/users", "admin"),
    ("/ui/deployments/chat/calibrations", "viewer"),
    ("/ui/deployments/chat/calibrations/1", "viewer"), ("/ui/account", "viewer"),
    ("/ui/alerts", "viewer"), ("/ui/alerts?status=all", "viewer"), ("/ui/alerts/1", "viewer"),
    ("/ui/alerts/1/report", "viewer"), ("/ui/hooks", "admin"), ("/ui/hooks/1", "admin"),
    ("/ui/deployments/chat/segments", "viewer"),
    ("/ui/deployments/chat/runtimes/rt-a/remove", "operator"),
    ("/ui/deployments/chat/what-if", "operator"),
])
@pytest.mark.parametrize("role", ["viewer", "operator", "admin"])
def test_pages_need_their_role(as_role, seeded, path, needed, role):
    response = as_role(role).get(path)
    expected = 200 if ROLE_RANK[role] >= ROLE_RANK[needed] else 403
    assert response.status_code == expected


def test_pages_need_sign_in(ui, seeded):
    response = ui.get("/ui/deployments/chat", follow_redirects=False)
    assert response.status_code == 303
    assert response.headers["location"] == "/ui/login?next=/ui/deployments/chat"
    assert ui.get("/ui/deployments/chat/charts.json",
                  follow_redirects=False).status_code == 303


def test_login_needs_csrf(ui, people):
    response = ui.post("/ui/login", data={"username": "admin", "password": PASSWORD},
                       follow_redirects=False)
    assert response.status_code == 403
    assert ui.get("/ui/", follow_redirects=False).status_code == 303


def test_session_cookie_flags(ui, people):
    response = sign_in(ui, "admin").history[0]
    cookie = response.headers["set-cookie"]
    assert re.search(r"exitplane_session=[^;]+; HttpOnly; Max-Age=\d+; Path=/ui; "
                     r"SameSite=lax; Secure", cookie), cookie


def test_plain_http_loopback_cookie_is_not_secure_but_elsewhere_it_is(app, people):
    from fastapi.testclient import TestClient

    with TestClient(app, base_url="http://127.0.0.1") as loopback:
        cookie = sign_in(loopback, "admin").history[0].headers["set-cookie"]
        assert "HttpOnly" in cookie and "Secure" not in cookie
    with TestClient(app, base_url="http://exitplane.internal") as remote:
        cookie = remote.get("/ui/login").headers["set-cookie"]
        assert "Secure" in cookie


def test_tampered_session_is_anonymous(ui, people):
    sign_in(ui, "viewer")
    value = ui.cookies["exitplane_session"]
    body, _, mac = value.partition(".")
    forged = body.replace(body[5], "A" if body[5] != "A" else "B", 1) + "." + mac
    ui.cookies.clear()
    assert ui.get("/ui/", headers={"Cookie": f"exitplane_session={value}"},
                  follow_redirects=False).status_code == 200
    ui.cookies.clear()
    assert ui.get("/ui/", headers={"Cookie": f"exitplane_session={forged}"},
                  follow_redirects=False).status_code == 303


def test_disabling_a_user_ends_their_session(as_role, app, engine, people):
    from fastapi.testclient import TestClient

    viewer = as_role("viewer")
    assert viewer.get("/ui/", follow_redirects=False).status_code == 200
    with TestClient(app, base_url="https://testserver") as admin:
        sign_in(admin, "admin")
        with Session(engine) as session:
            viewer_id = session.scalar(select(User.id).where(User.username == "viewer"))
        page = admin.get("/ui/users")
        done = admin.post(f"/ui/users/{viewer_id}/disabled",
                          data={"disabled": "true", "csrf_token": csrf_of(page.text)})
        assert "viewer&#39; is disabled and signed out" in done.text
    assert viewer.get("/ui/", follow_redirects=False).status_code == 303
    assert sign_in(viewer, "viewer").status_code == 401


def test_wrong_password_then_throttled(ui, people):
    for _ in range(5):
        response = sign_in(ui, "operator", password="not the password")
        assert response.status_code == 401
        assert "Wrong username or password" in response.text
    assert sign_in(ui, "operator").status_code == 429  # even with the right password
    assert sign_in(ui, "nobody", password="whatever").status_code == 401


@pytest.mark.parametrize("wanted", [
    "https://evil.example/", "//evil.example/", "/ui/\\evil.example", "/ui/\t/evil.example",
    "/ui/\n/evil.example", "/ui/ /x"])
def test_next_never_leaves_the_ui(ui, people, wanted):
    page = ui.get("/ui/login", params={"next": wanted})
    response = ui.post("/ui/login", data={"username": "admin", "password": PASSWORD,
                                          "next": wanted, "csrf_token": csrf_of(page.text)},
                       follow_redirects=False)
    assert response.headers["location"] == "/ui/"
    page = ui.get("/ui/login")
    ui.cookies.clear()
    page = ui.get("/ui/login")
    response = ui.post("/ui/login", data={"username": "admin", "password": PASSWORD,
                                          "next": "/ui/tokens",
                                          "csrf_token": csrf_of(page.text)},
                       follow_redirects=False)
    assert response.headers["location"] == "/ui/tokens"


def test_logout_ends_the_session_and_old_copies_of_the_cookie(as_role):
    client = as_role("operator")
    stolen = client.cookies["exitplane_session"]
    response = client.post("/ui/logout", data={"csrf_token": _csrf(client)})
    assert "You are signed out" in response.text
    assert client.get("/ui/", follow_redirects=False).status_code == 303
    client.cookies.clear()
    assert client.get("/ui/", headers={"Cookie": f"exitplane_session={stolen}"},
                      follow_redirects=False).status_code == 303


def test_security_headers(ui, people):
    response = ui.get("/ui/login")
    assert "script-src 'self'" in response.headers["content-security-policy"]
    assert response.headers["x-frame-options"] == "DENY"
    assert response.headers["cache-control"] == "no-store"


def test_changing_your_password_keeps_this_session_and_ends_the_others(as_role, app):
    from fastapi.testclient import TestClient

    here = as_role("operator")
    with TestClient(app, base_url="https://testserver") as elsewhere:
        sign_in(elsewhere, "operator")
        form = {"current": "not it", "new": PASSWORD + "+", "confirm": PASSWORD + "+"}
        wrong = here.post("/ui/account/password", data={**form, "csrf_token": _csrf(here)})
        assert "the current password is wrong" in wrong.text
        form["current"] = PASSWORD
        done = here.post("/ui/account/password", data={**form, "csrf_token": _csrf(here)})
        assert "Password changed" in done.text
        assert here.get("/ui/", follow_redirects=False).status_code == 200
        assert elsewhere.get("/ui/", follow_redirects=False).status_code == 303
        assert sign_in(elsewhere, "operator", password=PASSWORD + "+").status_code == 200
