"""Calibration and canary tasks on a real Celery worker (a subprocess, solo pool): the embedded
stack (SQLite store, SQLite broker) and the production one (PostgreSQL store, Redis broker)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.alerts.models import Alert
from controlplane.alerts.service import Condition, fire
from controlplane.calibration import service
from controlplane.calibration.models import CalibrationJob, CanaryRun
from controlplane.db import session_scope, utcnow
from controlplane.deployments.models import ThresholdSet
from controlplane.deployments.service import aliases_of, get_deployment, move_alias, publish
from controlplane.flows.canary import start_canary
from tests.support.calibration import (
    make_deployment,
    separable_samples,
    wait_for_job,
    write_fleet_traffic,
    write_traffic,
)

# slow: a real Celery worker process
pytestmark = pytest.mark.slow

def test_alert_fallback_then_recalibration_on_the_worker(engine, stack):
    _, worker = stack
    fired_at = utcnow() - timedelta(hours=1)
    with session_scope(engine) as session:
        deployment = make_deployment(session)
        version = publish(session=session, deployment=deployment,
                          thresholds={3: 0.2, 6: 0.2, 9: 0.2}, reason="old", actor="ops").version
        move_alias(session=session, deployment=deployment, alias="active", version=version,
                   actor="ops", reason="old traffic")
    signals, matched = separable_samples(3000, seed=8)
    with session_scope(engine) as session:  # a fleet of three witnesses: promoted on its own
        write_fleet_traffic(session, "chat", signals, matched,
                            start=fired_at + timedelta(minutes=1))
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        alert, _ = fire(session=session, deployment=deployment, now=fired_at,
                        condition=Condition(kind="quality_regression", severity="critical",
                                            summary="disagreement above δ"))
        # In the same transaction as the alert: the conservative set is active.
        assert aliases_of(session=session, deployment=deployment)["active"] == 1
        alert_id = alert.id
    with Session(engine) as session:
        job_id = session.scalars(select(CalibrationJob.id)).one()
    job = wait_for_job(engine, job_id)  # the worker got calibration.run after the commit
    assert job.status == "succeeded", f"{job.status_reason}\n{worker.log.read_text()[-3000:]}"
    assert job.alert_id == alert_id and job.summary["samples"]["total"] == 3000
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        assert aliases_of(session=session, deployment=deployment)["active"] == job.result_version
        published = session.scalars(select(ThresholdSet).where(
            ThresholdSet.version == job.result_version)).one()
        assert published.origin == "calibration" and published.parent_version == 1
        assert "recalibration job" in session.get(Alert, alert_id).action_taken


def test_a_job_waiting_for_data_is_retried_until_the_samples_arrive(engine, stack):
    since = utcnow() - timedelta(hours=1)
    signals, matched = separable_samples(3000, seed=9)
    with session_scope(engine) as session:
        make_deployment(session)
        write_traffic(session, "chat", signals[:200], matched[:200], start=since)
    with session_scope(engine) as session:
        job, _ = service.request_calibration(
            session=session, deployment=get_deployment(session=session, name="chat"),
            actor="ops", since=since)
        job_id = job.id
    job = wait_for_job(engine, job_id, statuses=("waiting_for_data",))
    assert job.summary["required"] == 500
    # It keeps looking past Celery's retry limit (5): waiting is bounded by wait_max only.
    deadline = time.monotonic() + 120
    while job.attempts < 8:
        assert time.monotonic() < deadline, f"stopped after {job.attempts} attempts"
        time.sleep(0.5)
        with Session(engine) as session:
            job = session.get(CalibrationJob, job_id)
    # read between attempts: an attempt in progress shows the job as running
    assert wait_for_job(engine, job_id, statuses=("waiting_for_data",)).status == "waiting_for_data"
    with session_scope(engine) as session:
        write_traffic(session, "chat", signals[200:], matched[200:],
                      start=since + timedelta(minutes=10))
    job = wait_for_job(engine, job_id)
    assert job.status == "succeeded" and job.attempts >= 2
    assert job.summary["samples"]["total"] == 3000


def test_canary_evaluate_all_runs_on_the_worker(engine, stack):
    app, _ = stack
    with session_scope(engine) as session:
        deployment = make_deployment(session, policy="canary")
        version = publish(session=session, deployment=deployment,
                          thresholds={3: 0.6, 6: 0.6, 9: 0.6}, reason="candidate",
                          actor="ops").version
        start_canary(session=session, deployment=deployment, version=version, actor="ops",
                     now=utcnow() - timedelta(minutes=30))
    queued = app.send_task("canary.evaluate_all").get(timeout=120)
    assert queued == [1]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with Session(engine) as session:
            run = session.scalars(select(CanaryRun)).one()
            if run.checks:
                break
        time.sleep(0.3)
    # No canary traffic in 28 whole minutes: inconclusive windows until the run pauses.
    assert run.status == "paused" and run.inconclusive_windows == 10
    assert all(check["verdict"] == "inconclusive" for check in run.checks)
