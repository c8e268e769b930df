"""Every administrative action leaves a trace: tokens created and revoked, alert hooks created,
changed and deleted, alerts acknowledged and resolved, users created, re-roled and disabled
are audit events with their actor. The fleet-wide log (GET /v1/audit, `exitplane audit`)
lists them with every deployment's events, newest first, filtered and paged by cursor; every
audit event is one line of the `exitplane.audit` log, written when its transaction commits."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime, timedelta

from click.testing import CliRunner
from sqlalchemy.orm import Session

from controlplane.alerts import service
from controlplane.alerts.service import Condition
from controlplane.auth import users
from controlplane.auth.audit import admin_events, record_admin_event
from controlplane.deployments import service as thresholds
from controlplane.deployments.audit import AuditFilter, fleet_audit
from controlplane.deployments.schemas import DeploymentCreate
from exitplane.cli import main
from exitplane.kit.logs import make_formatter
from tests.support.alerts import make_deployment
from tests.support.calibration import fire_alert


def _alert(engine) -> int:
    with Session(engine) as session:
        deployment = make_deployment(session)
        alert, _ = service.fire(session=session, deployment=deployment, condition=Condition(
            kind="distribution_drift", severity="warning", summary="signal drifted"))
        session.commit()
        return alert.id


def _audit_lines(caplog) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name == "exitplane.audit"]


def test_admin_actions_over_the_api_are_audited_and_logged(client, tokens, engine, outbox,
                                                           caplog):
    alert_id = _alert(engine)
    admin, op = tokens.headers(tokens.admin), tokens.headers(tokens.operator)
    caplog.set_level(logging.INFO, logger="exitplane.audit")
    made = client.post("/v1/tokens", headers=admin,
                       json={"name": "ci", "scope": "runtime", "deployment": "chat",
                             "reason": "ci pipeline"}).json()
    assert client.delete(f"/v1/tokens/{made['id']}", headers=admin,
                         params={"reason": "leaked in a log"}).status_code == 200
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
            if e["source"] == "admin" and e["actor"] != "local"][::-1]  # oldest first
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
    assert resolved["object"] == {"kind": "alert", "id": str(alert_id)}
    assert resolved["deployment"] == "chat"
    assert resolved["at"] == resolved["created_at"]
    assert update["reason"] is None and update["deployment"] is None  # none given
    reasons = {e["action"]: e["reason"] for e in listed.json()[::-1]  # the newest of each
               if e["source"] == "admin"}
    assert reasons["token.create"] == "ci pipeline"
    assert reasons["token.revoke"] == "leaked in a log"
    assert client.delete("/v1/tokens/999999", headers=admin,
                         params={"reason": "x" * 2001}).status_code == 422
    assert client.get("/v1/audit", headers=admin,
                      params={"action": "token.revoke"}).json()[0]["target"] == \
        f"token:{made['id']}"
    assert client.get("/v1/audit", headers=op).status_code == 403
    assert client.get("/v1/audit", headers=admin, params={"limit": 501}).status_code == 422
    lines = [record.getMessage() for record in _audit_lines(caplog)]
    assert any(line.startswith("audit: token:test-admin token.revoke token:")
               and line.endswith(": leaked in a log") for line in lines)
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


def _fleet(engine) -> None:
    """Two deployments' changes and administrative actions, interleaved."""
    with Session(engine) as session:
        for name in ("chat", "code"):
            deployment = thresholds.create_deployment(session=session, spec=DeploymentCreate(
                name=name, model_ref="m", num_layers=12, exit_layers=[3, 6, 9]),
                actor="user:ann")
            session.commit()
            published = thresholds.publish(session=session, deployment=deployment,
                                           thresholds={3: 0.95, 6: 0.9, 9: 0.8},
                                           reason="tighter", actor="user:bob")
            record_admin_event(session=session, actor="user:ann", action="hook.create",
                               target=f"hook:{name}", deployment=name)
            session.commit()
            thresholds.move_alias(session=session, deployment=deployment, alias="active",
                                  version=published.version, actor="system:fallback",
                                  reason="quality at risk")
            record_admin_event(session=session, actor="user:root", action="token.create",
                               target=f"token:{name}")
            session.commit()


