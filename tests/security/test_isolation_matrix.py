"""Who may call what, for every route the control plane serves (API under /v1, admin UI under
/ui, and the public health, metrics and docs routes).

API and UI below are the expected-access tables, keyed by "METHOD /path" exactly as the app's
route table names the routes; the first test proves the tables cover those routes exactly, so
a route added without a row here fails the suite until someone decides who may call it.

For each API route: no token, an unknown token, the right secret under another scheme, a
revoked token and a UI session cookie all get 401; every weaker scope gets 403 (runtime tokens
on operator and admin routes, operator tokens on admin routes); on the routes runtime tokens
may call, deployment beta's runtime token cannot read or write deployment alpha, nor alpha's
beta, nor a deployment that does not exist (403 alike, so a runtime token cannot learn which
deployments exist); none of those refused calls changes anything in the store. Then the
weakest rightful token gets the route's success status and the stronger ones are let in too.

For each UI route: an anonymous visitor is sent to the login page (a form without the
session's CSRF token is refused before that), an API token opens nothing, a weaker role gets
403; nothing changes in the store; the weakest rightful role gets the page or the redirect
that follows an action. Roles in the UI are not bound to a deployment, so the UI has no
deployment isolation to test.
"""

from __future__ import annotations

import re
import time
from contextlib import ExitStack
from dataclasses import dataclass, field

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.routing import Mount

from controlplane.alerts.hook_service import create_hook
from controlplane.alerts.service import Condition, fire
from controlplane.auth.service import create_token, revoke_token
from controlplane.auth.users import create_user
from controlplane.calibration.service import request_calibration
from controlplane.deployments import segments
from controlplane.deployments import service as thresholds
from controlplane.deployments.schemas import DeploymentCreate
from controlplane.flows.canary import start_canary
from controlplane.models import Base
from controlplane.runtimes.outliers import set_aside
from controlplane.runtimes.service import record_heartbeat
from exitplane.wire import Heartbeat
from tests.support.batches import telemetry_batch

pytestmark = pytest.mark.usefixtures("quick_hashing", "outbox")

PASSWORD = "correct horse battery staple"
SCOPE_RANK = {"runtime": 0, "operator": 1, "admin": 2}
ROLE_RANK = {"viewer": 0, "operator": 1, "admin": 2}
API_OK = (200, 201, 202, 204)


@dataclass(frozen=True)
class Call:
    """A concrete request for a route, aimed at deployment alpha where the route names one.
    `{name}` placeholders in the path are ids from the world (see `World.ids`); `ok` is what
    the weakest rightful caller must get (default: 2xx for the API, 200 for a UI page and 303
    after a UI form)."""

    path: str
    body: dict | None = None
    ok: tuple[int, ...] = ()
    why: str = ""


def _batch() -> dict:
    now = time.time()
    return telemetry_batch([{"threshold_version": 2, "request_id": "r1", "position": i,
                             "exit_layer": 6, "signal_value": 0.9, "latency_us": 3000,
                             "ts": now + i} for i in range(3)],
                           batch_id="matrix-batch-1", deployment="alpha", num_layers=12)


DEPLOYMENT = {"name": "gamma", "model_ref": "m", "num_layers": 12, "exit_layers": [3, 6, 9]}
REASON = {"reason": "matrix"}

