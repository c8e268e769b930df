"""Deleting a deployment (flows.removal, DELETE /v1/deployments/{name}) on SQLite and
PostgreSQL: refused while a runtime is live unless forced; then every row stored under the
deployment is gone, telemetry included (it has no foreign key to cascade from), while other
deployments keep theirs; its runtime tokens are revoked and refused (and kept, revoked, in the
token list), its alert hooks deleted, each with an audit event; the deletion is an
administrative audit event, and its own audit log is kept in the fleet-wide log; the name can
be created again, and the new deployment takes
telemetry under its own id."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import func, select

from controlplane.alerts.hook_service import create_hook
from controlplane.alerts.models import AlertHook
from controlplane.auth.models import AdminEvent, ApiToken
from controlplane.auth.service import create_token
from controlplane.db import session_scope, utcnow
from controlplane.deployments.audit import AuditFilter, fleet_audit
from controlplane.deployments.models import AuditEvent, Deployment
from controlplane.deployments.service import get_deployment
from controlplane.errors import Conflict
from controlplane.flows.removal import delete_deployment
from controlplane.models import Base
from controlplane.runtimes.models import Runtime
from controlplane.runtimes.service import record_heartbeat
from exitplane.wire import Heartbeat
from tests.support.calibration import make_deployment, separable_samples, write_traffic

pytestmark = pytest.mark.usefixtures("outbox")


def _rows_of(session, deployment_id: int) -> dict[str, int]:
    """Rows per table that name `deployment_id` in a deployment_id column (or are it)."""
    counts = {}
    for table in Base.metadata.sorted_tables:
        column = table.c.get("deployment_id")
        if table.name == "deployments":
            column = table.c.id
        if column is None:
            continue
        found = session.scalar(select(func.count()).select_from(table)
                               .where(column == deployment_id))
        if found:
            counts[table.name] = found
    return counts


def _fill(session, name: str) -> tuple[int, int]:
    """Deployment `name` with telemetry, a runtime, a runtime token; its id and the token's."""
    make_deployment(session, name=name)
    deployment = get_deployment(session=session, name=name)
    signals, matched = separable_samples(300, seed=3)
    write_traffic(session, name, signals, matched, start=utcnow() - timedelta(minutes=10))
    token, _ = create_token(session=session, name=f"rt-{name}", scope="runtime",
                            deployment=deployment)
    create_hook(session=session, name=f"pager-{name}", kind="webhook",
                url="http://127.0.0.1:9/hook", actor="user:ops", deployment=deployment)
    record_heartbeat(session=session, deployment=deployment,
                     beat=Heartbeat(runtime_id="rt-1"), token_id=token.id)
    return deployment.id, token.id


