"""Alert pages: list and detail with evidence and report, acknowledge and resolve through the
alerts service; hooks with a test alert and the delivery log."""

from __future__ import annotations

import json
import re

from sqlalchemy.orm import Session

from controlplane.alerts import delivery_service, hook_service
from controlplane.alerts import service as alerts
from tests.support.people import csrf_of


def _post(client, path: str, form: dict, page: str):
    return client.post(path, data={**form, "csrf_token": csrf_of(client.get(page).text)})


def _alert(engine, alert_id: int):
    with Session(engine) as session:
        return alerts.get_alert(session=session, alert_id=alert_id)


def test_alert_is_visible_everywhere_it_matters(as_role, firing_alert):
    viewer = as_role("viewer")
    overview = viewer.get("/ui/").text
    assert "1</strong> firing" in overview and "1 alert firing" in overview
    listing = viewer.get("/ui/alerts").text
    assert f'href="/ui/alerts/{firing_alert}"' in listing and "distribution_drift" in listing
    assert f"/ui/alerts/{firing_alert}\"" not in viewer.get("/ui/alerts?status=resolved").text
    page = viewer.get(f"/ui/alerts/{firing_alert}").text
    assert "PSI 0.31" in page and "<code>reference.minutes</code>" in page
    assert "Open the Evidently report" in page
    assert 'id="ack-form"' not in page  # viewers read only
    deployment = viewer.get("/ui/deployments/chat").text
    assert "1 open alert" in deployment
    charts = viewer.get("/ui/deployments/chat/charts.json").json()
    notes = [a["text"] for a in charts["figures"]["disagreement"]["layout"]["annotations"]]
    assert "⚠ distribution_drift L6" in notes


def test_report_is_served_sandboxed(as_role, firing_alert):
    response = as_role("viewer").get(f"/ui/alerts/{firing_alert}/report")
    assert response.status_code == 200 and "Evidently report" in response.text
    assert response.headers["content-security-policy"].startswith("sandbox allow-scripts")


def test_acknowledge_then_resolve(as_role, engine, firing_alert, hook_receiver, outbox):
    from controlplane.alerts.hook_service import create_hook

    with Session(engine) as session:
        hook_id = create_hook(session=session, name="pager", kind="webhook",
                              actor="user:seed", url=hook_receiver.url).id
        session.commit()
    client = as_role("operator")
    page = f"/ui/alerts/{firing_alert}"
    acked = _post(client, f"{page}/ack", {"note": "looking"}, page)
    assert "acknowledged; it stays open" in acked.text
    alert = _alert(engine, firing_alert)
    assert (alert.status, alert.acknowledged_by, alert.resolution) == (
        "acknowledged", "user:operator", "looking")
    assert outbox == [("alerts.deliver", [firing_alert, hook_id, "acknowledged"])]
    empty = _post(client, f"{page}/resolve", {"reason": " "}, page)
    assert "give a reason" in empty.text and _alert(engine, firing_alert).status != "resolved"
    resolved = _post(client, f"{page}/resolve", {"reason": "recalibrated"}, page)
    assert f"Alert {firing_alert} resolved." in resolved.text
    alert = _alert(engine, firing_alert)
    assert (alert.status, alert.resolved_by, alert.resolution) == (
        "resolved", "user:operator", "recalibrated")
    assert outbox[-1] == ("alerts.deliver", [firing_alert, hook_id, "resolved"])
    again = _post(client, f"{page}/ack", {}, page)
    assert "already resolved" in again.text


def test_hook_created_tested_and_logged(as_role, engine, hook_receiver):
    admin = as_role("admin")
    created = _post(admin, "/ui/hooks", {"name": "receiver", "kind": "webhook",
                                         "url": hook_receiver.url, "min_severity": "info"},
                    "/ui/hooks")
    assert created.status_code == 201
    secret = re.search(r'id="new-secret" class="secret" readonly value="([^"]+)"',
                       created.text).group(1)
    listing = admin.get("/ui/hooks").text
    assert secret not in listing
    hook_id = int(re.search(r'href="/ui/hooks/(\d+)">receiver', listing).group(1))
    sent = _post(admin, f"/ui/hooks/{hook_id}/test", {}, "/ui/hooks")
    assert "Test alert delivered to &#39;receiver&#39; (HTTP 202" in sent.text
    assert len(hook_receiver.received) == 1
    delivery = hook_receiver.received[0]
    assert json.loads(delivery["body"])["alert"]["kind"] == "test"
    assert delivery["headers"]["X-Exitplane-Signature"].startswith("sha256=")
    log = admin.get(f"/ui/hooks/{hook_id}").text
    assert "delivered" in log and "HTTP 202" in log
    disabled = _post(admin, f"/ui/hooks/{hook_id}/enabled", {"enabled": "false"}, "/ui/hooks")
    assert "disabled" in disabled.text
    bad = _post(admin, "/ui/hooks", {"name": "pd", "kind": "pagerduty",
                                     "url": "https://events.pagerduty.com/v2/enqueue"},
                "/ui/hooks")
    assert bad.status_code == 422 and "routing_key" in bad.text
    bad_url = _post(admin, "/ui/hooks", {"name": "x", "kind": "slack", "url": "not a url"},
                    "/ui/hooks")
    assert bad_url.status_code == 422 and "url" in bad_url.text


def test_a_failed_test_alert_is_shown_and_logged(as_role, engine, dead_hook):
    admin = as_role("admin")
    failed = _post(admin, f"/ui/hooks/{dead_hook}/test", {}, f"/ui/hooks/{dead_hook}")
    assert "Test alert to &#39;dead end&#39; failed" in failed.text
    assert 'class="flash flash-error"' in failed.text
    with Session(engine) as session:
        hook = hook_service.get_hook(session=session, hook_id=dead_hook)
        log = delivery_service.list_deliveries(session=session, hook=hook)
    assert [(d.event, d.ok) for d in log] == [("test", False)]
    deleted = _post(admin, f"/ui/hooks/{dead_hook}/delete", {}, "/ui/hooks")
    assert "dead end&#39; and its delivery log deleted" in deleted.text


def test_a_hook_to_an_internal_address_is_refused_with_the_reason(as_role, engine):
    """the UI refuses what the API refuses (the store, cloud metadata), saying why,
    and lists created hooks with their URL masked."""
    admin = as_role("admin")
    for url in ("http://10.0.0.5:5432/", "http://169.254.169.254/latest/meta-data/"):
        refused = _post(admin, "/ui/hooks", {"name": "probe", "kind": "webhook", "url": url},
                        "/ui/hooks")
        assert refused.status_code == 422 and "EXITPLANE_HOOK_ALLOWED_HOSTS" in refused.text
    created = _post(admin, "/ui/hooks", {"name": "team", "kind": "slack",
                                         "url": "https://hooks.slack.com/services/T1/B1/k3y"},
                    "/ui/hooks")
    assert created.status_code == 201
    listing = admin.get("/ui/hooks").text
    assert "https://hooks.slack.com/…" in listing and "k3y" not in listing
    hook_id = int(re.search(r'href="/ui/hooks/(\d+)">team', listing).group(1))
    page = admin.get(f"/ui/hooks/{hook_id}").text
    assert "https://hooks.slack.com/…" in page and "k3y" not in page