# "METHOD /path" -> (weakest scope allowed, the call); "public" needs no token.
API: dict[str, tuple[str, Call]] = {
    "GET /": ("public", Call("/", ok=(307,))),
    "GET /healthz": ("public", Call("/healthz")),
    "GET /readyz": ("public", Call("/readyz")),
    "GET /metrics": ("public", Call("/metrics", why="Prometheus scrapes without a token")),
    "GET /openapi.json": ("public", Call("/openapi.json")),
    "GET /docs": ("public", Call("/docs")),
    "GET /docs/assets/{path}": ("public", Call("/docs/assets/swagger-ui-bundle.js")),
    # deployments and threshold sets
    "POST /v1/deployments": ("operator", Call("/v1/deployments", DEPLOYMENT)),
    "GET /v1/deployments": ("operator", Call("/v1/deployments")),
    "GET /v1/deployments/{name}": ("runtime", Call("/v1/deployments/alpha")),
    "PATCH /v1/deployments/{name}": ("operator", Call("/v1/deployments/alpha",
                                                      {"delta": 0.02})),
    "DELETE /v1/deployments/{name}": ("admin", Call(
        "/v1/deployments/alpha?reason=matrix&force=true",
        why="force: runtime rt-1 of alpha is live")),
    "POST /v1/deployments/{name}/threshold-sets": ("operator", Call(
        "/v1/deployments/alpha/threshold-sets",
        {"thresholds": {"3": 0.9, "6": 0.9, "9": 0.9}, "reason": "matrix"})),
    "GET /v1/deployments/{name}/threshold-sets": ("operator", Call(
        "/v1/deployments/alpha/threshold-sets")),
    "GET /v1/deployments/{name}/threshold-sets/{version}": ("operator", Call(
        "/v1/deployments/alpha/threshold-sets/2")),
    "PUT /v1/deployments/{name}/aliases/{alias}": ("operator", Call(
        "/v1/deployments/alpha/aliases/active", {"version": 1, "reason": "matrix"})),
    "DELETE /v1/deployments/{name}/aliases/{alias}": ("operator", Call(
        "/v1/deployments/alpha/aliases/canary?reason=matrix")),
    "POST /v1/deployments/{name}/rollback": ("operator", Call(
        "/v1/deployments/alpha/rollback", REASON)),
    "GET /v1/deployments/{name}/audit": ("operator", Call("/v1/deployments/alpha/audit")),
    "GET /v1/deployments/{name}/declared-segments": ("operator", Call(
        "/v1/deployments/alpha/declared-segments")),
    "PUT /v1/deployments/{name}/declared-segments/{segment}": ("operator", Call(
        "/v1/deployments/alpha/declared-segments/chat", REASON)),
    "DELETE /v1/deployments/{name}/declared-segments/{segment}": ("operator", Call(
        "/v1/deployments/alpha/declared-segments/support?reason=matrix")),
    "GET /v1/deployments/{name}/thresholds": ("runtime", Call(
        "/v1/deployments/alpha/thresholds?runtime_id=rt-1")),
    # runtimes and telemetry
    "POST /v1/deployments/{name}/heartbeats": ("runtime", Call(
        "/v1/deployments/alpha/heartbeats", {"runtime_id": "rt-1", "applied_version": 2})),
    "GET /v1/deployments/{name}/runtimes": ("operator", Call(
        "/v1/deployments/alpha/runtimes")),
    "POST /v1/deployments/{name}/runtimes/{runtime_id}/leave": ("runtime", Call(
        "/v1/deployments/alpha/runtimes/rt-1/leave",
        why="any token of the runtime's deployment may take it out, never another's")),
    "DELETE /v1/deployments/{name}/runtimes/{runtime_id}": ("operator", Call(
        "/v1/deployments/alpha/runtimes/rt-1")),
    "DELETE /v1/deployments/{name}/runtimes": ("operator", Call(
        "/v1/deployments/alpha/runtimes?token_id={runtime_token}")),
    "GET /v1/deployments/{name}/runtime-outliers": ("operator", Call(
        "/v1/deployments/alpha/runtime-outliers")),
    "POST /v1/deployments/{name}/runtime-outliers/{outlier_id}/clear": ("operator", Call(
        "/v1/deployments/alpha/runtime-outliers/{outlier}/clear", REASON)),
    "POST /v1/telemetry": ("runtime", Call("/v1/telemetry", _batch())),
    "GET /v1/deployments/{name}/telemetry/exit-rates": ("runtime", Call(
        "/v1/deployments/alpha/telemetry/exit-rates")),
    "GET /v1/deployments/{name}/telemetry/disagreement": ("runtime", Call(
        "/v1/deployments/alpha/telemetry/disagreement")),
    "GET /v1/deployments/{name}/telemetry/signal-histogram": ("runtime", Call(
        "/v1/deployments/alpha/telemetry/signal-histogram")),
    "GET /v1/deployments/{name}/telemetry/count": ("runtime", Call(
        "/v1/deployments/alpha/telemetry/count")),
    "GET /v1/deployments/{name}/segments": ("runtime", Call(
        "/v1/deployments/alpha/segments")),
    "GET /v1/deployments/{name}/savings": ("runtime", Call(
        "/v1/deployments/alpha/savings")),
    "GET /v1/savings": ("operator", Call("/v1/savings")),
    "GET /v1/audit": ("admin", Call("/v1/audit")),
    "GET /v1/deployments/{name}/operating-curve": ("operator", Call(
        "/v1/deployments/alpha/operating-curve", ok=(200, 404),
        why="404 until the workers draw a curve")),
    "GET /v1/deployments/{name}/answers": ("operator", Call(
        "/v1/deployments/alpha/answers?window=3600")),
    "POST /v1/deployments/{name}/what-if": ("operator", Call(
        "/v1/deployments/alpha/what-if", {"thresholds": {"3": 0.9, "6": 0.9, "9": 0.9}},
        ok=(200, 422), why="422 while the window holds too few shadow tokens")),
    # tokens
    "POST /v1/tokens": ("admin", Call("/v1/tokens", {"name": "ci", "scope": "operator"})),
    "GET /v1/tokens": ("admin", Call("/v1/tokens")),
    "DELETE /v1/tokens/{token_id}": ("admin", Call("/v1/tokens/{spare_token}")),
    # users of the admin UI
    "GET /v1/users": ("admin", Call("/v1/users")),
    "POST /v1/users": ("admin", Call("/v1/users", {"username": "newcomer", "role": "viewer",
                                                   "password": PASSWORD})),
    "GET /v1/users/{username}": ("admin", Call("/v1/users/spare")),
    "PATCH /v1/users/{username}": ("admin", Call("/v1/users/spare", {"role": "operator"})),
    # alerts and hooks
    "GET /v1/alerts": ("operator", Call("/v1/alerts?deployment=alpha")),
    "GET /v1/alerts/{alert_id}": ("operator", Call("/v1/alerts/{alert}")),
    "POST /v1/alerts/{alert_id}/ack": ("operator", Call("/v1/alerts/{alert}/ack",
                                                        {"note": "on it"})),
    "POST /v1/alerts/{alert_id}/resolve": ("operator", Call("/v1/alerts/{alert}/resolve",
                                                            REASON)),
    "GET /v1/alerts/{alert_id}/report": ("operator", Call("/v1/alerts/{alert}/report")),
    "GET /v1/alerts/{alert_id}/deliveries": ("operator", Call(
        "/v1/alerts/{alert}/deliveries")),
    "GET /v1/hooks": ("admin", Call("/v1/hooks")),
    "POST /v1/hooks": ("admin", Call("/v1/hooks", {"name": "pager", "kind": "slack",
                                                   "url": "https://hooks.slack.com/services/T0/B0/x"})),
    "GET /v1/hooks/{hook_id}": ("admin", Call("/v1/hooks/{hook}")),
    "PATCH /v1/hooks/{hook_id}": ("admin", Call("/v1/hooks/{hook}", {"enabled": False})),
    "DELETE /v1/hooks/{hook_id}": ("admin", Call("/v1/hooks/{hook}")),
    "POST /v1/hooks/{hook_id}/test": ("admin", Call("/v1/hooks/{hook}/test")),
    "GET /v1/hooks/{hook_id}/deliveries": ("admin", Call("/v1/hooks/{hook}/deliveries")),
    # calibration and canary
    "POST /v1/deployments/{name}/calibrations": ("operator", Call(
        "/v1/deployments/alpha/calibrations", REASON, ok=(200, 202))),
    "GET /v1/deployments/{name}/calibrations": ("operator", Call(
        "/v1/deployments/alpha/calibrations")),
    "GET /v1/deployments/{name}/calibrations/{job_id}": ("operator", Call(
        "/v1/deployments/alpha/calibrations/{job}")),
    "POST /v1/deployments/{name}/calibrations/{job_id}/approve": ("operator", Call(
        "/v1/deployments/alpha/calibrations/{job}/approve", REASON, ok=(409,),
        why="the job is still queued: reaching the handler's own check is the point")),
    "POST /v1/deployments/{name}/calibrations/{job_id}/reject": ("operator", Call(
        "/v1/deployments/alpha/calibrations/{job}/reject", REASON, ok=(409,),
        why="the job is still queued: reaching the handler's own check is the point")),
    "GET /v1/deployments/{name}/canary": ("operator", Call("/v1/deployments/alpha/canary")),
    "POST /v1/deployments/{name}/canary": ("operator", Call(
        "/v1/deployments/alpha/canary", {"version": 1, **REASON}, ok=(409,),
        why="alpha's canary of v3 is running: reaching the handler's own check is the point")),
    "POST /v1/deployments/{name}/canary/promote": ("operator", Call(
        "/v1/deployments/alpha/canary/promote", REASON)),
    "POST /v1/deployments/{name}/canary/revert": ("operator", Call(
        "/v1/deployments/alpha/canary/revert", REASON)),
}

