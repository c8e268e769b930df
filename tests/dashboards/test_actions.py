"""What the UI's actions do: each one goes through the deployments/auth services, asks for a
reason and leaves it in the audit log; the pages show what the services know."""

from __future__ import annotations

import re

import pytest
from sqlalchemy.orm import Session

from controlplane.deployments import service as thresholds
from tests.support.people import csrf_of

pytestmark = pytest.mark.usefixtures("seeded")


def _post(client, path: str, form: dict, page: str = "/ui/deployments/chat/versions"):
    return client.post(path, data={**form, "csrf_token": csrf_of(client.get(page).text)})


def _state(engine):
    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name="chat")
        aliases = thresholds.aliases_of(session=session, deployment=deployment)
        last = thresholds.audit_log(session=session, deployment=deployment, limit=1)[0]
    return aliases, last


def test_activate_a_candidate_writes_the_audit_log(as_role, engine):
    client = as_role("operator")
    response = _post(client, "/ui/deployments/chat/act/activate",
                     {"version": "4", "reason": "approved after review"})
    assert "Version 4 is now active." in response.text
    aliases, event = _state(engine)
    assert aliases["active"] == 4
    assert (event.action, event.alias, event.from_version, event.to_version, event.actor,
            event.reason) == ("alias.move", "active", 3, 4, "user:operator",
                              "approved after review")


def test_rollback_without_a_version_returns_to_the_previous(as_role, engine):
    response = _post(as_role("operator"), "/ui/deployments/chat/act/rollback",
                     {"reason": "quality dropped", "version": ""})
    assert "version 2 is active again" in response.text
    aliases, event = _state(engine)
    assert aliases["active"] == 2 and event.action == "alias.rollback"


def test_canary_start_promote_and_stop(as_role, engine):
    client = as_role("operator")
    started = _post(client, "/ui/deployments/chat/act/canary",
                    {"version": "4", "reason": "try v4 on 10%"})
    assert "Canary started: 10% of runtimes apply version 4." in started.text
    assert _state(engine)[0] == {"active": 3, "conservative": 1, "canary": 4}
    page = client.get("/ui/deployments/chat/act/promote")
    assert "Promote the canary: v3 → v4" in page.text
    promoted = _post(client, "/ui/deployments/chat/act/promote", {"reason": "canary clean"})
    assert "version 4 is active for every runtime" in promoted.text
    assert _state(engine)[0] == {"active": 4, "conservative": 1}
    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name="chat")
        promote, clear = thresholds.audit_log(session=session, deployment=deployment,
                                              limit=2)[::-1]
    assert (promote.action, promote.actor, promote.reason) == (
        "canary.promote", "user:operator", "canary promoted: canary clean")
    assert clear.action == "alias.clear"
    _post(client, "/ui/deployments/chat/act/canary", {"version": "2", "reason": "again"})
    stopped = _post(client, "/ui/deployments/chat/act/canary-stop", {"reason": "enough"})
    assert "Canary stopped" in stopped.text
    assert "canary" not in _state(engine)[0]


def test_an_action_without_a_reason_changes_nothing(as_role, engine):
    before = _state(engine)
    response = _post(as_role("operator"), "/ui/deployments/chat/act/activate",
                     {"version": "4", "reason": "   "})
    assert "give a reason" in response.text
    assert 'class="flash flash-error"' in response.text
    after = _state(engine)
    assert after[0] == before[0] and after[1].id == before[1].id


def test_a_service_refusal_is_shown_on_the_page(as_role, engine):
    response = _post(as_role("operator"), "/ui/deployments/chat/act/rollback",
                     {"version": "3", "reason": "oops"})
    assert "version 3 is already active" in response.text
    assert _state(engine)[0]["active"] == 3


def test_publish_a_manual_version_and_activate_it(as_role, engine):
    client = as_role("operator")
    form = client.get("/ui/deployments/chat/versions/new").text
    assert 'name="layer_3"' in form and 'value="0.9"' in form  # starts from the active set
    response = _post(client, "/ui/deployments/chat/versions",
                     {"layer_3": "0.97", "layer_6": "0.9", "layer_9": "1", "reason": "hotfix",
                      "activate": "on"})
    assert "Version 5 published and active." in response.text
    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name="chat")
        created = thresholds.get_threshold_set(session=session, deployment=deployment,
                                               version=5)
    assert created.thresholds_by_layer() == {3: 0.97, 6: 0.9, 9: 1.0}
    assert (created.author, created.reason, created.origin) == (
        "user:operator", "hotfix", "manual")
    bad = _post(client, "/ui/deployments/chat/versions",
                {"layer_3": "1.5", "layer_6": "x", "layer_9": "1", "reason": "typo"})
    assert "threshold for layer 6 must be a number" in bad.text


def test_diff_shows_thresholds_and_expected_metrics_side_by_side(as_role):
    page = as_role("viewer").get("/ui/deployments/chat/diff?a=3&b=4").text
    row = re.search(r"<th scope=\"row\">3</th><td>([^<]+)</td><td>([^<]+)</td>", page)
    assert row and row.groups() == ("0.9", "0.85")
    assert "-0.050 (exits more)" in page
    assert "risk_upper_bound" in page and "0.041" in page and "0.048" in page
    assert "exit_rate.3" in page


def test_versions_page_shows_history_with_origin_author_reason_parent(as_role):
    page = as_role("viewer").get("/ui/deployments/chat/versions").text
    for text in ("recalibrated on last hour", "candidate awaiting approval", "user:seed",
                 "origin-calibration", "origin-manual", "origin-fallback", "badge-candidate",
                 "/ui/deployments/chat/diff?a=2&amp;b=3"):
        assert text in page


