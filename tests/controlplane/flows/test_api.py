"""The calibration API: start a recalibration, list and show jobs, approve / reject, canary."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy.orm import Session

from controlplane.calibration import service
from controlplane.calibration.models import CalibrationJob
from controlplane.db import session_scope, utcnow
from controlplane.deployments.service import aliases_of, audit_log, get_deployment, publish
from controlplane.flows import recalibration
from controlplane.flows.canary import start_canary
from tests.support.calibration import make_deployment, separable_samples, write_traffic
from tests.support.waiting import patient_get


def test_start_list_show_and_approve(client, tokens, engine, outbox):
    op = tokens.headers(tokens.operator)
    since = utcnow() - timedelta(hours=1)
    signals, matched = separable_samples(3000, seed=4)
    with session_scope(engine) as session:
        make_deployment(session, policy="approval")
        write_traffic(session, "chat", signals, matched, start=since)
    started = client.post("/v1/deployments/chat/calibrations", headers=op,
                          json={"since": since.isoformat(), "reason": "new traffic"})
    assert started.status_code == 202, started.text
    job = started.json()["job"]
    assert started.json()["created"] is True and job["status"] == "queued"
    assert job["requested_by"] == "token:test-operator" and job["trigger"] == "manual"
    assert outbox == [("calibration.run", [job["id"]])]
    again = client.post("/v1/deployments/chat/calibrations", headers=op, json={})
    assert again.status_code == 200 and again.json() == {"job": job, "created": False}

    with session_scope(engine) as session:  # what the worker does
        row = session.get(CalibrationJob, job["id"])
        service.start_job(session=session, job=row)
    with session_scope(engine) as session:
        recalibration.run_calibration(
            session=session, job=session.get(CalibrationJob, job["id"]),
            policy=service.CalibrationPolicy(min_samples_per_layer=500, seed=0))

    listed = patient_get(client, "/v1/deployments/chat/calibrations", headers=op).json()
    assert [j["id"] for j in listed] == [job["id"]] and "curve" not in listed[0]
    shown = patient_get(client, f"/v1/deployments/chat/calibrations/{job['id']}", headers=op).json()
    assert shown["status"] == "succeeded" and shown["promotion"] == "awaiting_approval"
    assert [layer["layer"] for layer in shown["layers"]] == [3, 6, 9] and shown["curve"]
    approved = client.post(f"/v1/deployments/chat/calibrations/{job['id']}/approve",
                           headers=op, json={"reason": "reviewed the curve"})
    assert approved.status_code == 200 and approved.json()["promotion"] == "approved"
    deployment = client.get("/v1/deployments/chat", headers=op).json()
    assert deployment["aliases"]["active"] == shown["result_version"]
    twice = client.post(f"/v1/deployments/chat/calibrations/{job['id']}/reject",
                        headers=op, json={"reason": "no"})
    assert twice.status_code == 409 and "no candidate waiting" in twice.json()["detail"]


def test_errors_say_what_was_wrong(client, tokens, engine, outbox):
    op = tokens.headers(tokens.operator)
    with session_scope(engine) as session:
        make_deployment(session)
    now = utcnow()
    empty = client.post("/v1/deployments/chat/calibrations", headers=op, json={
        "since": now.isoformat(), "until": (now - timedelta(hours=1)).isoformat()})
    assert empty.status_code == 422 and "window is empty" in empty.json()["detail"]
    naive = client.post("/v1/deployments/chat/calibrations", headers=op,
                        json={"since": "2026-11-29T10:00:00"})
    assert naive.status_code == 422
    assert patient_get(client, "/v1/deployments/chat/calibrations/99",
                       headers=op).status_code == 404
    assert patient_get(client, "/v1/deployments/chat/canary", headers=op).status_code == 404
    assert client.post("/v1/deployments/chat/canary/promote", headers=op,
                       json={"reason": "x"}).status_code == 409
    assert client.post("/v1/deployments/chat/calibrations", json={}).status_code == 401
    assert outbox == []


def test_canary_status_and_manual_revert(client, tokens, engine, outbox):
    op = tokens.headers(tokens.operator)
    with session_scope(engine) as session:
        deployment = make_deployment(session, policy="canary")
        version = publish(session=session, deployment=deployment, thresholds={
            3: 0.7, 6: 0.7, 9: 0.7}, reason="candidate", actor="ops").version
        start_canary(session=session, deployment=deployment, version=version, actor="ops")
    status = patient_get(client, "/v1/deployments/chat/canary", headers=op)
    assert status.status_code == 200
    assert status.json()["status"] == "running" and status.json()["version"] == 2
    reverted = client.post("/v1/deployments/chat/canary/revert", headers=op,
                           json={"reason": "not today"})
    assert reverted.status_code == 200 and reverted.json()["status"] == "reverted"
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        assert "canary" not in aliases_of(session=session, deployment=deployment)


def test_start_a_canary_of_a_published_version(client, tokens, engine, outbox):
    op = tokens.headers(tokens.operator)
    with session_scope(engine) as session:
        deployment = make_deployment(session)
        version = publish(session=session, deployment=deployment, thresholds={
            3: 0.7, 6: 0.7, 9: 0.7}, reason="candidate", actor="ops").version
    url = "/v1/deployments/chat/canary"
    for body, status, says in (
            ({"version": 1}, 409, "is 'chat''s active version"),
            ({"version": 99}, 404, "has no threshold set version 99"),
            ({"version": 0}, 422, "version"),
            ({"version": version, "reason": "x" * 2001}, 422, "reason")):
        refused = client.post(url, headers=op, json=body)
        assert refused.status_code == status and says in refused.json()["detail"], refused.text
    assert client.get(url, headers=op).status_code == 404  # nothing was started

    # The fraction is the deployment's: a field the canary does not take is ignored, and named.
    started = client.post(url, headers=op, json={"version": version, "reason": "try it",
                                                 "fraction": 0.5})
    assert started.status_code == 201, started.text
    assert started.headers["exitplane-ignored-fields"] == "fraction"
    run = started.json()
    assert (run["version"], run["baseline_version"], run["status"]) == (version, 1, "running")
    assert client.get(url, headers=op).json()["id"] == run["id"]
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        assert aliases_of(session=session, deployment=deployment)["canary"] == version
        event = audit_log(session=session, deployment=deployment, limit=1)[0]
    assert (event.action, event.actor, event.to_version) == (
        "canary.start", "token:test-operator", version)
    assert event.reason == (f"canary of version {version} on 10% of runtimes (stable: "
                            "version 1): try it")

    again = client.post(url, headers=op, json={"version": version})
    assert again.status_code == 409
    assert "already has a running canary of version 2: promote or revert it first" in \
        again.json()["detail"]
    assert client.get(url, headers=op).json()["id"] == run["id"]  # the running one stays
