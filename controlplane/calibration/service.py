"""Recalibration jobs: request, list and start them; calibrate a job's shadow window
(Learn-Then-Test on in-domain shadow samples, outside any transaction) and record what came of
it on the job. Plain functions.

The flow that reads a job's window, publishes its candidate and applies the deployment's
policy (promotion, canary, approval) is `controlplane.flows.recalibration`.

Traffic segments: a job with a `segment` calibrates that segment alone on its own
shadow tokens, at `segments.recalibration_level` (a (1-a)^(k-1), a = 1-(1-ε)^(1/k); k: 'default'
plus the deployment's known segments), which keeps the joint statement with the maps the other
segments hold by the union bound. A whole-deployment job whose window holds tokens of named
segments runs `calibrate_segments` (each segment large enough its own LTT, ε split by Šidák
across them; each one too small the pooled set when it is certified on the segment at ε/k; else
never exit); what each segment got and why is in the job's `summary["segments"]`.

Request-level guarantee: shadow tokens are read with their request ids (a sample stored without
one stands for its telemetry batch, a larger and so more conservative cluster), so every
calibration tests its thresholds at the request level (`calibration.learn_then_test`, "the
request-level test"); the job's summary names the test (`risk_unit`, `design_effect`) and
counts requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.calibration.answers import AnswerTarget, NotEnoughShadowRequests
from controlplane.calibration.learn_then_test import (
    CalibrationResult,
    NotEnoughShadowData,
    calibrate_thresholds,
)
from controlplane.calibration.models import OPEN_JOB_STATUSES, TRIGGERS, CalibrationJob
from controlplane.calibration.promotion import PromotionBounds
from controlplane.calibration.segments import (
    SegmentedCalibration,
    calibrate_segments,
    path_borrowing,
)
from controlplane.db import utcnow
from controlplane.deployments.audit import record_audit
from controlplane.deployments.models import Deployment
from controlplane.deployments.segments import known_segments
from controlplane.errors import Invalid, NotFound
from controlplane.outbox import enqueue_task
from controlplane.stats.robust_evidence import EvidencePolicy, cap_runtime_share
from controlplane.telemetry.shadow_requests import ShadowRequests
from exitplane.wire import DEFAULT_SEGMENT

FINISHED = ("succeeded", "failed")


@dataclass(frozen=True)
class CalibrationPolicy:
    """How much data a recalibration needs, and how long a job waits for it."""

    min_samples_per_layer: int = 1000
    lookback: timedelta = timedelta(hours=24)
    wait_max: timedelta = timedelta(hours=1)
    strategy: str = "calibrated"
    learn_fraction: float = 0.3  # of the non-holdout samples, spent on fitting the path
    # None: each job draws a random seed (recorded in its summary), so which witnesses and
    # requests the holdout takes cannot be computed in advance; an int replays a job
    seed: int | None = None
    evidence: EvidencePolicy = field(default_factory=EvidencePolicy)
    bounds: PromotionBounds = field(default_factory=PromotionBounds)
    # shadow requests an answer target's test needs (`answers.NotEnoughShadowRequests`)
    min_shadow_requests: int = 200

    @classmethod
    def from_settings(cls, settings) -> CalibrationPolicy:
        return cls(min_samples_per_layer=settings.calibration_min_samples,
                   lookback=timedelta(seconds=settings.calibration_lookback_s),
                   wait_max=timedelta(seconds=settings.calibration_wait_max_s),
                   learn_fraction=settings.calibration_learn_fraction,
                   evidence=EvidencePolicy.from_settings(settings),
                   bounds=PromotionBounds.from_settings(settings),
                   min_shadow_requests=settings.min_shadow_requests)


# -- jobs --------------------------------------------------------------------------------------


def request_calibration(*, session: Session, deployment: Deployment, actor: str,
                        trigger: str = "manual", alert_id: int | None = None,
                        since: datetime | None = None, until: datetime | None = None,
                        reason: str = "", policy: CalibrationPolicy = CalibrationPolicy(),
                        enqueue: bool = True, segment: str | None = None
                        ) -> tuple[CalibrationJob, bool]:
    """Queue a recalibration, or return the one already open for the same scope: (job,
    created). `segment`: recalibrate that traffic segment alone (its shadow tokens, its map);
    None: the whole deployment."""
    if trigger not in TRIGGERS:
        raise Invalid(f"unknown trigger {trigger!r}; use one of {', '.join(TRIGGERS)}")
    if segment not in (None, DEFAULT_SEGMENT) and segment not in known_segments(
            session=session, deployment_id=deployment.id):
        raise Invalid(f"deployment {deployment.name!r} knows no traffic segment {segment!r}; "
                      "use 'default' or a segment its traffic or a threshold set named")
    now = utcnow()
    since = since or now - policy.lookback
    if until is not None and until <= since:
        raise Invalid(f"the sample window is empty: until {until} is not after since {since}")
    session.refresh(deployment, with_for_update=True)  # one open job per deployment + scope
    scope = (CalibrationJob.segment.is_(None) if segment is None
             else CalibrationJob.segment == segment)
    open_job = session.scalars(
        select(CalibrationJob).where(CalibrationJob.deployment_id == deployment.id,
                                     CalibrationJob.status.in_(OPEN_JOB_STATUSES), scope)
        .order_by(CalibrationJob.id.desc()).limit(1)).one_or_none()
    if open_job is not None:
        return open_job, False
    job = CalibrationJob(deployment_id=deployment.id, trigger=trigger, alert_id=alert_id,
                         requested_by=actor, reason=reason, since=since, until=until,
                         segment=segment, status="queued", created_at=now, updated_at=now)
    session.add(job)
    session.flush()
    record_audit(session=session, deployment=deployment, actor=actor,
                 action="calibration.request", reason=reason,
                 details={"calibration_job_id": job.id, "trigger": trigger,
                          "segment": segment, "alert_id": alert_id})
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
    # The one segment a segment job calibrates (its tokens only), or, for a whole
    # deployment with segmented traffic, each token's segment; each token's request id (the
    # request-level test's clusters; None: tokens count as independent draws)
    segment: str | None = None
    segments: np.ndarray | None = None
    requests: np.ndarray | None = None
    # For a segment job, the other segments' shadow tokens of the same
    # window (signals, matched), which its path may borrow (`segments.path_borrowing`)
    borrowed: tuple[np.ndarray, np.ndarray] | None = None
    # each token's witness (the credential that posted it, `runtimes.witnesses`): no witness
    # holds more than its share, and the set must hold on witnesses it did not learn from
    # (`stats.robust_evidence`)
    witnesses: np.ndarray | None = None
    # the job's random seed (recorded in its summary): which witnesses and requests are held
    # out cannot be computed in advance
    seed: int = 0
    # The answer target (None: none) and its evidence: the window's complete shadow requests
    # (of the job's segment for a segment job), none of whose tokens is among `signals`, so
    # the path is never drawn from the requests that test it (`calibration.answers`)
    delta_answer: float | None = None
    answers: ShadowRequests | None = None


Outcome = CalibrationResult | NotEnoughShadowData | SegmentedCalibration


def calibrate_window(window: ShadowWindow, policy: CalibrationPolicy = CalibrationPolicy()
                     ) -> Outcome:
    """Threshold selection on the window, outside any transaction (it takes seconds): each
    segment its own Learn-Then-Test at its share of ε when the window is segmented
    (`calibrate_segments`), else one set. No runtime holds more than its share of the tokens,
    and the set must hold on runtimes it did not learn from (`stats.robust_evidence`)."""
    window = _capped(window, policy)
    robust = dict(runtimes=window.witnesses,
                  robust_min_runtimes=policy.evidence.robust_min_runtimes)
    answers = None
    if window.delta_answer is not None:
        evidence = window.answers if window.answers is not None else \
            ShadowRequests.empty(len(window.exit_layers))
        answers = AnswerTarget.of(evidence, delta_answer=window.delta_answer,
                                  policy=policy.evidence, seed=window.seed)
        if len(answers.evidence) < policy.min_shadow_requests:
            return NotEnoughShadowRequests(len(answers.evidence), policy.min_shadow_requests)
    if window.segments is not None:
        outcome = calibrate_segments(
            signals=window.signals, matched=window.matched, segments=window.segments,
            requests=window.requests, exit_layers=window.exit_layers, **robust,
            num_layers=window.num_layers, delta=window.delta, epsilon=window.epsilon,
            strategy=policy.strategy, min_samples_per_layer=policy.min_samples_per_layer,
            learn_fraction=policy.learn_fraction, seed=window.seed,
            **({} if answers is None else answers.segment_tests(set(window.segments.tolist()))))
        return outcome if answers is None else answers.recorded_segments(outcome)
    try:
        result = calibrate_thresholds(
            signals=window.signals, matched=window.matched, exit_layers=window.exit_layers,
            requests=window.requests,
            num_layers=window.num_layers, delta=window.delta, epsilon=window.epsilon,
            strategy=policy.strategy, min_samples_per_layer=policy.min_samples_per_layer,
            learn_fraction=policy.learn_fraction, seed=window.seed, **robust,
            answer_test=None if answers is None else answers.test().p_values,
            **path_borrowing(len(window.signals), window.borrowed))
    except NotEnoughShadowData as shortage:
        return shortage
    return result if answers is None else answers.recorded(result)


def _capped(window: ShadowWindow, policy: CalibrationPolicy) -> ShadowWindow:
    """The window with each witness's tokens cut to its share (`evidence.cap_runtime_share`)."""
    if window.witnesses is None or window.requests is None or not len(window.witnesses):
        return window
    keep = cap_runtime_share(window.witnesses, window.requests,
                             max_share=policy.evidence.max_runtime_share, seed=window.seed,
                             max_share_of_median=policy.evidence.max_share_of_median,
                             min_runtimes=policy.evidence.robust_min_runtimes)
    if keep.all():
        return window
    return replace(window, signals=window.signals[keep], matched=window.matched[keep],
                   requests=window.requests[keep], witnesses=window.witnesses[keep],
                   segments=None if window.segments is None else window.segments[keep])


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
        # the chosen set's exit rate on the median witness's evidence (`promotion` bounds the
        # rise by the larger of this and total_exit_rate: no minority of witnesses sets it)
        "median_witness_exit_rate": float(np.median(list(result.witness_exit_rates.values())))
        if result.witness_exit_rates else None,
        "witnesses": len(result.witness_exit_rates),
    }


