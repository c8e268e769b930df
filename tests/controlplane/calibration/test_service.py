"""Recalibration jobs through the service: what is chosen, what is published, not enough data,
policies, idempotent reruns and crash safety of publishing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from datetime import timedelta

import numpy as np
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.calibration import service
from controlplane.calibration.learn_then_test import calibrate_thresholds, policy_disagreement
from controlplane.calibration.models import CalibrationJob
from controlplane.db import session_scope, utcnow
from controlplane.deployments.models import AuditEvent, ThresholdSet
from controlplane.deployments.service import aliases_of, get_deployment
from controlplane.errors import Conflict
from controlplane.flows import recalibration
from tests.support.calibration import LAYERS, make_deployment, separable_samples, write_traffic

POLICY = service.CalibrationPolicy(min_samples_per_layer=500, seed=0)


def _seed(engine, n=4000, *, seed=1, policy="auto", start=None, **samples):
    signals, matched = separable_samples(n, seed=seed, **samples)
    start = start or utcnow() - timedelta(minutes=30)
    with session_scope(engine) as session:
        make_deployment(session, policy=policy)
        write_traffic(session, "chat", signals, matched, start=start)
    return signals, matched, start


def _run(engine, *, since, policy=POLICY, now=None, trigger="manual") -> int:
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        job, _ = service.request_calibration(session=session, deployment=deployment,
                                             actor="test", since=since, policy=policy,
                                             trigger=trigger)
        job_id = job.id
    with session_scope(engine) as session:
        service.start_job(session=session, job=session.get(CalibrationJob, job_id))
    with session_scope(engine) as session:
        recalibration.run_calibration(session=session, job=session.get(CalibrationJob, job_id),
                                      policy=policy, now=now)
    return job_id


def _calibration_versions(session: Session) -> list[ThresholdSet]:
    return list(session.scalars(select(ThresholdSet).where(ThresholdSet.origin == "calibration")))


def test_publishes_what_the_statistics_choose_and_promotes(engine, outbox):
    signals, matched, start = _seed(engine)
    job_id = _run(engine, since=start)
    # the service tests per request, with the ids the runtime shipped (64-token requests)
    requests = np.array([f"req-{i // 64}" for i in range(len(signals))])
    expected = calibrate_thresholds(signals=signals, matched=matched, exit_layers=LAYERS,
                                    num_layers=12, delta=0.05, epsilon=0.1,
                                    min_samples_per_layer=500, requests=requests)
    with Session(engine) as session:
        job = session.get(CalibrationJob, job_id)
        assert job.status == "succeeded", job.status_reason
        assert job.summary["risk_unit"] == "request" and job.summary["risk_test"] == "binomial"
        assert job.summary["samples"]["requests"] == len(np.unique(requests)) == 63
        # one runtime is one witness: a first calibration from never-exit waits for a person
        assert job.promotion == "awaiting_approval" and job.result_version == 2
        assert "1 witness(es)" in job.summary["promotion_hold"]
        published = session.scalars(select(ThresholdSet).where(
            ThresholdSet.version == job.result_version)).one()
        assert published.thresholds_by_layer() == pytest.approx(expected.thresholds)
        # Separable labels: every exit above 0.5 matches, so the bound allows exits and the
        # chosen thresholds sit at or above the boundary.
        assert expected.exit_rate > 0.5
        assert min(expected.thresholds.values()) >= 0.45
        wrong, n = policy_disagreement(signals, matched,
                                       [published.thresholds_by_layer()[k] for k in LAYERS])
        assert wrong / n <= 0.05
        assert published.origin == "calibration" and published.calibration_job_id == job_id
        assert published.parent_version == 1
        metrics = published.expected_metrics
        assert set(metrics["exit_rate"]) == {"3", "6", "9"}
        assert metrics["total_exit_rate"] == pytest.approx(expected.exit_rate)
        assert metrics["risk_bound"] <= 0.05 and metrics["speedup"] > 1.0
        assert [layer["layer"] for layer in job.layers] == LAYERS
        assert {"threshold", "risk", "risk_bound", "p_value", "exit_rate"} <= set(job.layers[0])
        chosen = [point for point in job.curve if point["chosen"]]
        assert len(chosen) == 1 and len(job.curve) >= 3
        assert {int(k): v for k, v in chosen[0]["thresholds"].items()} == pytest.approx(
            published.thresholds_by_layer())
        assert job.summary["holdout"]["passed"] is True
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        recalibration.approve(session=session, deployment=deployment,
                              job=session.get(CalibrationJob, job_id), actor="ops",
                              reason="checked")
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        assert aliases_of(session=session, deployment=deployment)["active"] == 2
        promote = session.scalars(select(AuditEvent).where(
            AuditEvent.action == "alias.promote")).one()
        assert promote.to_version == 2 and promote.details["calibration_job_id"] == job_id


def test_nothing_certifiable_fails_and_publishes_nothing(engine, outbox):
    # Every early answer is wrong: no exit step can be certified at any threshold.
    _, _, start = _seed(engine, mismatch_below=1.1)
    job_id = _run(engine, since=start)
    with Session(engine) as session:
        job = session.get(CalibrationJob, job_id)
        assert job.status == "failed"
        assert "no exit step could be certified" in job.status_reason
        assert job.result_version is None and _calibration_versions(session) == []


@pytest.mark.slow
def test_an_automatic_job_that_certifies_nothing_waits_for_the_window_to_grow(engine, outbox):
    # After a fallback the first samples of the new traffic may certify nothing; the job the
    # alert queued waits for more instead of failing, then publishes from the grown window.
    _, _, start = _seed(engine, mismatch_below=1.1)
    job_id = _run(engine, since=start, trigger="alert")
    with Session(engine) as session:
        job = session.get(CalibrationJob, job_id)
        assert job.status == "waiting_for_data"
        assert "no exit step could be certified" in job.status_reason
        assert "Waiting for more shadow samples" in job.status_reason
        assert job.result_version is None and _calibration_versions(session) == []
        assert job.curve  # what it found so far is on record
    signals, matched = separable_samples(40000, seed=7)
    with session_scope(engine) as session:  # all of it before now (20 minutes from start + 5)
        write_traffic(session, "chat", signals, matched, start=start + timedelta(minutes=5),
                      spacing_s=0.03)
    with session_scope(engine) as session:  # the retried task
        assert service.start_job(session=session, job=session.get(CalibrationJob, job_id))
    with session_scope(engine) as session:
        job = recalibration.run_calibration(
            session=session, job=session.get(CalibrationJob, job_id), policy=POLICY)
        assert job.status == "succeeded", job.status_reason
        assert job.attempts == 2 and job.result_version == 2


def test_an_automatic_job_stops_waiting_for_certifiable_samples_after_the_wait(engine, outbox):
    _, _, start = _seed(engine, mismatch_below=1.1)
    job_id = _run(engine, since=start, trigger="alert", now=utcnow() + timedelta(hours=2))
    with Session(engine) as session:
        job = session.get(CalibrationJob, job_id)
        assert job.status == "failed" and "no exit step could be certified" in job.status_reason


def test_not_enough_data_waits_then_continues_with_the_new_samples(engine, outbox):
    _, _, start = _seed(engine, n=300)
    job_id = _run(engine, since=start)
    with Session(engine) as session:
        job = session.get(CalibrationJob, job_id)
        assert job.status == "waiting_for_data"
        assert job.summary == {"seed": 0, "counts": {"3": 300, "6": 300, "9": 300},
                               "required": 500}
        assert "need at least 500" in job.status_reason
    signals, matched = separable_samples(2000, seed=7)
    with session_scope(engine) as session:
        write_traffic(session, "chat", signals, matched, start=start + timedelta(minutes=5))
    with session_scope(engine) as session:  # the retried task
        job = session.get(CalibrationJob, job_id)
        assert service.start_job(session=session, job=job)
    with session_scope(engine) as session:
        job = recalibration.run_calibration(
            session=session, job=session.get(CalibrationJob, job_id), policy=POLICY)
        assert job.status == "succeeded" and job.attempts == 2
        assert job.summary["samples"]["total"] == 2300


def test_not_enough_data_gives_up_after_the_wait(engine, outbox):
    _, _, start = _seed(engine, n=300)
    job_id = _run(engine, since=start, now=utcnow() + timedelta(hours=2))
    with Session(engine) as session:
        job = session.get(CalibrationJob, job_id)
        assert job.status == "failed" and "gave up after waiting 3600 s" in job.status_reason
        assert _calibration_versions(session) == []


def test_one_open_job_per_deployment_and_reruns_are_no_ops(engine, outbox):
    _, _, start = _seed(engine)
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        first, created = service.request_calibration(session=session, deployment=deployment,
                                                     actor="a", since=start)
        again, created_again = service.request_calibration(session=session,
                                                           deployment=deployment, actor="b")
        assert created and not created_again and again.id == first.id
        job_id = first.id
    assert outbox == [("calibration.run", [job_id])]  # sent once, after the commit
    for _ in range(2):
        with session_scope(engine) as session:
            recalibration.run_calibration(session=session, job=session.get(CalibrationJob, job_id),
                                          policy=POLICY)
    with Session(engine) as session:
        assert len(_calibration_versions(session)) == 1
        assert not service.start_job(session=session, job=session.get(CalibrationJob, job_id))


def test_exception_between_publish_and_commit_leaves_no_version(engine, outbox, monkeypatch):
    _, _, start = _seed(engine)

    def crash(**kwargs):
        raise RuntimeError("worker lost between publish and commit")

    monkeypatch.setattr(recalibration, "_apply_policy", crash)
    with pytest.raises(RuntimeError):
        _run(engine, since=start)
    with Session(engine) as session:
        assert _calibration_versions(session) == []
        job = session.scalars(select(CalibrationJob)).one()
        assert job.status == "running" and job.result_version is None
        deployment = get_deployment(session=session, name="chat")
        assert aliases_of(session=session, deployment=deployment)["active"] == 1
        job_id = job.id
    monkeypatch.undo()
    with session_scope(engine) as session:  # the rerun restarts cleanly
        job = recalibration.run_calibration(
            session=session, job=session.get(CalibrationJob, job_id), policy=POLICY)
        assert job.status == "succeeded" and job.result_version == 2


KILL_MID_JOB = textwrap.dedent("""
    import os, signal, sys
    from controlplane.calibration import service
    from controlplane.calibration.models import CalibrationJob
    from controlplane.db import make_engine, session_scope
    from controlplane.flows import recalibration

    publish = recalibration.publish

    def publish_then_die(**kwargs):
        published = publish(**kwargs)  # flushed inside the open transaction
        os.kill(os.getpid(), signal.SIGKILL)
        return published

    recalibration.publish = publish_then_die
    engine = make_engine(sys.argv[1])
    with session_scope(engine) as session:
        service.start_job(session=session, job=session.get(CalibrationJob, int(sys.argv[2])))
    with session_scope(engine) as session:
        recalibration.run_calibration(
            session=session, job=session.get(CalibrationJob, int(sys.argv[2])),
            policy=service.CalibrationPolicy(min_samples_per_layer=500, seed=0))
