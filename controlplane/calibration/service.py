"""Recalibration jobs: request, run (Learn-Then-Test on in-domain shadow samples), publish a
candidate and apply the deployment's policy; operators approve or reject. Plain functions.

A run is three steps: `read_window` (the job's shadow samples), `calibrate_window` (the
statistics, outside any transaction) and `apply_outcome`, which publishes the candidate, moves
the alias and marks the job succeeded in one transaction under the job's row lock.
`run_calibration` does all three in the caller's transaction; the worker task gives each its own
so that the store is not held while the statistics run.

Crash safety: a worker killed before `apply_outcome` commits leaves no version behind; the job
stays `running` (or `queued`) and a rerun starts again from the samples; a rerun after the
commit, or a duplicate run racing it, finds the job finished and does nothing.

The automatic fallback lives in `controlplane.calibration.fallback` and the canary in
`controlplane.calibration.canary` (its functions are re-exported here).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.calibration.canary import (
    CanaryPolicy,
    evaluate_canary,
    promote_canary,
    revert_canary,
    running_canary,
    start_canary,
)
from controlplane.calibration.models import OPEN_JOB_STATUSES, CalibrationJob, CanaryRun
from controlplane.calibration.stats import (
    CalibrationResult,
    NotEnoughShadowData,
    calibrate_thresholds,
)
from controlplane.db import utcnow
from controlplane.errors import Conflict, Invalid, NotFound
from controlplane.outbox import enqueue_task
from controlplane.telemetry.service import shadow_samples
from controlplane.thresholds.models import Deployment, ThresholdSet
from controlplane.thresholds.service import aliases_of, move_alias, publish, record_audit
from exitplane.wire import Origin

__all__ = [
    "CalibrationPolicy", "CanaryPolicy", "ShadowWindow", "apply_outcome", "approve",
    "calibrate_window", "evaluate_canary", "get_job", "list_jobs", "promote_canary",
    "read_window", "reject", "request_calibration", "revert_canary", "run_calibration",
    "running_canary", "start_job",
]

log = logging.getLogger("exitplane.calibration")

FINISHED = ("succeeded", "failed")


@dataclass(frozen=True)
class CalibrationPolicy:
    """How much data a recalibration needs, and how long a job waits for it."""

    min_samples_per_layer: int = 1000
    lookback: timedelta = timedelta(hours=24)
    wait_max: timedelta = timedelta(hours=1)
    strategy: str = "calibrated"
    learn_fraction: float = 0.3  # of the non-holdout samples, spent on fitting the path
    seed: int = 0

    @classmethod
    def from_settings(cls, settings) -> CalibrationPolicy:
        return cls(min_samples_per_layer=settings.calibration_min_samples,
                   lookback=timedelta(seconds=settings.calibration_lookback_s),
                   wait_max=timedelta(seconds=settings.calibration_wait_max_s),
                   learn_fraction=settings.calibration_learn_fraction)


# -- jobs --------------------------------------------------------------------------------------

def request_calibration(*, session: Session, deployment: Deployment, actor: str,
                        trigger: str = "manual", alert_id: int | None = None,
                        since: datetime | None = None, until: datetime | None = None,
                        reason: str = "", policy: CalibrationPolicy = CalibrationPolicy(),
                        enqueue: bool = True) -> tuple[CalibrationJob, bool]:
    """Queue a recalibration, or return the one already open: (job, created)."""
    if trigger not in ("alert", "manual", "schedule"):
        raise Invalid(f"unknown trigger {trigger!r}; use alert, manual or schedule")
    now = utcnow()
    since = since or now - policy.lookback
    if until is not None and until <= since:
        raise Invalid(f"the sample window is empty: until {until} is not after since {since}")
    session.refresh(deployment, with_for_update=True)  # one open job per deployment
    open_job = session.scalars(
        select(CalibrationJob).where(CalibrationJob.deployment_id == deployment.id,
                                     CalibrationJob.status.in_(OPEN_JOB_STATUSES))
        .order_by(CalibrationJob.id.desc()).limit(1)).one_or_none()
    if open_job is not None:
        return open_job, False
    job = CalibrationJob(deployment_id=deployment.id, trigger=trigger, alert_id=alert_id,
                         requested_by=actor, reason=reason, since=since, until=until,
                         status="queued", created_at=now, updated_at=now)
    session.add(job)
    session.flush()
    if enqueue:
        enqueue_task(session, "calibration.run", [job.id])
    return job, True


def get_job(*, session: Session, deployment: Deployment, job_id: int) -> CalibrationJob:
    job = session.get(CalibrationJob, job_id)
    if job is None or job.deployment_id != deployment.id:
        raise NotFound(f"deployment {deployment.name!r} has no calibration job {job_id}")
    return job


def list_jobs(*, session: Session, deployment: Deployment, limit: int = 50,
              before_id: int | None = None) -> list[CalibrationJob]:
    query = select(CalibrationJob).where(CalibrationJob.deployment_id == deployment.id)
    if before_id is not None:
        query = query.where(CalibrationJob.id < before_id)
    return list(session.scalars(query.order_by(CalibrationJob.id.desc()).limit(limit)))


def queued_job_ids(*, session: Session, older_than: datetime) -> list[int]:
    """Open jobs untouched since `older_than`: their task was lost or their worker died."""
    return list(session.scalars(
        select(CalibrationJob.id).where(CalibrationJob.status.in_(OPEN_JOB_STATUSES),
                                        CalibrationJob.updated_at < older_than)
        .order_by(CalibrationJob.id)))


def start_job(*, session: Session, job: CalibrationJob) -> bool:
    """Mark `job` running (its own short transaction, so operators see it); False if done."""
    session.refresh(job, with_for_update=True)
    if job.status in FINISHED:
        return False
    job.status, job.attempts = "running", job.attempts + 1
    job.started_at = job.updated_at = utcnow()
    session.flush()
    return True


@dataclass(frozen=True)
class ShadowWindow:
    """What a job calibrates on: its shadow samples and the quality target of that moment."""

    job_id: int
    signals: np.ndarray  # (n, L) float32, exit-layer order
    matched: np.ndarray  # (n, L) bool
    exit_layers: list[int]
    num_layers: int
    delta: float
    epsilon: float


def read_window(*, session: Session, job: CalibrationJob,
                now: datetime | None = None) -> ShadowWindow | None:
    """The job's shadow samples (None when the job is already finished)."""
    session.refresh(job)
    if job.status in FINISHED:
        return None
    deployment = session.get(Deployment, job.deployment_id)
    signals, matched = shadow_samples(session=session, deployment=deployment, since=job.since,
                                      until=job.until or now or utcnow())
    return ShadowWindow(job_id=job.id, signals=signals, matched=matched,
                        exit_layers=list(deployment.exit_layers),
                        num_layers=deployment.num_layers, delta=deployment.delta,
                        epsilon=deployment.epsilon)


