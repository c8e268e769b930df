"""Hook payloads against a real HTTP receiver on loopback (exact JSON, HMAC signature,
PagerDuty Events v2, Slack), the delivery log across receiver errors, and a real Alertmanager."""

import hashlib
import hmac
import json
import shutil
import subprocess
import time

import httpx
import pytest
from sqlalchemy.orm import Session

from controlplane.alerts import delivery_service, hook_service, hooks, service
from controlplane.alerts.service import Condition
from controlplane.db import utcnow
from tests.support.alerts import make_deployment
from tests.support.network import free_port

BASE = "http://exitplane.test:8000"
QUALITY = Condition(kind="quality_regression", severity="critical",
                    summary="disagreement 5.00% exceeds δ=0.02",
                    evidence={"test": "binomial_one_sided", "p_value": 1e-6})


def _fire(session, condition=QUALITY):
    deployment = make_deployment(session)
    alert, _ = service.fire(session=session, deployment=deployment, condition=condition)
    alert.action_taken = "conservative set activated"
    return deployment, alert


def _deliver(session, alert, hook, event):
    return delivery_service.deliver(session=session, alert_id=alert.id, hook_id=hook.id,
                                    event=event, base_url=BASE, timeout_s=5)


def test_webhook_is_signed_json_with_a_timestamp(session: Session, receiver, outbox):
    _, alert = _fire(session)
    hook = hook_service.create_hook(session=session, name="ops", kind="webhook",
                                    url=receiver.url + "/hook", actor="test",
                                    secret="s3cret-s3cret-s3cret")
    before = int(time.time())
    delivery = _deliver(session, alert, hook, "firing")
    assert delivery.ok and delivery.status_code == 200 and delivery.attempt == 1
    [request] = receiver.requests
    assert request.path == "/hook"
    timestamp = request.headers["X-Exitplane-Timestamp"]
    assert before <= int(timestamp) <= int(time.time())
    expected = hmac.new(b"s3cret-s3cret-s3cret", timestamp.encode() + b"." + request.body,
                        hashlib.sha256).hexdigest()
    assert request.headers["X-Exitplane-Signature"] == f"sha256={expected}"
    assert request.headers["X-Exitplane-Event"] == "firing"
    assert request.headers["Content-Type"] == "application/json"
    assert hooks.verify_signature(secret="s3cret-s3cret-s3cret", timestamp=timestamp,
                                  body=request.body,
                                  signature=request.headers["X-Exitplane-Signature"])
    assert not hooks.verify_signature(secret="wrong-wrong-wrong", timestamp=timestamp,
                                      body=request.body,
                                      signature=request.headers["X-Exitplane-Signature"])
    body = request.json()
    assert set(body) == {"version", "event", "sent_at", "alert"}
    assert (body["version"], body["event"]) == ("1", "firing")
    assert body["alert"] == {
        "id": alert.id, "deployment": "chat", "kind": "quality_regression", "layer": None,
        "severity": "critical", "status": "firing", "dedup_key": "chat:quality_regression:all",
        "summary": "disagreement 5.00% exceeds δ=0.02",
        "evidence": {"test": "binomial_one_sided", "p_value": 1e-6},
        "action_taken": "conservative set activated",
        "fired_at": alert.fired_at.isoformat().replace("+00:00", "Z"),
        "acknowledged_at": None, "acknowledged_by": None, "resolved_at": None,
        "resolved_by": None, "resolution": "", "url": f"{BASE}/ui/alerts/{alert.id}",
        "report_url": None}
    # Delivered once: the task's re-run is a no-op.
    assert _deliver(session, alert, hook, "firing") is None
    assert len(receiver.requests) == 1