def test_the_fleet_log_merges_both_kinds_newest_first_and_pages_by_cursor(engine):
    _fleet(engine)
    with Session(engine) as session:
        everything = fleet_audit(session=session, limit=500)
        assert {e.source for e in everything} == {"deployment", "admin"}
        assert [e.at for e in everything] == sorted((e.at for e in everything), reverse=True)
        assert len(everything) == 16  # 8 a deployment: its creation made 4
        paged, cursor = [], None
        while True:
            page = fleet_audit(session=session, limit=3, cursor=cursor)
            if not page:
                break
            paged.extend(page)
            cursor = page[-1].cursor
        assert [(e.source, e.id) for e in paged] == [(e.source, e.id) for e in everything]

        def actions(**rules) -> list[str]:
            return [e.action for e in fleet_audit(session=session, rules=AuditFilter(**rules))]

        assert actions(deployment="chat") == [
            "alias.move", "hook.create", "threshold_set.publish", "alias.move", "alias.move",
            "threshold_set.publish", "deployment.create"]
        assert actions(actor="system:*") == ["alias.move", "alias.move"]
        assert actions(action="token.*") == ["token.create", "token.create"]
        assert actions(object_kind="alias", deployment="code") == ["alias.move"] * 3
        assert actions(object_kind="threshold_set", actor="user:bob") == [
            "threshold_set.publish"] * 2
        assert actions(object_kind="token") == ["token.create", "token.create"]
        middle = everything[4].at
        assert actions(until=middle) == [e.action for e in everything if e.at < middle]
        assert actions(since=middle) == [e.action for e in everything if e.at >= middle]
        moved = fleet_audit(session=session, rules=AuditFilter(action="alias.move",
                                                               deployment="code"))[0]
        assert (moved.object_kind, moved.object_id, moved.reason) == (
            "alias", "code/active", "quality at risk")
        assert moved.details == {"alias": "active", "from_version": 1, "to_version": 2}


def test_the_fleet_log_refuses_bad_queries(client, tokens):
    admin = tokens.headers(tokens.admin)
    for params, says in (({"cursor": "not-a-cursor"}, "cursor"),
                         ({"since": "2026-01-02T00:00:00Z", "until": "2026-01-01T00:00:00Z"},
                          "since"),
                         ({"object_kind": "Token;"}, "object_kind"),
                         ({"deployment": "../x"}, "deployment"),
                         ({"since": "yesterday"}, "since")):
        answer = client.get("/v1/audit", headers=admin, params=params)
        assert answer.status_code == 422, (params, answer.text)
        assert says in answer.text
    now = datetime.now(UTC)
    window = {"since": (now - timedelta(hours=1)).isoformat(), "until": now.isoformat()}
    assert client.get("/v1/audit", headers=admin, params=window).status_code == 200


def test_audit_lines_are_written_on_commit_only(engine, caplog):
    caplog.set_level(logging.INFO, logger="exitplane.audit")
    with Session(engine) as session:
        record_admin_event(session=session, actor="user:ann", action="token.create",
                           target="token:dropped")
        session.flush()
        assert not _audit_lines(caplog)  # stored in the transaction, not yet committed
        session.rollback()
        assert not _audit_lines(caplog)
        with session.begin_nested():
            record_admin_event(session=session, actor="user:ann", action="token.create",
                               target="token:kept", reason="ci", deployment="chat")
        savepoint = session.begin_nested()
        record_admin_event(session=session, actor="user:ann", action="token.create",
                           target="token:undone")
        session.flush()
        savepoint.rollback()
        assert not _audit_lines(caplog)
        session.commit()
    records = _audit_lines(caplog)
    assert [r.getMessage() for r in records] == ["audit: user:ann token.create token:kept: ci"]
    shipped = json.loads(make_formatter("json").format(records[0]))
    assert shipped["logger"] == "exitplane.audit"
    line = shipped["audit"]
    assert {key: line[key] for key in ("actor", "action", "object", "deployment", "reason",
                                       "details")} == {
        "actor": "user:ann", "action": "token.create", "object": {"kind": "token", "id": "kept"},
        "deployment": "chat", "reason": "ci", "details": {}}
    assert datetime.fromisoformat(line["at"]).tzinfo is not None