# "METHOD /path" -> (weakest role allowed, the call); "public" needs no sign-in.
UI: dict[str, tuple[str, Call]] = {
    "GET /ui/login": ("public", Call("/ui/login")),
    "POST /ui/login": ("public", Call("/ui/login", {"username": "viewer",
                                                     "password": PASSWORD})),
    "GET /ui/login/oidc": ("public", Call(
        "/ui/login/oidc", ok=(404,),
        why="no OIDC provider is configured here: single sign-on is refused for everyone "
        "(tests/dashboards/test_sso.py signs in through one)")),
    "GET /ui/login/oidc/callback": ("public", Call(
        "/ui/login/oidc/callback?code=c&state=s", ok=(404,),
        why="no OIDC provider is configured here (tests/dashboards/test_sso.py)")),
    "GET /ui/vendor/plotly.min.js": ("public", Call("/ui/vendor/plotly.min.js")),
    "GET /ui/static/{path}": ("public", Call("/ui/static/app.css")),
    "POST /ui/logout": ("viewer", Call("/ui/logout", {})),
    "GET /ui/account": ("viewer", Call("/ui/account")),
    "POST /ui/account/password": ("viewer", Call("/ui/account/password", {
        "current": PASSWORD, "new": PASSWORD + "+", "confirm": PASSWORD + "+"})),
    "GET /ui/": ("viewer", Call("/ui/")),
    "GET /ui/deployments/{name}": ("viewer", Call("/ui/deployments/alpha")),
    "GET /ui/deployments/{name}/charts.json": ("viewer", Call(
        "/ui/deployments/alpha/charts.json")),
    "GET /ui/deployments/{name}/versions": ("viewer", Call("/ui/deployments/alpha/versions")),
    "GET /ui/deployments/{name}/what-if": ("operator", Call("/ui/deployments/alpha/what-if")),
    "GET /ui/deployments/{name}/diff": ("viewer", Call("/ui/deployments/alpha/diff?a=1&b=2")),
    "GET /ui/deployments/{name}/act/{key}": ("operator", Call(
        "/ui/deployments/alpha/act/rollback")),
    "POST /ui/deployments/{name}/act/{key}": ("operator", Call(
        "/ui/deployments/alpha/act/rollback", {"reason": "matrix"})),
    "GET /ui/deployments/{name}/versions/new": ("operator", Call(
        "/ui/deployments/alpha/versions/new")),
    "POST /ui/deployments/{name}/versions": ("operator", Call(
        "/ui/deployments/alpha/versions",
        {"layer_3": "0.9", "layer_6": "0.9", "layer_9": "0.9", "reason": "matrix"})),
    "POST /ui/deployments/{name}/settings": ("operator", Call(
        "/ui/deployments/alpha/settings", {"policy": "approval", "delta": "0.02"})),
    "GET /ui/deployments/{name}/segments": ("viewer", Call("/ui/deployments/alpha/segments")),
    "POST /ui/deployments/{name}/segments": ("operator", Call(
        "/ui/deployments/alpha/segments", {"segment": "chat", "reason": "matrix"})),
    "POST /ui/deployments/{name}/segments/{segment}/remove": ("operator", Call(
        "/ui/deployments/alpha/segments/support/remove", REASON)),
    "POST /ui/deployments/{name}/segments/auto": ("operator", Call(
        "/ui/deployments/alpha/segments/auto", {"auto_segments": "on"})),
    "POST /ui/deployments/{name}/outliers/{outlier_id}/clear": ("operator", Call(
        "/ui/deployments/alpha/outliers/{outlier}/clear", REASON)),
    "GET /ui/deployments/{name}/runtimes/{runtime_id}/remove": ("operator", Call(
        "/ui/deployments/alpha/runtimes/rt-1/remove")),
    "POST /ui/deployments/{name}/runtimes/{runtime_id}/remove": ("operator", Call(
        "/ui/deployments/alpha/runtimes/rt-1/remove", REASON)),
    "GET /ui/deployments/{name}/calibrations": ("viewer", Call(
        "/ui/deployments/alpha/calibrations")),
    "POST /ui/deployments/{name}/calibrations": ("operator", Call(
        "/ui/deployments/alpha/calibrations", {"hours": "24", "reason": "matrix"})),
    "GET /ui/deployments/{name}/calibrations/{job_id}": ("viewer", Call(
        "/ui/deployments/alpha/calibrations/{job}")),
    "POST /ui/deployments/{name}/calibrations/{job_id}/{decision}": ("operator", Call(
        "/ui/deployments/alpha/calibrations/{job}/approve", REASON)),
    "GET /ui/alerts": ("viewer", Call("/ui/alerts")),
    "GET /ui/alerts/{alert_id}": ("viewer", Call("/ui/alerts/{alert}")),
    "GET /ui/alerts/{alert_id}/report": ("viewer", Call("/ui/alerts/{alert}/report")),
    "POST /ui/alerts/{alert_id}/ack": ("operator", Call("/ui/alerts/{alert}/ack",
                                                        {"note": "on it"})),
    "POST /ui/alerts/{alert_id}/resolve": ("operator", Call("/ui/alerts/{alert}/resolve",
                                                            REASON)),
    "GET /ui/hooks": ("admin", Call("/ui/hooks")),
    "POST /ui/hooks": ("admin", Call("/ui/hooks", {"name": "pager", "kind": "slack",
                                                   "url": "https://hooks.slack.com/services/T0/B0/x"},
                                     ok=(201,), why="a webhook's secret is shown once, in place")),
    "GET /ui/hooks/{hook_id}": ("admin", Call("/ui/hooks/{hook}")),
    "POST /ui/hooks/{hook_id}/test": ("admin", Call("/ui/hooks/{hook}/test", {})),
    "POST /ui/hooks/{hook_id}/enabled": ("admin", Call("/ui/hooks/{hook}/enabled",
                                                       {"enabled": "false"})),
    "POST /ui/hooks/{hook_id}/delete": ("admin", Call("/ui/hooks/{hook}/delete", {})),
    "GET /ui/tokens": ("admin", Call("/ui/tokens")),
    "POST /ui/tokens": ("admin", Call("/ui/tokens", {"name": "ci", "scope": "operator"},
                                      ok=(201,), why="the new secret is shown once, in place")),
    "POST /ui/tokens/{token_id}/revoke": ("admin", Call("/ui/tokens/{spare_token}/revoke", {})),
    "GET /ui/users": ("admin", Call("/ui/users")),
    "GET /ui/audit": ("admin", Call("/ui/audit?actor=user:*&action=alias.*")),
    "POST /ui/users": ("admin", Call("/ui/users", {"username": "eve", "password": PASSWORD,
                                                   "role": "viewer"})),
    "POST /ui/users/{user_id}/role": ("admin", Call("/ui/users/{spare_user}/role",
                                                    {"role": "operator"})),
    "POST /ui/users/{user_id}/disabled": ("admin", Call("/ui/users/{spare_user}/disabled",
                                                        {"disabled": "true"})),
    "POST /ui/users/{user_id}/password": ("admin", Call("/ui/users/{spare_user}/password",
                                                        {"password": PASSWORD + "!"})),
}