def test_pagerduty_trigger_acknowledge_resolve(session: Session, receiver, outbox):
    _, alert = _fire(session)
    hook = hook_service.create_hook(session=session, name="pd", kind="pagerduty",
                                    url=receiver.url + "/v2/enqueue", routing_key="R0UT1NG",
                                    actor="test", min_severity="critical")
    _deliver(session, alert, hook, "firing")
    service.acknowledge(session=session, alert=alert, actor="token:ops")
    _deliver(session, alert, hook, "acknowledged")
    service.resolve(session=session, alert=alert, actor="token:ops", reason="fixed")
    _deliver(session, alert, hook, "resolved")
    trigger, ack, resolve = (r.json() for r in receiver.requests)
    assert [r.path for r in receiver.requests] == ["/v2/enqueue"] * 3
    assert trigger == {
        "routing_key": "R0UT1NG", "event_action": "trigger",
        "dedup_key": "chat:quality_regression:all",
        "payload": {"summary": "disagreement 5.00% exceeds δ=0.02", "source": "exitplane/chat",
                    "severity": "critical",
                    "timestamp": alert.fired_at.isoformat().replace("+00:00", "Z"),
                    "component": "chat", "group": "all layers", "class": "quality_regression",
                    "custom_details": {"action_taken": "conservative set activated",
                                       "evidence": {"test": "binomial_one_sided",
                                                    "p_value": 1e-6}}},
        "client": "exitplane", "client_url": f"{BASE}/ui/alerts/{alert.id}",
        "links": [{"href": f"{BASE}/ui/alerts/{alert.id}", "text": "alert in exitplane"}]}
    assert ack == {"routing_key": "R0UT1NG", "event_action": "acknowledge",
                   "dedup_key": "chat:quality_regression:all"}
    assert resolve == {"routing_key": "R0UT1NG", "event_action": "resolve",
                       "dedup_key": "chat:quality_regression:all"}


@pytest.mark.parametrize(("severity", "expected"), [("critical", "critical"),
                                                    ("warning", "warning"), ("info", "info")])
def test_pagerduty_severity_mapping(severity, expected):
    class Hook:
        kind, routing_key, url = "pagerduty", "rk", "http://127.0.0.1:9/"

    alert = {"id": 1, "deployment": "chat", "kind": "runtime_stale", "layer": None,
             "severity": severity, "summary": "s", "fired_at": "2026-01-01T00:00:00Z",
             "action_taken": "", "evidence": {}, "url": "u", "report_url": None,
             "dedup_key": "k"}
    body = json.loads(hooks.build_request(hook=Hook, alert=alert, event="firing").body)
    assert body["payload"]["severity"] == expected


def test_slack_message(session: Session, receiver, outbox):
    _, alert = _fire(session, Condition(
        kind="exit_rate_collapse", severity="warning", subject="8", layer=8,
        summary="exit rate at layer 8 fell from 40.0% to 10.0%"))
    hook = hook_service.create_hook(session=session, name="slack", kind="slack",
                                    url=receiver.url + "/services/T/B/X", actor="test")
    _deliver(session, alert, hook, "firing")
    service.resolve(session=session, alert=alert, actor="token:ops", reason="recalibrated")
    _deliver(session, alert, hook, "resolved")
    firing, resolved = (r.json() for r in receiver.requests)
    title = ":rotating_light: [FIRING] chat: exit_rate_collapse at layer 8"
    assert firing == {
        "text": f"{title}: exit rate at layer 8 fell from 40.0% to 10.0%",
        "blocks": [
            {"type": "section", "text": {"type": "mrkdwn", "text": "\n".join([
                f"*{title}*", "exit rate at layer 8 fell from 40.0% to 10.0%",
                "severity: *warning*", "action taken: conservative set activated"])}},
            {"type": "context", "elements": [
                {"type": "mrkdwn", "text": f"<{BASE}/ui/alerts/{alert.id}|open in exitplane>"}]}]}
    assert resolved["text"].startswith(":white_check_mark: [RESOLVED] chat: exit_rate_collapse")
    assert "resolved by token:ops: recalibrated" in resolved["blocks"][0]["text"]["text"]


def test_receiver_errors_are_logged_per_attempt_until_it_succeeds(session: Session, receiver,
                                                                   outbox):
    _, alert = _fire(session)
    hook = hook_service.create_hook(session=session, name="ops", kind="webhook", url=receiver.url,
                                    actor="test")
    receiver.statuses.extend([500, 503])
    first = _deliver(session, alert, hook, "firing")
    second = _deliver(session, alert, hook, "firing")
    third = _deliver(session, alert, hook, "firing")
    assert [(d.attempt, d.ok, d.status_code) for d in (first, second, third)] == [
        (1, False, 500), (2, False, 503), (3, True, 200)]
    assert first.error == "HTTP 500"  # a status code, never the receiver's answer
    assert delivery_service.is_retryable(first) and not delivery_service.is_retryable(third)
    assert _deliver(session, alert, hook, "firing") is None
    log = delivery_service.list_deliveries(session=session, hook=hook)
    assert [(d.attempt, d.status_code) for d in log] == [(3, 200), (2, 503), (1, 500)]
    # A 4xx is the hook's configuration, not a hiccup: no retry.
    receiver.statuses.append(404)
    gone = _deliver(session, alert, hook, "acknowledged")
    assert gone.status_code == 404 and not delivery_service.is_retryable(gone)
    # Nobody listening: a network error, retryable.
    hook_service.update_hook(session=session, hook=hook,
                             changes={"url": f"http://127.0.0.1:{free_port()}/"})
    down = _deliver(session, alert, hook, "resolved")
    assert down.status_code is None and down.error == hooks.NO_ANSWER
    assert delivery_service.is_retryable(down)