def test_the_cli_filters_and_follows_pages(client, tokens, engine, live_server, tmp_path):
    _fleet(engine)
    token_file = tmp_path / "token"
    token_file.write_text(tokens.admin)
    connection = ["--url", live_server.url, "--token-file", str(token_file)]
    run = CliRunner().invoke(main, ["audit", "--deployment", "chat", "--since", "1h",
                                    "--page-size", "2", "-o", "json", *connection])
    assert run.exit_code == 0, run.output
    listed = json.loads(run.stdout)
    assert [e["action"] for e in listed] == [
        "alias.move", "hook.create", "threshold_set.publish", "alias.move", "alias.move",
        "threshold_set.publish", "deployment.create"]
    run = CliRunner().invoke(main, ["audit", "--actor", "system:fallback", "--limit", "1",
                                    *connection])
    assert run.exit_code == 0, run.output
    assert "alias.move" in run.stdout and "system:fallback" in run.stdout
    assert "quality at risk" in run.stdout
    run = CliRunner().invoke(main, ["audit", "--since", "last week", *connection])
    assert run.exit_code == 2
    assert "--since" in run.stderr and "neither an ISO time" in run.stderr


def test_the_cli_gives_reasons_for_token_and_hook_changes(client, tokens, engine, live_server,
                                                         tmp_path):
    with Session(engine) as session:
        make_deployment(session)
        session.commit()
    token_file = tmp_path / "token"
    token_file.write_text(tokens.admin)
    connection = ["--url", live_server.url, "--token-file", str(token_file), "-o", "json"]

    def cli(*args: str) -> dict:
        run = CliRunner().invoke(main, [*args, *connection])
        assert run.exit_code == 0, run.output
        return json.loads(run.stdout)

    made = cli("tokens", "create", "--name", "edge", "--scope", "runtime", "--deployment",
               "chat", "--reason", "new edge site")
    cli("tokens", "revoke", str(made["id"]), "--reason", "site closed")
    hook = cli("hooks", "create", "--name", "pager", "--kind", "webhook", "--endpoint",
               "http://127.0.0.1:9/hook", "--reason", "on-call rota")
    cli("hooks", "update", str(hook["id"]), "--disable", "--reason", "maintenance")
    cli("hooks", "delete", str(hook["id"]), "--yes", "--reason", "rota moved")
    events = client.get("/v1/audit", headers=tokens.headers(tokens.admin)).json()
    mine = {f"token:{made['id']}", f"hook:{hook['id']}"}
    reasons = [(e["action"], e["reason"]) for e in events if e["target"] in mine][::-1]
    assert reasons == [("token.create", "new edge site"), ("token.revoke", "site closed"),
                       ("hook.create", "on-call rota"), ("hook.update", "maintenance"),
                       ("hook.delete", "rota moved")]


def test_the_workers_actions_are_audited_as_system_actors(engine, outbox):
    with Session(engine) as session:
        make_deployment(session)  # version 2 active
        session.commit()
    alert_id = fire_alert(engine)  # quality at risk: the fallback reacts
    with Session(engine) as session:
        done = [(e.actor, e.action) for e in fleet_audit(
            session=session, rules=AuditFilter(actor="system:*", deployment="chat"))]
        fell = fleet_audit(session=session, rules=AuditFilter(action="alias.fallback"))[0]
    assert ("system:fallback", "alias.fallback") in done
    assert ("system:fallback", "calibration.request") in done  # the recalibration it queued
    assert (fell.object_kind, fell.object_id) == ("alias", "chat/active")
    assert fell.details["alert_id"] == alert_id and f"alert {alert_id}" in fell.reason