def test_overview_shows_health_at_a_glance(as_role, engine):
    page = as_role("viewer").get("/ui/").text
    assert "standby (v1)" in page and "2 reporting" in page and "1 on v3" in page
    assert page.count('<svg class="spark"') == 2
    _post(as_role("operator"), "/ui/deployments/chat/act/rollback",
          {"version": "1", "reason": "engage fallback"}, page="/ui/")
    page = as_role("viewer").get("/ui/").text
    assert "fallback engaged" in page and "engaged</strong>" in page


def test_chart_data_adds_up(as_role):
    payload = as_role("viewer").get("/ui/deployments/chat/charts.json?window=15m").json()
    totals = payload["totals"]
    assert totals["tokens"] == 3 * 2 * 24  # minutes x runtimes x records
    histogram = payload["figures"]["histogram"]["data"][0]
    assert sum(histogram["y"]) == totals["tokens"]
    assert histogram["x"] == ["L3", "L6", "L9", "full (12)"]
    assert totals["mean_depth"] == pytest.approx(
        sum(int(x[1:]) * y if x.startswith("L") else 12 * y
            for x, y in zip(histogram["x"], histogram["y"], strict=True)) / totals["tokens"])
    assert totals["speedup"] == pytest.approx(12 / totals["mean_depth"])
    assert [t["name"] for t in payload["figures"]["exit_rate"]["data"]] == [
        "layer 3", "layer 6", "layer 9"]
    delta_line = payload["figures"]["disagreement"]["data"][1]
    assert delta_line["y"] == [0.05, 0.05]
    shapes = payload["figures"]["exit_rate"]["layout"]["shapes"]
    assert any("v4" not in str(s) for s in shapes)
    notes = [a["text"] for a in payload["figures"]["exit_rate"]["layout"]["annotations"]]
    assert "active → v3" in notes  # the version change inside the window


def test_plotly_is_served_from_the_package(ui):
    response = ui.get("/ui/vendor/plotly.min.js")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/javascript")
    assert b"plotly" in response.content[:2000].lower()


def test_root_sends_people_to_the_ui(ui):
    response = ui.get("/", follow_redirects=False)
    assert response.headers["location"] == "/ui/"


def test_tokens_are_shown_once_and_revocation_is_immediate(as_role, engine, client):
    admin = as_role("admin")
    created = _post(admin, "/ui/tokens", {"name": "ci", "scope": "operator"}, page="/ui/tokens")
    assert created.status_code == 201
    secret = re.search(r'id="new-secret" class="secret" readonly value="([^"]+)"',
                       created.text).group(1)
    listing = admin.get("/ui/tokens").text
    assert secret not in listing and secret[:12] in listing
    headers = {"Authorization": f"Bearer {secret}"}
    assert client.get("/v1/deployments", headers=headers).status_code == 200
    token_id = re.search(r'action="/ui/tokens/(\d+)/revoke"', listing).group(1)
    revoked = _post(admin, f"/ui/tokens/{token_id}/revoke", {}, page="/ui/tokens")
    assert "is revoked" in revoked.text
    assert client.get("/v1/deployments", headers=headers).status_code == 401
    runtime = _post(admin, "/ui/tokens", {"name": "rt", "scope": "runtime"}, page="/ui/tokens")
    assert runtime.status_code == 422 and "a runtime token needs a deployment" in runtime.text


def test_users_admin(as_role):
    admin = as_role("admin")
    created = _post(admin, "/ui/users", {"username": "Dana", "password": "short",
                                         "role": "operator"}, page="/ui/users")
    assert "at least 12 characters" in created.text
    created = _post(admin, "/ui/users", {"username": "Dana", "password": "long enough pass",
                                         "role": "operator"}, page="/ui/users")
    assert "dana&#39; created as operator" in created.text
    page = admin.get("/ui/users").text
    admin_id = re.search(r'action="/ui/users/(\d+)/role"[^>]*>\s*<input[^>]*>\s*<label[^>]*>'
                         r'Role of admin', page).group(1)
    demoted = _post(admin, f"/ui/users/{admin_id}/role", {"role": "viewer"}, page="/ui/users")
    assert "last enabled admin" in demoted.text


@pytest.mark.parametrize("path", ["/ui/login", "/ui/", "/ui/deployments/chat",
                                  "/ui/deployments/chat/versions", "/ui/tokens"])
def test_pages_load_nothing_from_elsewhere(as_role, path):
    """No CDN: every script, stylesheet and image comes from the control plane itself."""
    page = as_role("admin").get(path).text
    sources = re.findall(r'<(?:script|link|img)[^>]+(?:src|href)="([^"]+)"', page)
    assert sources, "the page loads no assets at all?"
    assert all(source.startswith("/ui/") for source in sources), sources


def test_settings_change_only_what_changed_and_are_audited(as_role, engine):
    client = as_role("operator")
    page = "/ui/deployments/chat/versions"
    saved = _post(client, "/ui/deployments/chat/settings",
                  {"delta": "0.02", "epsilon": "0.05", "policy": "approval",
                   "canary_fraction": "0.1", "fallback_mode": "never_exit",
                   "fallback_margin": "0.05"}, page)
    assert "Settings saved: delta = 0.02, policy = approval." in saved.text
    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name="chat")
        assert (deployment.delta, deployment.policy) == (0.02, "approval")
        event = thresholds.audit_log(session=session, deployment=deployment, limit=1)[0]
    assert event.action == "deployment.update" and event.actor == "user:operator"
    assert event.details["after"] == {"delta": 0.02, "policy": "approval"}
    bad = _post(client, "/ui/deployments/chat/settings", {"delta": "2"}, page)
    assert "delta: Input should be less than 1" in bad.text