@pytest.fixture
def alertmanager(tmp_path):
    binary = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    if binary is None:
        raise RuntimeError("install Debian's prometheus-alertmanager (apt-get install -y "
                           "prometheus-alertmanager) to run the Alertmanager hook test")
    config = tmp_path / "alertmanager.yml"
    config.write_text("route:\n  receiver: sink\n  group_wait: 1s\nreceivers:\n  - name: sink\n")
    port = free_port()
    process = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.path={tmp_path / 'am'}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=",
         "--log.level=warn"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"alertmanager did not start: {process.stderr.read().decode()}")
        time.sleep(0.1)
    yield url
    process.terminate()
    process.wait(timeout=10)


def _am_alerts(url: str) -> list[dict]:
    return httpx.get(url + "/api/v2/alerts", timeout=5).json()


@pytest.mark.slow  # a real Alertmanager process
def test_alertmanager_shows_the_alert_firing_then_resolved(session: Session, alertmanager,
                                                           outbox):
    _, alert = _fire(session, Condition(
        kind="exit_rate_spike", severity="critical", subject="12", layer=12,
        summary="exit rate at layer 12 rose from 30.0% to 60.0%"))
    hook = hook_service.create_hook(session=session, name="am", kind="alertmanager",
                                    url=alertmanager, actor="test")
    assert _deliver(session, alert, hook, "firing").status_code == 200
    [shown] = _am_alerts(alertmanager)
    assert shown["labels"] == {"alertname": "exit_rate_spike", "deployment": "chat",
                               "layer": "12", "severity": "critical", "source": "exitplane"}
    assert shown["annotations"]["summary"] == "exit rate at layer 12 rose from 30.0% to 60.0%"
    assert shown["annotations"]["action_taken"] == "conservative set activated"
    assert shown["status"]["state"] == "active"
    assert shown["generatorURL"] == f"{BASE}/ui/alerts/{alert.id}"

    service.resolve(session=session, alert=alert, actor="token:ops", reason="recalibrated")
    assert _deliver(session, alert, hook, "resolved").status_code == 200
    # endsAt = the resolution time, now past: Alertmanager treats it as resolved and drops it
    # from its list of alerts.
    assert _am_alerts(alertmanager) == []


@pytest.mark.slow  # a real Alertmanager process
def test_alertmanager_alerts_are_refreshed_before_their_endsat_lapses(session: Session,
                                                                       receiver, outbox):
    deployment, alert = _fire(session)
    am = hook_service.create_hook(session=session, name="am", kind="alertmanager", url=receiver.url,
                                  actor="test")
    hook_service.create_hook(session=session, name="slack", kind="slack", url=receiver.url,
                             actor="test")
    sent = _deliver(session, alert, am, "firing")
    assert sent.ok
    first = json.loads(receiver.requests[0].body)[0]
    assert receiver.requests[0].path == "/api/v2/alerts"
    assert first["endsAt"] > first["startsAt"]  # held open, not resolved
    session.commit()
    outbox.clear()
    # Still observed half an hour after it was sent: only the Alertmanager hook is refreshed.
    sent.created_at = utcnow() - hooks.ALERTMANAGER_HOLD / 2
    service.reconcile(session=session, deployment=deployment, conditions=[QUALITY],
                      checked_kinds=["quality_regression"], clear_after_s=60)
    session.commit()
    assert [args for name, args in outbox if name == "alerts.deliver"] == [
        [alert.id, am.id, "refresh"]]
    refreshed = _deliver(session, alert, am, "refresh")
    assert refreshed.ok and json.loads(receiver.requests[-1].body)[0]["startsAt"] == \
        first["startsAt"]
    # Just refreshed: a duplicate refresh task is a no-op.
    assert _deliver(session, alert, am, "refresh") is None