def served_routes(app) -> set[str]:
    """Every "METHOD /path" the app answers, looking inside included routers and mounts."""
    found: set[str] = set()

    def walk(routes, prefix: str) -> None:
        for route in routes:
            inner = getattr(route, "original_router", None)
            if inner is not None:
                walk(inner.routes, prefix)
            elif isinstance(route, Mount):
                if hasattr(route.app, "routes"):
                    walk(route.app.routes, prefix + route.path)
                else:  # static files: one catch-all GET
                    found.add(f"GET {prefix}{route.path}/{{path}}")
            else:
                methods = set(route.methods or ())
                if "GET" in methods:
                    methods.discard("HEAD")  # Starlette adds HEAD to every GET route
                found.update(f"{method} {prefix}{route.path}" for method in methods)

    walk(app.routes, "")
    return found


# -- the world every check runs in ------------------------------------------------------------

@dataclass
class World:
    app: object
    ids: dict[str, int]
    secrets: dict[str, str]  # admin, operator, runtime (alpha's), runtime_beta, revoked
    ui_cookie: str  # a signed-in admin's UI session cookie
    stack: ExitStack = field(default_factory=ExitStack)
    signed_in: dict[str, TestClient] = field(default_factory=dict)

    def bearer(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secrets[who]}"}

    def path(self, call: Call) -> str:
        return call.path.format_map(self.ids)

    def browser(self) -> TestClient:
        """A fresh UI client on https (Secure cookies round-trip)."""
        return self.stack.enter_context(TestClient(self.app, base_url="https://testserver"))

    def ui(self, role: str) -> TestClient:
        """A UI client signed in as the user named after `role`."""
        if role not in self.signed_in:
            client = self.browser()
            response = sign_in(client, role)
            assert response.status_code == 200, response.text
            self.signed_in[role] = client
        return self.signed_in[role]