def calibrate_window(window: ShadowWindow, policy: CalibrationPolicy = CalibrationPolicy()
                     ) -> CalibrationResult | NotEnoughShadowData:
    """Threshold selection on the window, outside any transaction (it takes seconds)."""
    try:
        return calibrate_thresholds(
            signals=window.signals, matched=window.matched, exit_layers=window.exit_layers,
            num_layers=window.num_layers, delta=window.delta, epsilon=window.epsilon,
            strategy=policy.strategy, min_samples_per_layer=policy.min_samples_per_layer,
            learn_fraction=policy.learn_fraction, seed=policy.seed)
    except NotEnoughShadowData as shortage:
        return shortage


def apply_outcome(*, session: Session, job: CalibrationJob,
                  outcome: CalibrationResult | NotEnoughShadowData,
                  policy: CalibrationPolicy = CalibrationPolicy(),
                  now: datetime | None = None) -> CalibrationJob:
    """Record the outcome and, for a publishable result, publish + promote the candidate: one
    transaction under the job's row lock; a job finished meanwhile is left as it is."""
    session.refresh(job, with_for_update=True)
    if job.status in FINISHED:
        return job
    now = now or utcnow()
    job.updated_at = now
    if isinstance(outcome, NotEnoughShadowData):
        _not_enough_data(job=job, shortage=outcome, policy=policy, now=now)
        session.flush()
        return job
    deployment = session.get(Deployment, job.deployment_id)
    _record_result(job=job, result=outcome)
    refusal = _refusal(result=outcome, deployment=deployment)
    if refusal and _waits_for_more(job=job, result=outcome, policy=policy, now=now):
        job.status = "waiting_for_data"
        job.status_reason = (f"{refusal} Waiting for more shadow samples: the window grows "
                             f"until {policy.wait_max.total_seconds():.0f} s after the request.")
        session.flush()
        return job
    if refusal:
        _finish(job, "failed", refusal, now)
        session.flush()
        log.warning("%s: calibration job %d failed: %s", deployment.name, job.id, refusal)
        return job
    active = aliases_of(session=session, deployment=deployment).get("active")
    candidate = publish(
        session=session, deployment=deployment, thresholds=outcome.thresholds,
        origin=Origin.calibration, parent_version=active, calibration_job_id=job.id,
        actor=f"calibration-job-{job.id}", expected_metrics=expected_metrics(outcome),
        reason=f"calibration job {job.id} ({job.trigger}): {outcome.samples['total']} shadow "
               f"samples, disagreement <= {outcome.delta} with probability >= "
               f"{1 - outcome.epsilon:g}")
    job.result_version = candidate.version
    _apply_policy(session=session, deployment=deployment, job=job, candidate=candidate)
    _finish(job, "succeeded", f"published version {candidate.version} ({job.promotion})", now)
    session.flush()
    log.info("%s: calibration job %d published version %d (%s): exit rate %.3f, risk bound "
             "%.4f", deployment.name, job.id, candidate.version, job.promotion,
             outcome.exit_rate, outcome.risk_bound)
    return job


