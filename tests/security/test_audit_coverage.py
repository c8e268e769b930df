"""Every state-changing action of the API and the admin UI is an audit event.

The tables below classify every POST, PUT, PATCH and DELETE route the app serves, keyed by
"METHOD /path" as its route table names them: either the audit action the route writes, with
a concrete call, or why it writes none (runtime traffic, sign-in, a read sent as a POST). The
first test walks the app's routes and fails on a state-changing route in neither table, so a
route added without an audit decision fails the suite. Each audited route is then called, as
an admin would, in a world where it succeeds, and the fleet-wide log must hold a new event of
its action by its caller."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session
from starlette.routing import Mount

from controlplane.alerts.hook_service import create_hook
from controlplane.alerts.service import Condition, fire
from controlplane.auth.service import create_token
from controlplane.auth.users import create_user
from controlplane.calibration.models import CalibrationJob
from controlplane.db import make_engine, utcnow
from controlplane.deployments import segments
from controlplane.deployments import service as thresholds
from controlplane.deployments.audit import AuditFilter, fleet_audit
from controlplane.deployments.schemas import DeploymentCreate
from controlplane.flows.canary import start_canary
from controlplane.runtimes.outliers import set_aside
from controlplane.runtimes.service import record_heartbeat
from exitplane.wire import Heartbeat

pytestmark = pytest.mark.usefixtures("quick_hashing", "outbox")

STATE_CHANGING = {"POST", "PUT", "PATCH", "DELETE"}
PASSWORD = "correct horse battery staple"
REASON = {"reason": "audit coverage"}


@dataclass(frozen=True)
class Audited:
    """A call that succeeds in the world below (`{name}` placeholders are its ids) and the
    audit action it must write; `ok` is its success status (default: 2xx for the API, 303
    after a UI form)."""

    path: str
    action: str
    body: dict | None = None
    ok: tuple[int, ...] = ()


API: dict[str, Audited] = {
    "POST /v1/deployments": Audited("/v1/deployments", "deployment.create", {
        "name": "gamma", "model_ref": "m", "num_layers": 12, "exit_layers": [3, 6, 9]}),
    "PATCH /v1/deployments/{name}": Audited("/v1/deployments/alpha", "deployment.update",
                                            {"delta": 0.02}),
    "POST /v1/deployments/{name}/threshold-sets": Audited(
        "/v1/deployments/alpha/threshold-sets", "threshold_set.publish",
        {"thresholds": {"3": 0.9, "6": 0.9, "9": 0.9}, **REASON}),
    "PUT /v1/deployments/{name}/aliases/{alias}": Audited(
        "/v1/deployments/alpha/aliases/active", "alias.move", {"version": 1, **REASON}),
    "DELETE /v1/deployments/{name}/aliases/{alias}": Audited(
        "/v1/deployments/alpha/aliases/canary?reason=coverage", "alias.clear"),
    "POST /v1/deployments/{name}/rollback": Audited("/v1/deployments/alpha/rollback",
                                                    "alias.rollback", REASON),
    "PUT /v1/deployments/{name}/declared-segments/{segment}": Audited(
        "/v1/deployments/alpha/declared-segments/chat", "segment.declare", REASON),
    "DELETE /v1/deployments/{name}/declared-segments/{segment}": Audited(
        "/v1/deployments/alpha/declared-segments/support?reason=coverage", "segment.remove"),
    "DELETE /v1/deployments/{name}/runtimes/{runtime_id}": Audited(
        "/v1/deployments/alpha/runtimes/rt-1?reason=coverage", "runtime.remove"),
    "DELETE /v1/deployments/{name}/runtimes": Audited(
        "/v1/deployments/alpha/runtimes?token_id={runtime_token}&reason=coverage",
        "runtime.remove"),
    "POST /v1/deployments/{name}/runtime-outliers/{outlier_id}/clear": Audited(
        "/v1/deployments/alpha/runtime-outliers/{outlier}/clear", "runtime.outlier_clear",
        REASON),
    "DELETE /v1/deployments/{name}": Audited("/v1/deployments/beta?reason=coverage",
                                             "deployment.delete"),
    "POST /v1/users": Audited("/v1/users", "user.create", {
        "username": "newcomer", "role": "viewer", "password": PASSWORD}),
    "PATCH /v1/users/{username}": Audited("/v1/users/spare", "user.role", {"role": "operator"}),
    "POST /v1/tokens": Audited("/v1/tokens", "token.create", {"name": "ci",
                                                              "scope": "operator"}),
    "DELETE /v1/tokens/{token_id}": Audited("/v1/tokens/{spare_token}", "token.revoke"),
    "POST /v1/alerts/{alert_id}/ack": Audited("/v1/alerts/{alert}/ack", "alert.acknowledge",
                                              {"note": "on it"}),
    "POST /v1/alerts/{alert_id}/resolve": Audited("/v1/alerts/{alert}/resolve",
                                                  "alert.resolve", REASON),
    "POST /v1/hooks": Audited("/v1/hooks", "hook.create", {
        "name": "pager", "kind": "slack", "url": "https://hooks.slack.com/services/T0/B0/x"}),
    "PATCH /v1/hooks/{hook_id}": Audited("/v1/hooks/{hook}", "hook.update",
                                         {"enabled": False}),
    "DELETE /v1/hooks/{hook_id}": Audited("/v1/hooks/{hook}", "hook.delete"),
    "POST /v1/deployments/{name}/calibrations": Audited(
        "/v1/deployments/alpha/calibrations", "calibration.request", REASON),
    "POST /v1/deployments/{name}/calibrations/{job_id}/approve": Audited(
        "/v1/deployments/alpha/calibrations/{waiting_job}/approve", "alias.promote", REASON),
    "POST /v1/deployments/{name}/calibrations/{job_id}/reject": Audited(
        "/v1/deployments/alpha/calibrations/{waiting_job}/reject", "candidate.reject", REASON),
    "POST /v1/deployments/{name}/canary": Audited("/v1/deployments/beta/canary",
                                                  "canary.start", {"version": 2, **REASON}),
    "POST /v1/deployments/{name}/canary/promote": Audited(
        "/v1/deployments/alpha/canary/promote", "canary.promote", REASON),
    "POST /v1/deployments/{name}/canary/revert": Audited(
        "/v1/deployments/alpha/canary/revert", "alias.clear", REASON),
}

UI: dict[str, Audited] = {
    "POST /ui/account/password": Audited("/ui/account/password", "user.password", {
        "current": PASSWORD, "new": PASSWORD + "+", "confirm": PASSWORD + "+"}),
    "POST /ui/deployments/{name}/act/{key}": Audited("/ui/deployments/alpha/act/rollback",
                                                     "alias.rollback", REASON),
    "POST /ui/deployments/{name}/versions": Audited(
        "/ui/deployments/alpha/versions", "threshold_set.publish",
        {"layer_3": "0.9", "layer_6": "0.9", "layer_9": "0.9", **REASON}),
    "POST /ui/deployments/{name}/settings": Audited(
        "/ui/deployments/alpha/settings", "deployment.update",
        {"policy": "approval", "delta": "0.02"}),
    "POST /ui/deployments/{name}/segments": Audited(
        "/ui/deployments/alpha/segments", "segment.declare", {"segment": "chat", **REASON}),
    "POST /ui/deployments/{name}/segments/{segment}/remove": Audited(
        "/ui/deployments/alpha/segments/support/remove", "segment.remove", REASON),
    "POST /ui/deployments/{name}/segments/auto": Audited(
        "/ui/deployments/alpha/segments/auto", "deployment.update", {"auto_segments": "on"}),
    "POST /ui/deployments/{name}/outliers/{outlier_id}/clear": Audited(
        "/ui/deployments/alpha/outliers/{outlier}/clear", "runtime.outlier_clear", REASON),
    "POST /ui/deployments/{name}/runtimes/{runtime_id}/remove": Audited(
        "/ui/deployments/alpha/runtimes/rt-1/remove", "runtime.remove", REASON),
    "POST /ui/deployments/{name}/calibrations": Audited(
        "/ui/deployments/alpha/calibrations", "calibration.request",
        {"hours": "24", **REASON}),
    "POST /ui/deployments/{name}/calibrations/{job_id}/{decision}": Audited(
        "/ui/deployments/alpha/calibrations/{waiting_job}/approve", "alias.promote", REASON),
    "POST /ui/alerts/{alert_id}/ack": Audited("/ui/alerts/{alert}/ack", "alert.acknowledge",
                                              {"note": "on it"}),
    "POST /ui/alerts/{alert_id}/resolve": Audited("/ui/alerts/{alert}/resolve",
                                                  "alert.resolve", REASON),
    "POST /ui/hooks": Audited("/ui/hooks", "hook.create", {
        "name": "pager", "kind": "slack", "url": "https://hooks.slack.com/services/T0/B0/x"},
        ok=(201,)),
    "POST /ui/hooks/{hook_id}/enabled": Audited("/ui/hooks/{hook}/enabled", "hook.update",
                                                {"enabled": "false"}),
    "POST /ui/hooks/{hook_id}/delete": Audited("/ui/hooks/{hook}/delete", "hook.delete", {}),
    "POST /ui/tokens": Audited("/ui/tokens", "token.create",
                               {"name": "ci", "scope": "operator"}, ok=(201,)),
    "POST /ui/tokens/{token_id}/revoke": Audited("/ui/tokens/{spare_token}/revoke",
                                                 "token.revoke", {}),
    "POST /ui/users": Audited("/ui/users", "user.create", {
        "username": "eve", "password": PASSWORD, "role": "viewer"}),
    "POST /ui/users/{user_id}/role": Audited("/ui/users/{spare_user}/role", "user.role",
                                             {"role": "operator"}),
    "POST /ui/users/{user_id}/disabled": Audited("/ui/users/{spare_user}/disabled",
                                                 "user.disable", {"disabled": "true"}),
    "POST /ui/users/{user_id}/password": Audited("/ui/users/{spare_user}/password",
                                                 "user.password", {"password": PASSWORD + "!"}),
}

# State-changing routes that write no audit event, and why.
NOT_AUDITED: dict[str, str] = {
    "POST /v1/telemetry": "runtime traffic: token records and rollups, not administration",
    "POST /v1/deployments/{name}/heartbeats": "runtime traffic: a runtime saying it is alive",
    "POST /v1/deployments/{name}/runtimes/{runtime_id}/leave":
        "runtime traffic: a runtime leaving the fleet as it shuts down",
    "POST /v1/deployments/{name}/what-if": "a read sent as a POST: it changes nothing",
    "POST /v1/hooks/{hook_id}/test": "sends a test alert; the hook's delivery log records it",
    "POST /ui/hooks/{hook_id}/test": "sends a test alert; the hook's delivery log records it",
    "POST /ui/login": "signing in changes no configuration (failures are throttled)",
    "POST /ui/logout": "signing out changes no configuration",
}


def state_changing_routes(app) -> set[str]:
    """Every "METHOD /path" of the app that may change state, inside routers and mounts."""
    found: set[str] = set()

    def walk(routes, prefix: str) -> None:
        for route in routes:
            inner = getattr(route, "original_router", None)
            if inner is not None:
                walk(inner.routes, prefix)
            elif isinstance(route, Mount):
                walk(getattr(route.app, "routes", ()), prefix + route.path)
            else:
                found.update(f"{method} {prefix}{route.path}"
                             for method in set(route.methods or ()) & STATE_CHANGING)

    walk(app.routes, "")
    return found


def test_every_state_changing_route_is_audited_or_says_why_not(app):
    served = state_changing_routes(app)
    classified = set(API) | set(UI) | set(NOT_AUDITED)
    assert not set(API) & set(NOT_AUDITED) and not set(UI) & set(NOT_AUDITED)
    assert not served - classified, (
        "state-changing routes without an audit decision (record an audit event and add the "
        f"route to API or UI here, or say in NOT_AUDITED why not): {sorted(served - classified)}")
    assert not classified - served, f"rows for routes that are gone: {sorted(classified - served)}"


# -- the world every call runs in -------------------------------------------------------------

@dataclass
class World:
    app: object
    ids: dict[str, int]
    admin_token: str
    stack: ExitStack = field(default_factory=ExitStack)

    def path(self, call: Audited) -> str:
        return call.path.format_map(self.ids)


CSRF_FIELD = re.compile(r'name="csrf_token" value="([^"]+)"')


def _signed_in_admin(world: World) -> tuple[TestClient, str]:
    """A UI client on https (Secure cookies round-trip) signed in as `admin`, and its CSRF
    token."""
    client = world.stack.enter_context(TestClient(world.app, base_url="https://testserver"))
    token = CSRF_FIELD.search(client.get("/ui/login").text).group(1)
    signed = client.post("/ui/login", data={"username": "admin", "password": PASSWORD,
                                            "csrf_token": token})
    assert signed.status_code == 200, signed.text
    return client, CSRF_FIELD.search(client.get("/ui/account").text).group(1)


@pytest.fixture
def world(app, engine, tokens):
    """Deployment alpha (v1 conservative, v2 active, v3 on canary, v4 a candidate waiting for
    approval, runtime rt-1 set aside as an outlier, segment support declared, a firing alert),
    deployment beta (v2 published), a webhook, a spare token and a spare user, and an admin
    who signs in to the UI."""
    with Session(engine) as session:
        made = {name: thresholds.create_deployment(session=session, spec=DeploymentCreate(
            name=name, model_ref="m", num_layers=12, exit_layers=[3, 6, 9]), actor="user:seed")
            for name in ("alpha", "beta")}
        alpha = made["alpha"]
        for deployment, count in ((alpha, 3), (made["beta"], 1)):
            for _ in range(count):
                thresholds.publish(session=session, deployment=deployment,
                                   thresholds={3: 0.95, 6: 0.9, 9: 0.85}, reason="seed",
                                   actor="user:seed")
        thresholds.move_alias(session=session, deployment=alpha, alias="active", version=2,
                              actor="user:seed", reason="seed")
        start_canary(session=session, deployment=alpha, version=3, actor="user:seed")
        candidate = thresholds.publish(session=session, deployment=alpha,
                                       thresholds={3: 0.97, 6: 0.92, 9: 0.88},
                                       reason="candidate", actor="user:seed")
        now = utcnow()
        waiting = CalibrationJob(deployment_id=alpha.id, trigger="manual",
                                 requested_by="user:seed", since=now - timedelta(hours=1),
                                 status="succeeded", result_version=candidate.version,
                                 promotion="awaiting_approval", created_at=now,
                                 updated_at=now)
        session.add(waiting)
        runtime_token, _ = create_token(session=session, name="rt-alpha", scope="runtime",
                                        deployment=alpha)
        record_heartbeat(session=session, deployment=alpha,
                         beat=Heartbeat(runtime_id="rt-1", applied_version=2),
                         token_id=runtime_token.id)
        outlier, _ = set_aside(session=session, deployment=alpha, runtime_id="rt-1", version=2,
                               segment="default", summary="rt-1 differs from its fleet",
                               evidence={})
        segments.declare_segment(session=session, deployment=alpha, name="support",
                                 actor="user:seed")
        spare_token, _ = create_token(session=session, name="spare", scope="operator")
        create_user(session=session, username="admin", password=PASSWORD, role="admin")
        spare_user = create_user(session=session, username="spare", password=PASSWORD,
                                 role="viewer")
        alert, _ = fire(session=session, deployment=alpha, condition=Condition(
            kind="distribution_drift", severity="warning", layer=6, subject="6",
            summary="signal distribution at layer 6 drifted"))
        hook = create_hook(session=session, name="dead end", kind="webhook",
                           url="http://127.0.0.1:9/nothing", actor="user:seed")
        session.commit()
        ids = {"alert": alert.id, "hook": hook.id, "waiting_job": waiting.id,
               "spare_token": spare_token.id, "spare_user": spare_user.id,
               "outlier": outlier.id, "runtime_token": runtime_token.id}
    world = World(app=app, ids=ids, admin_token=tokens.admin)
    with world.stack:
        yield world


def _events(engine, action: str) -> list:
    with Session(engine) as session:
        return fleet_audit(session=session, rules=AuditFilter(action=action), limit=500)


def _check_new_event(engine, call: Audited, path: str, before: int, actor: str,
                     started: float):
    """The newest event of the call's action is new, its caller's, and carries the reason
    the call gave."""
    events = _events(engine, call.action)
    assert len(events) > before, f"no new {call.action} event"
    newest = events[0]
    assert newest.actor == actor
    assert newest.at.timestamp() >= started - 1
    given = ((call.body or {}).get("reason")
             or parse_qs(urlsplit(path).query).get("reason", [None])[0])
    if given:
        assert given in newest.reason
    return newest


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("route", sorted(API))
def test_an_api_action_writes_its_audit_event(route, world, client, engine):
    call = API[route]
    method = route.split()[0]
    before, started = len(_events(engine, call.action)), time.time()
    answer = client.request(method, world.path(call), json=call.body,
                            headers={"Authorization": f"Bearer {world.admin_token}"})
    assert answer.status_code in (call.ok or (200, 201, 202, 204)), answer.text
    newest = _check_new_event(engine, call, world.path(call), before, "token:test-admin",
                              started)
    if "{name}" in route:  # the event names the deployment acted on
        assert newest.deployment == world.path(call).split("/")[3].split("?")[0]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("route", sorted(UI))
def test_a_ui_action_writes_its_audit_event(route, world, engine):
    call = UI[route]
    browser, csrf = _signed_in_admin(world)
    before, started = len(_events(engine, call.action)), time.time()
    answer = browser.post(world.path(call), data={**(call.body or {}), "csrf_token": csrf},
                          follow_redirects=False)
    assert answer.status_code in (call.ok or (303,)), answer.text
    if answer.status_code == 303:
        flash = browser.get(answer.headers["location"]).text
        assert "flash-error" not in flash, flash
    _check_new_event(engine, call, world.path(call), before, "user:admin", started)


EXITPLANE = str(Path(sys.executable).parent / "exitplane")


@pytest.mark.slow  # runs the CLI's processes
def test_the_store_commands_are_audited(tmp_path, sqlite_template):
    """The commands with direct database access (`exitplane bootstrap ...`) write their events
    too, as the `local` actor or the command's own; `exitplane db upgrade` and `downgrade`
    change the schema, not the fleet, and write none."""
    path = tmp_path / "exitplane.db"
    shutil.copy(sqlite_template, path)
    env = {**os.environ, "EXITPLANE_DATABASE_URL": f"sqlite:///{path}",
           "EXITPLANE_VAR_DIR": str(tmp_path / "var")}
    password = tmp_path / "password"
    password.write_text(PASSWORD)
    for args in (["bootstrap", "token", "--name", "first", "--scope", "admin",
                  "--out", str(tmp_path / "token")],
                 ["bootstrap", "user", "--username", "root", "--role", "admin",
                  "--password-file", str(password)],
                 ["bootstrap", "deployment", "--name", "chat", "--model-ref", "tiny",
                  "--num-layers", "6", "--exit-layers", "2,4"]):
        done = subprocess.run([EXITPLANE, *args], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
    engine = make_engine(env["EXITPLANE_DATABASE_URL"])
    try:
        with Session(engine) as session:
            events = {(e.action, e.actor, e.target) for e in fleet_audit(session=session)}
    finally:
        engine.dispose()
    # every bootstrap command writes as the one actor `cli:bootstrap`
    assert ("user.create", "cli:bootstrap", "user:root") in events
    assert ("deployment.create", "cli:bootstrap", "deployment:chat") in events
    assert any(action == "token.create" and actor == "cli:bootstrap"
               for action, actor, _ in events)