CSRF_FIELD = re.compile(r'name="csrf_token" value="([^"]+)"')


def csrf_of(client: TestClient, page: str) -> str:
    match = CSRF_FIELD.search(client.get(page).text)
    assert match, f"{page} has no CSRF field"
    return match.group(1)


def sign_in(client: TestClient, username: str, password: str = PASSWORD):
    token = csrf_of(client, "/ui/login")
    return client.post("/ui/login", data={"username": username, "password": password,
                                          "csrf_token": token})


@pytest.fixture
def world(app, engine, tokens, settings):
    """Deployments alpha and beta (alpha: v1 conservative, v2 active, v3 on canary), a runtime
    token for each, a revoked admin token and a spare one, a person per role and a spare, and
    on alpha a firing alert with a report, a webhook, a queued recalibration, runtime rt-1
    (registered by alpha's runtime token) set aside as an outlier, and segment support in
    use."""
    with Session(engine) as session:
        made = {}
        for name in ("alpha", "beta"):
            made[name] = thresholds.create_deployment(session=session, spec=DeploymentCreate(
                name=name, model_ref="m", num_layers=12, exit_layers=[3, 6, 9]),
                actor="user:seed")
        alpha = made["alpha"]
        for version in (2, 3):
            published = thresholds.publish(session=session, deployment=alpha,
                                           thresholds={3: 0.95, 6: 0.9, 9: 0.85 - version / 100},
                                           reason="seed", actor="user:seed")
            assert published.version == version
        thresholds.move_alias(session=session, deployment=alpha, alias="active", version=2,
                              actor="user:seed", reason="seed")
        start_canary(session=session, deployment=alpha, version=3, actor="user:seed")
        secrets = {"admin": tokens.admin, "operator": tokens.operator}
        runtime_tokens = {}
        for key, name in (("runtime", "alpha"), ("runtime_beta", "beta")):
            runtime_tokens[key], secrets[key] = create_token(
                session=session, name=f"rt-{name}", scope="runtime", deployment=made[name])
        record_heartbeat(session=session, deployment=alpha,
                         beat=Heartbeat(runtime_id="rt-1", applied_version=2),
                         token_id=runtime_tokens["runtime"].id)
        outlier, _ = set_aside(session=session, deployment=alpha, runtime_id="rt-1", version=2,
                               segment="default", summary="rt-1 differs from its fleet",
                               evidence={})
        segments.declare_segment(session=session, deployment=alpha, name="support",
                                 actor="user:seed")
        revoked, secrets["revoked"] = create_token(session=session, name="gone", scope="admin")
        revoke_token(session=session, token_id=revoked.id)
        spare_token, _ = create_token(session=session, name="spare", scope="operator")
        for role in ("viewer", "operator", "admin"):
            create_user(session=session, username=role, password=PASSWORD, role=role)
        spare_user = create_user(session=session, username="spare", password=PASSWORD,
                                 role="viewer")
        alert, _ = fire(session=session, deployment=alpha, condition=Condition(
            kind="distribution_drift", severity="warning", layer=6, subject="6",
            summary="signal distribution at layer 6 drifted",
            report_html="<html><body>report</body></html>"),
            keep_report=True)
        hook = create_hook(session=session, name="dead end", kind="webhook",
                           url="http://127.0.0.1:9/nothing", actor="user:seed",
                           deployment=alpha)
        job, _ = request_calibration(session=session, deployment=alpha, actor="user:seed",
                                     enqueue=False)
        session.commit()
        ids = {"alert": alert.id, "hook": hook.id, "job": job.id,
               "spare_token": spare_token.id, "spare_user": spare_user.id,
               "outlier": outlier.id, "runtime_token": runtime_tokens["runtime"].id}
    world = World(app=app, ids=ids, secrets=secrets, ui_cookie="")
    with world.stack:
        world.ui_cookie = world.ui("admin").cookies["exitplane_session"]
        yield world