def test_delete_takes_everything_under_the_deployment_and_nothing_else(engine):
    with session_scope(engine) as session:
        gone_id, token_id = _fill(session, "chat")
        kept_id, _ = _fill(session, "other")
    with session_scope(engine) as session:
        before = _rows_of(session, gone_id)
        kept_before = _rows_of(session, kept_id)
        history = [(e.created_at, e.actor, e.action, e.reason) for e in session.scalars(
            select(AuditEvent).where(AuditEvent.deployment_id == gone_id)
            .order_by(AuditEvent.created_at, AuditEvent.id))]
    assert {"token_records", "shadow_samples", "rollups", "threshold_sets", "aliases",
            "runtimes", "api_tokens", "audit_events"} <= set(before) and history

    with pytest.raises(Conflict, match=r"has 1 live runtime\(s\) \(rt-1\)"), \
            session_scope(engine) as session:
        delete_deployment(session=session, deployment=get_deployment(session=session,
                                                                     name="chat"),
                          actor="user:ops", reason="typo", stale_after_s=120)
    with session_scope(engine) as session:  # refused: nothing went
        assert _rows_of(session, gone_id) == before

    with session_scope(engine) as session:
        details = delete_deployment(
            session=session, deployment=get_deployment(session=session, name="chat"),
            actor="user:ops", reason="typo", stale_after_s=120, force=True)
    assert details["revoked_tokens"] == [token_id] and details["live_runtimes"] == ["rt-1"]
    assert len(details["deleted_hooks"]) == 1
    assert details["threshold_sets"] == before["threshold_sets"]
    with session_scope(engine) as session:
        assert _rows_of(session, gone_id) == {}
        assert _rows_of(session, kept_id) == kept_before
        kept_token = session.get(ApiToken, token_id)  # in the token list, revoked, unbound
        assert kept_token.revoked_at is not None and kept_token.deployment_id is None
        assert session.get(AlertHook, details["deleted_hooks"][0]) is None
        event = session.scalars(select(AdminEvent).where(
            AdminEvent.action == "deployment.delete")).one()
        assert (event.actor, event.target, event.reason) == ("user:ops", "deployment:chat",
                                                             "typo")
        revoked = session.scalars(select(AdminEvent).where(
            AdminEvent.action == "token.revoke")).one()
        assert revoked.target == f"token:{token_id}"
        assert revoked.reason == "deployment chat deleted: typo"
        hook_gone = session.scalars(select(AdminEvent).where(
            AdminEvent.action == "hook.delete")).one()
        assert (hook_gone.target, hook_gone.reason) == (
            f"hook:{details['deleted_hooks'][0]}", "deployment chat deleted: typo")
        # The deployment's own audit log outlives it in the fleet-wide log.
        archived = [e for e in session.scalars(select(AdminEvent).order_by(AdminEvent.id))
                    if e.details.get("archived_from") == "deployment_audit"]
        assert [(e.created_at, e.actor, e.action, e.reason) for e in archived] == history
        assert {e.deployment for e in archived} == {"chat"}
        assert details["archived_events"] == len(history)
        page = fleet_audit(session=session, rules=AuditFilter(deployment="chat"), limit=500)
        assert {e.action for e in page} >= {e[2] for e in history} | {"deployment.delete"}

    with session_scope(engine) as session:  # the name is free again, under a new id
        again_id, _ = _fill(session, "chat")
    assert again_id != gone_id
    with session_scope(engine) as session:
        assert _rows_of(session, again_id)["token_records"] == before["token_records"]
        assert _rows_of(session, gone_id) == {}


def test_a_stale_runtime_does_not_hold_a_deletion(engine):
    with session_scope(engine) as session:
        deployment_id, _ = _fill(session, "chat")
        session.execute(Runtime.__table__.update().values(
            last_seen=utcnow() - timedelta(minutes=10)))
    with session_scope(engine) as session:
        details = delete_deployment(
            session=session, deployment=get_deployment(session=session, name="chat"),
            actor="user:ops", reason="old", stale_after_s=120)
    assert details["live_runtimes"] == [] and details["forced"] is False
    with session_scope(engine) as session:
        assert session.get(Deployment, deployment_id) is None


def test_the_route_refuses_live_runtimes_and_cuts_off_the_runtime_token(client, tokens,
                                                                         engine):
    admin = tokens.headers(tokens.admin)
    with session_scope(engine) as session:
        make_deployment(session, name="chat")
        token, secret = create_token(session=session, name="rt", scope="runtime",
                                     deployment=get_deployment(session=session, name="chat"))
    runtime = tokens.headers(secret)
    pulled = client.get("/v1/deployments/chat/thresholds", params={"runtime_id": "rt-1"},
                        headers=runtime)
    assert pulled.status_code == 200
    beat = client.post("/v1/deployments/chat/heartbeats", json={"runtime_id": "rt-1"},
                       headers=runtime)
    assert beat.status_code == 200, beat.text
    refused = client.delete("/v1/deployments/chat", params={"reason": "x"}, headers=admin)
    assert refused.status_code == 409, refused.text
    assert "live runtime" in refused.json()["detail"]
    no_reason = client.delete("/v1/deployments/chat", params={"force": "true"}, headers=admin)
    assert no_reason.status_code == 422
    operator = client.delete("/v1/deployments/chat", params={"reason": "x", "force": "true"},
                             headers=tokens.headers(tokens.operator))
    assert operator.status_code == 403
    deleted = client.delete("/v1/deployments/chat", params={"reason": "x", "force": "true"},
                            headers=admin)
    assert deleted.status_code == 200, deleted.text
    assert deleted.json()["revoked_tokens"] == [token.id]
    assert client.get("/v1/deployments/chat", headers=admin).status_code == 404
    cut_off = client.get("/v1/deployments/chat/thresholds", params={"runtime_id": "rt-1"},
                         headers=runtime)
    assert cut_off.status_code == 401