def test_changes_that_change_nothing_record_nothing(client, tokens, engine, live_server,
                                                    tmp_path):
    admin = tokens.headers(tokens.admin)
    with Session(engine) as session:
        make_deployment(session)
        session.commit()
    hook = client.post("/v1/hooks", headers=admin, json={
        "name": "ops", "kind": "webhook", "url": "http://127.0.0.1:9/hook"}).json()

    def count(action: str) -> int:
        return sum(e["action"] == action for e in client.get("/v1/audit", headers=admin).json())

    assert client.patch(f"/v1/hooks/{hook['id']}", headers=admin,
                        json={"reason": "nothing else"}).status_code == 200
    assert client.patch(f"/v1/hooks/{hook['id']}", headers=admin,
                        json={"name": "ops", "enabled": True}).status_code == 200
    assert count("hook.update") == 0
    assert client.patch(f"/v1/hooks/{hook['id']}", headers=admin,
                        json={"enabled": False}).status_code == 200
    assert count("hook.update") == 1

    current = client.get("/v1/deployments/chat", headers=admin).json()
    for same in ({}, {"delta": current["delta"]}, {"bogus": 1}):
        assert client.patch("/v1/deployments/chat", headers=admin, json=same).status_code == 200
    assert count("deployment.update") == 0
    assert client.patch("/v1/deployments/chat", headers=admin,
                        json={"delta": current["delta"] / 2}).status_code == 200
    assert count("deployment.update") == 1

    token_file = tmp_path / "token"
    token_file.write_text(tokens.admin)
    run = CliRunner().invoke(main, ["deployments", "update", "chat", "--set", "bogus=1",
                                    "--url", live_server.url, "--token-file", str(token_file)])
    assert run.exit_code == 1
    assert "not updated" in run.stderr and "bogus" in run.stderr


def test_create_commands_never_lose_a_secret_nor_echo_a_given_one(client, tokens, engine,
                                                                  live_server, tmp_path):
    with Session(engine) as session:
        make_deployment(session)
        session.commit()
    token_file = tmp_path / "token"
    token_file.write_text(tokens.admin)
    connection = ["--url", live_server.url, "--token-file", str(token_file)]

    def cli(*args: str):
        return CliRunner().invoke(main, [*args, *connection])

    before = len(client.get("/v1/tokens", headers=tokens.headers(tokens.admin)).json())
    refused = cli("tokens", "create", "--name", "ci", "--scope", "operator", "-o", "name")
    assert refused.exit_code == 2 and "shown only once" in refused.stderr
    assert len(client.get("/v1/tokens", headers=tokens.headers(tokens.admin)).json()) == before
    written = cli("tokens", "create", "--name", "ci", "--scope", "operator", "-o", "name",
                  "--out", str(tmp_path / "ci.token"))
    assert written.exit_code == 0, written.output
    assert written.stdout.strip().isdigit()  # its id, as `tokens list -o name` prints
    assert (tmp_path / "ci.token").read_text().strip().startswith("ept_")

    assert cli("hooks", "create", "--name", "a", "--kind", "webhook", "--endpoint",
               "http://127.0.0.1:9/a", "-o", "name").exit_code == 2
    key = tmp_path / "key"
    key.write_text("k" * 32)
    given = cli("hooks", "create", "--name", "b", "--kind", "webhook", "--endpoint",
                "http://127.0.0.1:9/b", "--secret-file", str(key), "-o", "json")
    assert given.exit_code == 0, given.output
    assert json.loads(given.stdout)["secret"] is None and "k" * 32 not in given.stdout
    made = cli("hooks", "create", "--name", "c", "--kind", "webhook", "--endpoint",
               "http://127.0.0.1:9/c", "-o", "json")
    assert len(json.loads(made.stdout)["secret"]) >= 32  # generated: shown once

    named = cli("audit", "-o", "name").stdout.split()
    assert named and len(named) == len(set(named))
    assert all(line.split(":")[0] in ("admin", "deployment") for line in named)
