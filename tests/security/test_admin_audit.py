"""Every administrative action leaves a trace: tokens created and revoked, alert hooks created,
changed and deleted, alerts acknowledged and resolved, users created, re-roled and disabled
are audit events with their actor (readable by admins at GET /v1/audit and with `exitplane
audit`), and every audit event, a deployment's too, is a line of the `exitplane.audit` log."""

from __future__ import annotations

import logging

from click.testing import CliRunner
from sqlalchemy.orm import Session

from controlplane.alerts import service
from controlplane.alerts.service import Condition
from controlplane.auth import users
from controlplane.auth.audit import admin_events
from exitplane.cli import main
from tests.support.alerts import make_deployment


def _alert(engine) -> int:
    with Session(engine) as session:
        deployment = make_deployment(session)
        alert, _ = service.fire(session=session, deployment=deployment, condition=Condition(
            kind="distribution_drift", severity="warning", summary="signal drifted"))
        session.commit()
        return alert.id


def test_admin_actions_over_the_api_are_audited_and_logged(client, tokens, engine, outbox,
                                                           caplog):
    alert_id = _alert(engine)
    admin, op = tokens.headers(tokens.admin), tokens.headers(tokens.operator)
    caplog.set_level(logging.INFO, logger="exitplane.audit")
    made = client.post("/v1/tokens", headers=admin,
                       json={"name": "ci", "scope": "runtime", "deployment": "chat"}).json()
    assert client.delete(f"/v1/tokens/{made['id']}", headers=admin).status_code == 200
    hook = client.post("/v1/hooks", headers=admin, json={
        "name": "ops", "kind": "webhook", "url": "http://127.0.0.1:9/hook",
        "min_severity": "critical"}).json()
    assert client.patch(f"/v1/hooks/{hook['id']}", headers=admin,
                        json={"url": "http://127.0.0.1:9/other", "enabled": False}
                        ).status_code == 200
    assert client.delete(f"/v1/hooks/{hook['id']}", headers=admin).status_code == 204
    assert client.post(f"/v1/alerts/{alert_id}/ack", headers=op,
                       json={"note": "on it"}).status_code == 200
    assert client.post(f"/v1/alerts/{alert_id}/resolve", headers=op,
                       json={"reason": "recalibrated"}).status_code == 200

    listed = client.get("/v1/audit", headers=admin)
    assert listed.status_code == 200
    mine = [(e["actor"], e["action"], e["target"]) for e in listed.json()
            if e["actor"] != "local"][::-1]  # oldest first; the fixture's tokens are local
    assert mine == [
        ("token:test-admin", "token.create", f"token:{made['id']}"),
        ("token:test-admin", "token.revoke", f"token:{made['id']}"),
        ("token:test-admin", "hook.create", f"hook:{hook['id']}"),
        ("token:test-admin", "hook.update", f"hook:{hook['id']}"),
        ("token:test-admin", "hook.delete", f"hook:{hook['id']}"),
        ("token:test-operator", "alert.acknowledge", f"alert:{alert_id}"),
        ("token:test-operator", "alert.resolve", f"alert:{alert_id}"),
    ]
    update = next(e for e in listed.json() if e["action"] == "hook.update")
    assert update["details"] == {"url": "(changed)", "enabled": False}  # no URL in the log
    resolved = next(e for e in listed.json() if e["action"] == "alert.resolve")
    assert resolved["reason"] == "recalibrated"
    assert client.get("/v1/audit", headers=admin,
                      params={"action": "token.revoke"}).json()[0]["target"] == \
        f"token:{made['id']}"
    assert client.get("/v1/audit", headers=op).status_code == 403
    assert client.get("/v1/audit", headers=admin, params={"limit": 501}).status_code == 422
    lines = [record.getMessage() for record in caplog.records
             if record.name == "exitplane.audit"]
    assert any(line.startswith("audit: token:test-admin token.revoke token:") for line in lines)
    assert any("alert.resolve" in line and line.endswith(": recalibrated") for line in lines)


def test_user_changes_are_audited_with_their_actor(engine):
    with Session(engine) as session:
        user = users.create_user(session=session, username="Alice", role="viewer",
                                 password_hash="x", actor="user:root")
        users.set_role(session=session, user=user, role="operator", actor="user:root")
        users.set_role(session=session, user=user, role="operator", actor="user:root")  # no-op
        users.set_disabled(session=session, user=user, disabled=True, actor="user:root")
        session.commit()
        events = [(e.actor, e.action, e.target, e.details)
                  for e in admin_events(session=session)][::-1]
    assert events == [("user:root", "user.create", "user:alice", {"role": "viewer"}),
                      ("user:root", "user.role", "user:alice",
                       {"from": "viewer", "to": "operator"}),
                      ("user:root", "user.disable", "user:alice", {})]


def test_a_deployment_change_is_logged_and_the_cli_reads_the_admin_log(
        client, tokens, live_server, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="exitplane.audit")
    admin = tokens.headers(tokens.admin)
    assert client.post("/v1/deployments", headers=admin, json={
        "name": "chat", "model_ref": "tiny", "num_layers": 12, "exit_layers": [3, 6, 9]}
    ).status_code == 201
    assert any(record.getMessage().startswith("audit: token:test-admin ")
               and "deployment:chat" in record.getMessage() for record in caplog.records
               if record.name == "exitplane.audit")
    client.post("/v1/tokens", headers=admin, json={"name": "ops2", "scope": "operator"})
    token_file = tmp_path / "token"
    token_file.write_text(tokens.admin)
    run = CliRunner().invoke(main, ["audit", "--action", "token.create", "--url",
                                    live_server.url, "--token-file", str(token_file)])
    assert run.exit_code == 0, run.output
    assert "token.create" in run.stdout and "token:test-admin" in run.stdout