def run_calibration(*, session: Session, job: CalibrationJob,
                    policy: CalibrationPolicy = CalibrationPolicy(),
                    now: datetime | None = None) -> CalibrationJob:
    """Read, calibrate and apply in the caller's one transaction (the worker task runs the
    three steps in separate short transactions instead); a finished job is returned
    unchanged."""
    window = read_window(session=session, job=job, now=now)
    if window is None:
        return job
    return apply_outcome(session=session, job=job, outcome=calibrate_window(window, policy),
                         policy=policy, now=now)


def expected_metrics(result: CalibrationResult) -> dict:
    """What the drift monitor and the canary compare live behaviour with."""
    return {
        "exit_rate": {str(lc.layer): lc.exit_rate for lc in result.layers},
        "conditional_exit_rate": {str(lc.layer): lc.conditional_exit_rate
                                  for lc in result.layers},
        "total_exit_rate": result.exit_rate,
        "risk": result.risk,
        "risk_bound": result.risk_bound,
        "p_value": result.p_value,
        "delta": result.delta,
        "epsilon": result.epsilon,
        "mean_depth": result.mean_depth,
        "speedup": result.speedup,
        "holdout_disagreement": result.holdout.disagreement if result.holdout else None,
        "samples": result.samples,
    }


def _not_enough_data(*, job: CalibrationJob, shortage: NotEnoughShadowData,
                     policy: CalibrationPolicy, now: datetime) -> None:
    job.summary = {"counts": {str(k): v for k, v in shortage.counts.items()},
                   "required": shortage.required}
    if now - job.created_at >= policy.wait_max:
        _finish(job, "failed", f"{shortage} (gave up after waiting "
                               f"{policy.wait_max.total_seconds():.0f} s)", now)
    else:
        job.status, job.status_reason = "waiting_for_data", str(shortage)


def _record_result(*, job: CalibrationJob, result: CalibrationResult) -> None:
    job.layers = [{"layer": lc.layer, "threshold": lc.threshold, "risk": lc.risk,
                   "risk_bound": lc.risk_bound, "p_value": lc.p_value,
                   "exit_rate": lc.exit_rate, "conditional_exit_rate": lc.conditional_exit_rate,
                   "conditional_disagreement": lc.conditional_disagreement,
                   "samples": lc.samples, "match_curve": [list(p) for p in lc.match_curve]}
                  for lc in result.layers]
    job.curve = [{"level": p.level, "thresholds": {str(k): v for k, v in p.thresholds.items()},
                  "risk": p.risk, "risk_bound": p.risk_bound, "p_value": p.p_value,
                  "predicted_disagreement": p.predicted_disagreement,
                  "certified": p.certified, "exit_rate": p.exit_rate,
                  "mean_depth": p.mean_depth, "speedup": p.speedup, "chosen": p.chosen}
                 for p in result.curve]
    holdout = result.holdout
    job.summary = {
        "thresholds": {str(k): v for k, v in result.thresholds.items()},
        "risk": result.risk, "risk_bound": result.risk_bound, "p_value": result.p_value,
        "exit_rate": result.exit_rate, "mean_depth": result.mean_depth,
        "speedup": result.speedup, "delta": result.delta, "epsilon": result.epsilon,
        "strategy": result.strategy, "samples": result.samples, "notes": result.notes,
        "holdout": None if holdout is None else {
            "tokens": holdout.tokens, "disagreements": holdout.disagreements,
            "disagreement": holdout.disagreement, "exit_rate": holdout.exit_rate,
            "mean_depth": holdout.mean_depth, "p_value": holdout.p_value,
            "passed": holdout.passed},
    }


def _nothing_certified(result: CalibrationResult) -> bool:
    return result.exit_rate == 0.0 and all(t >= 1.0 for t in result.thresholds.values())