def store_snapshot(engine) -> dict[str, list[str]]:
    """Every row of every table: a refused call must leave all of them as they were."""
    with engine.connect() as connection:
        return {table.name: sorted(repr(tuple(row)) for row in
                                   connection.execute(select(table)).all())
                for table in Base.metadata.sorted_tables}


# -- the tests --------------------------------------------------------------------------------

def test_the_tables_cover_exactly_the_routes_the_app_serves(app):
    served = served_routes(app)
    classified = set(API) | set(UI)
    assert not served - classified, (
        f"routes nobody classified (add them to API or UI here): {sorted(served - classified)}")
    assert not classified - served, f"rows for routes that are gone: {sorted(classified - served)}"
    assert all(key.split(" ", 1)[1].startswith("/ui") for key in UI)
    assert not any(key.split(" ", 1)[1].startswith("/ui") for key in API)


def _send(client: TestClient, method: str, path: str, body: dict | None,
          headers: dict[str, str]):
    if body is None:
        return client.request(method, path, headers=headers, follow_redirects=False)
    return client.request(method, path, json=body, headers=headers, follow_redirects=False)


def _swap(body: dict | None, old: str, new: str) -> dict | None:
    """The same body aimed at another deployment (the telemetry batch names its deployment)."""
    if body is None:
        return None
    return {key: (new if value == old else value) for key, value in body.items()}


