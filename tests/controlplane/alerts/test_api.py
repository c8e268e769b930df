"""The alerts API: list / ack / resolve for operators, hooks for admins, a test alert that
really reaches the receiver, the delivery log and the stored drift report."""

from sqlalchemy.orm import Session

from controlplane.alerts import service
from controlplane.alerts.service import Condition
from controlplane.deployments.service import get_deployment
from tests.support.alerts import make_deployment
from tests.support.waiting import patient_get


def _alert(engine, condition=None, report_html=None):
    with Session(engine) as session:
        deployment = make_deployment(session)
        alert, _ = service.fire(session=session, deployment=deployment, keep_report=True,
                                condition=condition or Condition(
                                    kind="distribution_drift", severity="warning",
                                    summary="signal drifted", report_html=report_html))
        session.commit()
        return alert.id


def test_list_ack_resolve(client, tokens, engine, outbox):
    alert_id = _alert(engine)
    op = tokens.headers(tokens.operator)
    listed = patient_get(client, "/v1/alerts", headers=op, params={"status": "open"})
    assert listed.status_code == 200
    [row] = listed.json()
    assert (row["id"], row["deployment"], row["kind"], row["status"]) == (
        alert_id, "chat", "distribution_drift", "firing")
    assert patient_get(client, "/v1/alerts", headers=op, params={"status": "resolved"}).json() == []
    assert patient_get(client, "/v1/alerts", params={"deployment": "chat"}).status_code == 401
    assert patient_get(client, "/v1/alerts", headers=op,
                       params={"status": "bogus"}).status_code == 422

    acked = client.post(f"/v1/alerts/{alert_id}/ack", headers=op, json={"note": "on it"})
    assert acked.status_code == 200
    assert acked.json()["status"] == "acknowledged"
    assert acked.json()["acknowledged_by"] == "token:test-operator"
    resolved = client.post(f"/v1/alerts/{alert_id}/resolve", headers=op,
                           json={"reason": "thresholds recalibrated"})
    assert resolved.status_code == 200 and resolved.json()["status"] == "resolved"
    assert resolved.json()["resolution"] == "thresholds recalibrated"
    again = client.post(f"/v1/alerts/{alert_id}/resolve", headers=op, json={"reason": "x"})
    assert again.status_code == 409 and "already resolved" in again.json()["detail"]
    assert client.post(f"/v1/alerts/{alert_id}/resolve", headers=op,
                       json={}).status_code == 422
    assert patient_get(client, "/v1/alerts/999", headers=op).status_code == 404


def test_hooks_are_admin_only_and_hide_secrets(client, tokens, engine):
    _alert(engine)
    admin, op = tokens.headers(tokens.admin), tokens.headers(tokens.operator)
    spec = {"name": "ops", "kind": "webhook", "url": "http://127.0.0.1:9/hook",
            "deployment": "chat", "min_severity": "critical"}
    assert client.post("/v1/hooks", headers=op, json=spec).status_code == 403
    created = client.post("/v1/hooks", headers=admin, json=spec)
    assert created.status_code == 201, created.text
    body = created.json()
    assert body["deployment"] == "chat" and body["has_secret"] and len(body["secret"]) >= 32
    hook_id = body["id"]
    shown = client.get(f"/v1/hooks/{hook_id}", headers=admin).json()
    assert "secret" not in shown and shown["min_severity"] == "critical"
    pd = client.post("/v1/hooks", headers=admin, json={**spec, "kind": "pagerduty"})
    assert pd.status_code == 422 and "routing_key" in pd.json()["detail"]
    bad = client.post("/v1/hooks", headers=admin, json={**spec, "url": "not a url"})
    assert bad.status_code == 422
    patched = client.patch(f"/v1/hooks/{hook_id}", headers=admin,
                           json={"enabled": False, "min_severity": "info"})
    assert patched.json()["enabled"] is False and patched.json()["min_severity"] == "info"
    assert [h["id"] for h in client.get("/v1/hooks", headers=admin).json()] == [hook_id]
    assert client.delete(f"/v1/hooks/{hook_id}", headers=admin).status_code == 204
    assert client.get(f"/v1/hooks/{hook_id}", headers=admin).status_code == 404


def test_send_test_alert_reaches_the_receiver_and_is_logged(client, tokens, engine, receiver):
    admin = tokens.headers(tokens.admin)
    with Session(engine) as session:
        make_deployment(session)
        session.commit()
    hook_id = client.post("/v1/hooks", headers=admin, json={
        "name": "slack", "kind": "slack", "url": receiver.url + "/slack"}).json()["id"]
    sent = client.post(f"/v1/hooks/{hook_id}/test", headers=admin)
    assert sent.status_code == 200
    assert (sent.json()["event"], sent.json()["ok"], sent.json()["status_code"]) == (
        "test", True, 200)
    [request] = receiver.requests
    assert request.json()["text"].startswith(":test_tube: [TEST] all: test")
    receiver.statuses.append(500)
    failed = client.post(f"/v1/hooks/{hook_id}/test", headers=admin).json()
    assert (failed["ok"], failed["status_code"]) == (False, 500)
    log = patient_get(client, f"/v1/hooks/{hook_id}/deliveries", headers=admin).json()
    assert [(d["event"], d["status_code"]) for d in log] == [("test", 500), ("test", 200)]


def test_the_drift_report_is_served_from_the_alert(client, tokens, engine, settings, outbox):
    alert_id = _alert(engine, report_html="<html><body>drift report</body></html>")
    op = tokens.headers(tokens.operator)
    shown = patient_get(client, f"/v1/alerts/{alert_id}", headers=op).json()
    assert shown["report_url"] == f"http://127.0.0.1:8000/v1/alerts/{alert_id}/report"
    report = patient_get(client, f"/v1/alerts/{alert_id}/report", headers=op)
    assert report.status_code == 200 and "drift report" in report.text
    assert report.headers["content-type"].startswith("text/html")
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        other, _ = service.fire(session=session, deployment=deployment, condition=Condition(
            kind="runtime_stale", severity="warning", subject="rt-1", summary="silent"))
        session.commit()
        other_id = other.id
    missing = patient_get(client, f"/v1/alerts/{other_id}/report", headers=op)
    assert missing.status_code == 404 and "has no report" in missing.json()["detail"]