""")


@pytest.mark.slow
def test_worker_killed_mid_job_leaves_no_partial_version_and_rerun_succeeds(
        db_url, engine, outbox):
    _, _, start = _seed(engine)
    with session_scope(engine) as session:
        job, _ = service.request_calibration(
            session=session, deployment=get_deployment(session=session, name="chat"),
            actor="test", since=start)
        job_id = job.id
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    killed = subprocess.run([sys.executable, "-c", KILL_MID_JOB, db_url, str(job_id)],
                            env=env, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    with Session(engine) as session:
        assert _calibration_versions(session) == []
        assert session.scalars(select(ThresholdSet.version)).all() == [1]
        assert session.get(CalibrationJob, job_id).status == "running"
    with session_scope(engine) as session:
        service.start_job(session=session, job=session.get(CalibrationJob, job_id))
    with session_scope(engine) as session:
        job = recalibration.run_calibration(
            session=session, job=session.get(CalibrationJob, job_id), policy=POLICY)
        assert job.status == "succeeded" and job.attempts == 2
    with Session(engine) as session:
        assert [s.version for s in _calibration_versions(session)] == [2]


def test_approval_policy_waits_for_an_operator(engine, outbox):
    _, _, start = _seed(engine, policy="approval")
    first = _run(engine, since=start)
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        job = session.get(CalibrationJob, first)
        assert job.status == "succeeded" and job.promotion == "awaiting_approval"
        assert aliases_of(session=session, deployment=deployment)["active"] == 1
        recalibration.approve(session=session, deployment=deployment, job=job, actor="ops",
                              reason="looks right")
        assert aliases_of(session=session, deployment=deployment)["active"] == job.result_version
        assert job.promotion == "approved" and job.decided_by == "ops"
        with pytest.raises(Conflict):
            recalibration.reject(session=session, deployment=deployment, job=job, actor="ops",
                                 reason="too late")
    second = _run(engine, since=start)
    third = _run(engine, since=start)
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        assert session.get(CalibrationJob, second).promotion == "superseded"
        job = session.get(CalibrationJob, third)
        recalibration.reject(session=session, deployment=deployment, job=job, actor="ops",
                             reason="not now")
        assert job.promotion == "rejected"
        assert aliases_of(session=session, deployment=deployment)["active"] == 2
        with pytest.raises(Conflict):
            recalibration.approve(session=session, deployment=deployment, job=job, actor="ops",
                                  reason="changed my mind")
        actions = session.scalars(select(AuditEvent.action)).all()
        assert "candidate.reject" in actions


def test_calibration_is_reproducible_from_the_stored_window(engine, outbox):
    """The job reads exactly the samples of its window, not those before `since`."""
    signals, matched, start = _seed(engine)
    noise = np.zeros_like(matched)  # before the window: all wrong, must not be read
    with session_scope(engine) as session:
        write_traffic(session, "chat", signals[:2000], noise, start=start - timedelta(hours=1))
    job_id = _run(engine, since=start)
    with Session(engine) as session:
        job = session.get(CalibrationJob, job_id)
        assert job.status == "succeeded" and job.summary["samples"]["total"] == 4000


def test_two_workers_racing_on_one_job_publish_one_version(engine, outbox):
    _, _, start = _seed(engine)
    with session_scope(engine) as session:
        job, _ = service.request_calibration(
            session=session, deployment=get_deployment(session=session, name="chat"),
            actor="test", since=start)
        job_id = job.id
    outcomes = []
    for _ in range(2):  # both read and calibrate before either applies
        with session_scope(engine) as session:
            window = recalibration.read_window(session=session,
                                               job=session.get(CalibrationJob, job_id))
        outcomes.append(service.calibrate_window(window, POLICY))
    for outcome in outcomes:
        with session_scope(engine) as session:
            recalibration.apply_outcome(session=session, job=session.get(CalibrationJob, job_id),
                                        outcome=outcome, policy=POLICY)
    with Session(engine) as session:
        assert [s.version for s in _calibration_versions(session)] == [2]
        assert session.get(CalibrationJob, job_id).status == "succeeded"
        assert recalibration.read_window(session=session,
                                         job=session.get(CalibrationJob, job_id)) is None