@pytest.mark.parametrize("route", sorted(API))
def test_api_route(route, world, client, engine):
    who, call = API[route]
    method = route.split(" ", 1)[0]
    path = world.path(call)
    expected_ok = call.ok or API_OK
    if who == "public":
        response = _send(client, method, path, call.body, {})
        assert response.status_code in expected_ok, response.text[:300]
        return

    allowed = [scope for scope in ("runtime", "operator", "admin")
               if SCOPE_RANK[scope] >= SCOPE_RANK[who]]

    def let_in() -> dict[str, str]:
        first = _send(client, method, path, call.body, world.bearer(allowed[0]))
        assert first.status_code in expected_ok, (
            f"{allowed[0]} token on {route}: {first.status_code} {first.text[:300]}")
        for scope in allowed[1:]:
            response = _send(client, method, path, call.body, world.bearer(scope))
            assert response.status_code not in (401, 403) and response.status_code < 500, (
                f"{scope} token on {route}: {response.status_code} {response.text[:300]}")
        return {"If-None-Match": first.headers["etag"]} if "etag" in first.headers else {}

    # Reads go first so the refused calls below meet warm token and config caches (and a
    # current ETag, which must not buy a foreign token a 304).
    extra = let_in() if method == "GET" else {}
    before = store_snapshot(engine)
    refusals = [
        ("no token", path, call.body, {}, 401),
        ("an unknown token", path, call.body, {"Authorization": "Bearer ept_not-a-real-one"},
         401),
        ("the admin secret under another scheme", path, call.body,
         {"Authorization": f"Basic {world.secrets['admin']}"}, 401),
        ("a revoked admin token", path, call.body, world.bearer("revoked"), 401),
        ("an admin's UI session cookie", path, call.body,
         {"Cookie": f"exitplane_session={world.ui_cookie}"}, 401),
    ]
    for scope in ("runtime", "runtime_beta", "operator"):
        if SCOPE_RANK[scope.removesuffix("_beta")] < SCOPE_RANK[who]:
            refusals.append((f"a {scope} token", path, call.body, world.bearer(scope), 403))
    if who == "runtime":
        beta_path, nobody_path = (re.sub(r"/alpha(?=[/?]|$)", f"/{name}", path)
                                  for name in ("beta", "nobody"))
        if beta_path == path:  # the body names the deployment
            beta_path = nobody_path = path
        refusals += [
            ("beta's runtime token on alpha", path, call.body, world.bearer("runtime_beta"),
             403),
            ("alpha's runtime token on beta", beta_path, _swap(call.body, "alpha", "beta"),
             world.bearer("runtime"), 403),
            ("alpha's runtime token on a deployment that does not exist", nobody_path,
             _swap(call.body, "alpha", "nobody"), world.bearer("runtime"), 403),
        ]
    for why, target, body, headers, status in refusals:
        for attempt in range(2):  # the second call meets what the first one cached
            response = _send(client, method, target, body, {**headers, **extra})
            assert response.status_code == status, (
                f"{why} on {method} {target} (attempt {attempt + 1}): expected {status}, got "
                f"{response.status_code} {response.text[:300]}")
            assert response.json().get("detail"), "a refusal says why"
    assert store_snapshot(engine) == before, f"a refused call on {route} changed the store"
    if method != "GET":
        let_in()