# -- what came of a job ----------------------------------------------------------------------------


def record_shortage(*, job: CalibrationJob, shortage: NotEnoughShadowData,
                     policy: CalibrationPolicy, now: datetime) -> None:
    """Too few shadow samples: the job waits for more, or fails once it waited `wait_max`."""
    job.summary = {**_kept(job),
                   "counts": {str(k): v for k, v in shortage.counts.items()},
                   "required": shortage.required}
    if now - job.created_at >= policy.wait_max:
        finish(job, "failed", f"{shortage} (gave up after waiting "
                               f"{policy.wait_max.total_seconds():.0f} s)", now)
    else:
        job.status, job.status_reason = "waiting_for_data", str(shortage)


def _kept(job: CalibrationJob) -> dict:
    """What a job's summary keeps from its reading of the window: its seed and the witnesses
    its screen set aside."""
    return {key: value for key, value in (job.summary or {}).items()
            if key in ("seed", "witnesses_set_aside")}


def record_result(*, job: CalibrationJob, result: CalibrationResult) -> None:
    """The selection's per-layer figures, its curve and its summary, on the job."""
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
                  "mean_depth": p.mean_depth, "speedup": p.speedup, "chosen": p.chosen,
                  "answer_p_value": p.answer_p_value}
                 for p in result.curve]
    holdout = result.holdout
    job.summary = {
        **_kept(job),
        "thresholds": {str(k): v for k, v in result.thresholds.items()},
        "risk": result.risk, "risk_bound": result.risk_bound, "p_value": result.p_value,
        "exit_rate": result.exit_rate, "mean_depth": result.mean_depth,
        "speedup": result.speedup, "delta": result.delta, "epsilon": result.epsilon,
        "strategy": result.strategy, "samples": result.samples, "notes": result.notes,
        "risk_test": result.risk_test, "risk_unit": result.risk_unit,
        "design_effect": result.design_effect,
        "answers": result.answers,
        "holdout": None if holdout is None else {
            "tokens": holdout.tokens, "disagreements": holdout.disagreements,
            "disagreement": holdout.disagreement, "exit_rate": holdout.exit_rate,
            "mean_depth": holdout.mean_depth, "p_value": holdout.p_value,
            "passed": holdout.passed},
    }


