"""Recalibration and canary tasks: thin, named, idempotent; the services do the work.

`calibration.run` marks the job running, reads its shadow samples, calibrates outside any
transaction, then publishes and promotes in one last transaction; a worker killed before that
commit leaves the job `running` with no version, and the redelivered task (acks_late) or the
sweep runs it again from the start. A job with a `segment` reads and replaces that segment
alone; a whole-deployment job over segmented traffic calibrates every segment (the flow is
`controlplane.flows.recalibration`).
"""

from __future__ import annotations

from datetime import timedelta

from celery import shared_task
from sqlalchemy import select

from controlplane.calibration.models import CalibrationJob, CanaryRun
from controlplane.calibration.service import (
    CalibrationPolicy,
    calibrate_window,
    queued_job_ids,
    start_job,
)
from controlplane.db import get_engine, session_scope, utcnow
from controlplane.deployments.models import Deployment
from controlplane.flows.canary import CanaryPolicy, evaluate_canary
from controlplane.flows.recalibration import apply_outcome, read_window
from controlplane.settings import get_settings
from workers.tasks import RETRY_ON_STORE_ERRORS


@shared_task(name="calibration.run", **RETRY_ON_STORE_ERRORS)
def run(job_id: int) -> dict:
    """Run one calibration job; while it waits for shadow data, check again later."""
    settings = get_settings()
    engine = get_engine(settings.effective_database_url)
    with session_scope(engine) as session:
        job = session.get(CalibrationJob, job_id)
        if job is None:
            return {"skipped": f"calibration job {job_id} no longer exists"}
        if not start_job(session=session, job=job):
            return {"job": job_id, "status": job.status, "skipped": "already finished"}
    policy = CalibrationPolicy.from_settings(settings)
    with session_scope(engine) as session:  # a short read: the store is not held meanwhile
        window = read_window(session=session, job=session.get(CalibrationJob, job_id),
                             seed=policy.seed)
    if window is None:
        return {"job": job_id, "skipped": "already finished"}
    result = calibrate_window(window, policy)
    with session_scope(engine) as session:  # publish + promote + status: one transaction
        job = apply_outcome(session=session, job=session.get(CalibrationJob, job_id),
                            outcome=result, policy=policy)
        outcome = {"job": job_id, "status": job.status, "version": job.result_version,
                   "promotion": job.promotion, "reason": job.status_reason,
                   "segment": job.segment}
    if outcome["status"] == "waiting_for_data":
        # Waiting is not failing: a fresh message, not a retry that Celery's retry limit would
        # end (the job's own wait_max bounds the wait; the sweep re-sends a lost message).
        run.apply_async(args=[job_id], countdown=settings.calibration_retry_s)
    return outcome


@shared_task(name="calibration.sweep", **RETRY_ON_STORE_ERRORS)
def sweep() -> list[int]:
    """Re-send open jobs nobody touched for a while (a lost send, a worker that died)."""
    settings = get_settings()
    idle = timedelta(seconds=max(600.0, 2 * settings.calibration_retry_s))
    with session_scope(get_engine(settings.effective_database_url)) as session:
        ids = queued_job_ids(session=session, older_than=utcnow() - idle)
    for job_id in ids:
        run.apply_async(args=[job_id])
    return ids


@shared_task(name="canary.evaluate", **RETRY_ON_STORE_ERRORS)
def evaluate(deployment_id: int) -> dict:
    """Check a deployment's running canary: promote, revert, pause or keep going."""
    settings = get_settings()
    with session_scope(get_engine(settings.effective_database_url)) as session:
        deployment = session.get(Deployment, deployment_id)
        if deployment is None:
            return {"skipped": f"deployment {deployment_id} no longer exists"}
        canary = evaluate_canary(session=session, deployment=deployment,
                                 policy=CanaryPolicy.from_settings(settings))
        if canary is None:
            return {"deployment": deployment.name, "canary": None}
        return {"deployment": deployment.name, "canary": canary.id, "status": canary.status,
                "clean_windows": canary.clean_windows, "failed_checks": canary.failed_checks}


@shared_task(name="canary.evaluate_all", **RETRY_ON_STORE_ERRORS)
def evaluate_all() -> list[int]:
    """Queue `canary.evaluate` for every deployment with a running canary (the beat entry)."""
    settings = get_settings()
    with session_scope(get_engine(settings.effective_database_url)) as session:
        ids = list(session.scalars(select(CanaryRun.deployment_id)
                                   .where(CanaryRun.status == "running").distinct()))
    for deployment_id in sorted(ids):
        evaluate.apply_async(args=[deployment_id], expires=settings.canary_interval_s)
    return sorted(ids)