@pytest.mark.parametrize("route", sorted(UI))
def test_ui_route(route, world, engine):
    who, call = UI[route]
    method = route.split(" ", 1)[0]
    path = world.path(call)
    expected_ok = call.ok or ((200,) if method == "GET" else (303,))

    def request(client: TestClient, *, csrf: str | None = None, headers=None):
        if method == "GET":
            return client.get(path, headers=headers, follow_redirects=False)
        form = dict(call.body or {})
        if csrf is not None:
            form["csrf_token"] = csrf
        return client.post(path, data=form, headers=headers, follow_redirects=False)

    if who == "public":
        anonymous = world.browser()
        token = csrf_of(anonymous, "/ui/login") if method == "POST" else None
        response = request(anonymous, csrf=token)
        assert response.status_code in expected_ok, response.text[:300]
        return

    weaker = [role for role in ("viewer", "operator") if ROLE_RANK[role] < ROLE_RANK[who]]
    signed_in = {role: world.ui(role) for role in weaker}  # signing in records the time
    before = store_snapshot(engine)
    anonymous = world.browser()
    if method == "POST":
        refused = request(anonymous)
        assert refused.status_code == 403, f"a form without CSRF token: {refused.status_code}"
        sent = request(anonymous, csrf=csrf_of(anonymous, "/ui/login"))
    else:
        sent = request(anonymous)
    assert sent.status_code == 303 and sent.headers["location"].startswith("/ui/login"), (
        f"anonymous {route}: {sent.status_code} {sent.headers.get('location')}")
    # An API token is no UI session: a page sends it to the login, a form is refused.
    with_token = request(world.browser(), headers={
        "Authorization": f"Bearer {world.secrets['admin']}"})
    if method == "GET":
        assert with_token.status_code == 303
        assert with_token.headers["location"].startswith("/ui/login")
    else:
        assert with_token.status_code == 403
    for role, client in signed_in.items():
        response = request(client, csrf=csrf_of(client, "/ui/account")
                           if method == "POST" else None)
        assert response.status_code == 403, f"{role} on {route}: {response.status_code}"
        assert f"needs the {who} role" in response.text
    assert store_snapshot(engine) == before, f"a refused call on {route} changed the store"

    allowed = [role for role in ("viewer", "operator", "admin")
               if ROLE_RANK[role] >= ROLE_RANK[who]]
    for index, role in enumerate(allowed):
        client = world.ui(role)
        response = request(client, csrf=csrf_of(client, "/ui/account")
                           if method == "POST" else None)
        if index == 0:
            assert response.status_code in expected_ok, (
                f"{role} on {route}: {response.status_code} {response.text[:300]}")
        else:
            assert response.status_code not in (401, 403) and response.status_code < 500, (
                f"{role} on {route}: {response.status_code} {response.text[:300]}")