def _nothing_certified(result: CalibrationResult) -> bool:
    return result.exit_rate == 0.0 and all(t >= 1.0 for t in result.thresholds.values())


def waits_for_more(*, job: CalibrationJob, result: CalibrationResult,
                    policy: CalibrationPolicy, now: datetime) -> bool:
    """An automatic job whose open window certified nothing yet waits for the window to grow
    (as it waits for a minimum of samples) instead of failing; a manual job reports at once,
    and so does a fixed window, which more waiting cannot change."""
    return (job.trigger != "manual" and job.until is None and _nothing_certified(result)
            and now - job.created_at < policy.wait_max)


def publish_refusal(*, result: CalibrationResult, deployment: Deployment) -> str:
    """Why the result must not be published ("" when it may)."""
    if _nothing_certified(result):
        target = "" if result.answers is None else \
            f" and δ_answer={result.answers['delta_answer']}"
        return (f"no exit step could be certified at δ={deployment.delta}{target}, "
                f"ε={deployment.epsilon} on these samples; the current active set stays. "
                "Widen the window, collect more shadow samples or retrain the exit heads.")
    if result.holdout is not None and not result.holdout.passed:
        h = result.holdout
        return (f"holdout check failed: disagreement {h.disagreement:.4f} on {h.tokens} held-out "
                f"tokens is significantly above δ={deployment.delta} (p={h.p_value:.2g}); "
                "nothing was published")
    return ""


def finish(job: CalibrationJob, status: str, reason: str, now: datetime) -> None:
    """Close the job with `status` and why."""
    job.status, job.status_reason = status, reason
    job.finished_at = job.updated_at = now