def _waits_for_more(*, job: CalibrationJob, result: CalibrationResult,
                    policy: CalibrationPolicy, now: datetime) -> bool:
    """An automatic job whose open window certified nothing yet waits for the window to grow
    (as it waits for a minimum of samples) instead of failing; a manual job reports at once,
    and so does a fixed window, which more waiting cannot change."""
    return (job.trigger != "manual" and job.until is None and _nothing_certified(result)
            and now - job.created_at < policy.wait_max)


def _refusal(*, result: CalibrationResult, deployment: Deployment) -> str:
    """Why the result must not be published ("" when it may)."""
    if _nothing_certified(result):
        return (f"no exit step could be certified at δ={deployment.delta}, "
                f"ε={deployment.epsilon} on these samples; the current active set stays. "
                "Widen the window, collect more shadow samples or retrain the exit heads.")
    if result.holdout is not None and not result.holdout.passed:
        h = result.holdout
        return (f"holdout check failed: disagreement {h.disagreement:.4f} on {h.tokens} held-out "
                f"tokens is significantly above δ={deployment.delta} (p={h.p_value:.2g}); "
                "nothing was published")
    return ""


def _finish(job: CalibrationJob, status: str, reason: str, now: datetime) -> None:
    job.status, job.status_reason = status, reason
    job.finished_at = job.updated_at = now


def _apply_policy(*, session: Session, deployment: Deployment, job: CalibrationJob,
                  candidate: ThresholdSet) -> None:
    _supersede_pending(session=session, deployment=deployment, keep=job.id)
    actor = f"calibration-job-{job.id}"
    if deployment.policy == "auto":
        move_alias(session=session, deployment=deployment, alias="active",
                   version=candidate.version, actor=actor, action="alias.promote",
                   reason=f"calibration job {job.id}: policy auto promotes the candidate",
                   details={"calibration_job_id": job.id})
        job.promotion = "active"
    elif deployment.policy == "canary":
        start_canary(session=session, deployment=deployment, version=candidate.version,
                     job_id=job.id, actor=actor)
        job.promotion = "canary"
    else:
        job.promotion = "awaiting_approval"


def _supersede_pending(*, session: Session, deployment: Deployment, keep: int) -> None:
    """A newer candidate replaces one still waiting for approval."""
    pending = session.scalars(select(CalibrationJob).where(
        CalibrationJob.deployment_id == deployment.id, CalibrationJob.id != keep,
        CalibrationJob.promotion == "awaiting_approval"))
    for old in pending:
        old.promotion, old.updated_at = "superseded", utcnow()


# -- operator decisions ------------------------------------------------------------------------

def approve(*, session: Session, deployment: Deployment, job: CalibrationJob, actor: str,
            reason: str) -> CalibrationJob:
    """Promote a candidate waiting for approval, or one whose canary paused."""
    session.refresh(job, with_for_update=True)
    canary = _canary_of(session=session, job=job)
    if canary is not None:
        promote_canary(session=session, deployment=deployment, run=canary, actor=actor,
                       reason=f"approved: {reason}")
    elif job.promotion == "awaiting_approval":
        move_alias(session=session, deployment=deployment, alias="active",
                   version=job.result_version, actor=actor, action="alias.promote",
                   reason=f"approved calibration job {job.id}: {reason}",
                   details={"calibration_job_id": job.id})
        job.promotion = "approved"
    else:
        raise Conflict(f"calibration job {job.id} has no candidate waiting for a decision "
                       f"(status {job.status}, promotion {job.promotion})")
    job.decided_by, job.updated_at = actor, utcnow()
    session.flush()
    return job


def reject(*, session: Session, deployment: Deployment, job: CalibrationJob, actor: str,
           reason: str) -> CalibrationJob:
    """Refuse a candidate waiting for approval, or revert its running or paused canary."""
    session.refresh(job, with_for_update=True)
    canary = _canary_of(session=session, job=job)
    if canary is not None:
        revert_canary(session=session, deployment=deployment, run=canary, actor=actor,
                      reason=f"rejected: {reason}", fire_alert=False)
    elif job.promotion == "awaiting_approval":
        job.promotion = "rejected"
        record_audit(session=session, deployment=deployment, actor=actor,
                     action="candidate.reject", reason=reason, to_version=job.result_version,
                     details={"calibration_job_id": job.id})
    else:
        raise Conflict(f"calibration job {job.id} has no candidate waiting for a decision "
                       f"(status {job.status}, promotion {job.promotion})")
    job.decided_by, job.updated_at = actor, utcnow()
    session.flush()
    return job


def _canary_of(*, session: Session, job: CalibrationJob) -> CanaryRun | None:
    return session.scalars(select(CanaryRun).where(
        CanaryRun.job_id == job.id, CanaryRun.status.in_(("running", "paused")))
        .with_for_update()).one_or_none()
