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

Traffic segments: a job with a `segment` calibrates that segment alone on its own
shadow tokens, at `segments.recalibration_level` (a (1-a)^(k-1), a = 1-(1-ε)^(1/k); k: 'default'
plus the deployment's known segments), which keeps the joint statement with the maps the other
segments hold by the union bound, and publishes the active set with only that segment's map
replaced. A whole-deployment job whose window holds tokens of named segments runs
`calibrate_segments` (each segment large enough its own LTT, ε split by Šidák across them;
each one too small the pooled set when it is certified on the segment at ε/k; else never exit)
and publishes one version with every segment's map; what each segment got and why is in the
job's `summary["segments"]`.

Request-level guarantee: shadow tokens are read with their request ids (a sample stored without
one stands for its telemetry batch, a larger and so more conservative cluster), so every
calibration tests its thresholds at the request level (`calibration.learn_then_test`, "the
request-level test"); the job's summary names the test (`risk_unit`, `design_effect`) and
counts requests.

The automatic fallback lives in `controlplane.calibration.fallback` and the canary in
`controlplane.calibration.canary` (its functions are re-exported here).
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field, replace
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
from controlplane.calibration.learn_then_test import (
    CalibrationResult,
    NotEnoughShadowData,
    calibrate_thresholds,
)
from controlplane.calibration.models import OPEN_JOB_STATUSES, CalibrationJob, CanaryRun
from controlplane.calibration.promotion import PromotionBounds, promotion_hold
from controlplane.calibration.segments import (
    SegmentedCalibration,
    calibrate_segments,
    path_borrowing,
    recalibration_level,
)
from controlplane.db import utcnow
from controlplane.deployments.models import Deployment, ThresholdSet
from controlplane.deployments.segment_sets import replace_segment_map
from controlplane.deployments.segments import known_segments
from controlplane.deployments.service import (
    aliases_of,
    get_threshold_set,
    move_alias,
    publish,
    record_audit,
)
from controlplane.drift.outliers import screen_evidence
from controlplane.drift.window_checks import DriftOptions
from controlplane.errors import Conflict, Invalid, NotFound
from controlplane.outbox import enqueue_task
from controlplane.runtimes.outliers import excluded_runtime_ids
from controlplane.settings import get_settings
from controlplane.stats.robust_evidence import EvidencePolicy, cap_runtime_share
from controlplane.telemetry.service import shadow_evidence
from exitplane.wire import DEFAULT_SEGMENT, Origin

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
    # None: each job draws a random seed (recorded in its summary), so which witnesses and
    # requests the holdout takes cannot be computed in advance; an int replays a job
    seed: int | None = None
    evidence: EvidencePolicy = field(default_factory=EvidencePolicy)
    bounds: PromotionBounds = field(default_factory=PromotionBounds)

    @classmethod
    def from_settings(cls, settings) -> CalibrationPolicy:
        return cls(min_samples_per_layer=settings.calibration_min_samples,
                   lookback=timedelta(seconds=settings.calibration_lookback_s),
                   wait_max=timedelta(seconds=settings.calibration_wait_max_s),
                   learn_fraction=settings.calibration_learn_fraction,
                   evidence=EvidencePolicy.from_settings(settings),
                   bounds=PromotionBounds.from_settings(settings))


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
    if trigger not in ("alert", "manual", "schedule"):
        raise Invalid(f"unknown trigger {trigger!r}; use alert, manual or schedule")
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


def read_window(*, session: Session, job: CalibrationJob, now: datetime | None = None,
                seed: int | None = None) -> ShadowWindow | None:
    """The job's shadow samples (None when the job is already finished); a segment job's come
    with the other segments' shadow tokens of the same window, which its path may borrow.
    `seed`: the job's random draws (None: a fresh random one, recorded in the job's
    summary). The evidence is screened first, witness by witness, over the whole window and
    every version in it (`screen_window`): an outlier witness is set aside and left out."""
    window = _read_window(session=session, job=job, now=now, seed=seed)
    if window is None:
        return None
    return screen_window(session=session, job=job, window=window, now=now or utcnow())


def screen_window(*, session: Session, job: CalibrationJob, window: ShadowWindow,
                  now: datetime) -> ShadowWindow:
    """`window` without the witnesses the outlier screen sets aside on it, segment by segment
    (`drift.outliers.screen_evidence`, on the evidence this calibration is about to use:
    every version of its window, so evidence stamped with another version or outside the drift
    check's recent minutes is screened all the same). Those it sets aside are recorded in the
    job's summary."""
    if window.witnesses is None or window.requests is None or not len(window.witnesses):
        return window
    deployment = session.get(Deployment, job.deployment_id)
    settings = get_settings()
    options = DriftOptions.from_settings(settings)
    labels = (window.segments if window.segments is not None
              else np.full(len(window.witnesses), window.segment or DEFAULT_SEGMENT))
    names = sorted(set(labels.tolist()))
    alpha = options.quality_alpha_per_hour * options.check_interval_s / 3600.0 / len(names)
    set_aside = []
    for name in names:
        mine = labels == name
        set_aside += screen_evidence(
            session=session, deployment=deployment, requests=window.requests[mine],
            witnesses=window.witnesses[mine], signals=window.signals[mine],
            matched=window.matched[mine], thresholds=None, alpha=alpha,
            min_requests=options.outlier_min_requests,
            robust_min_runtimes=settings.evidence_robust_min_runtimes, version=None,
            segment=name, window=(job.since, job.until or now), now=now,
            context=f"screening calibration job {job.id}'s evidence: ")
    if not set_aside:
        return window
    witnesses = sorted({record.witness for record in set_aside if record.witness})
    job.summary = {**(job.summary or {}), "witnesses_set_aside": witnesses}
    session.flush()  # kept when the job's row is read again under its lock (`apply_outcome`)
    keep = ~np.isin(window.witnesses, witnesses)
    log.warning("%s: calibration job %d set aside %d witness(es) before calibrating: %s",
                deployment.name, job.id, len(witnesses), ", ".join(witnesses))
    return replace(window, signals=window.signals[keep], matched=window.matched[keep],
                   requests=window.requests[keep], witnesses=window.witnesses[keep],
                   segments=None if window.segments is None else window.segments[keep])


def _read_window(*, session: Session, job: CalibrationJob, now: datetime | None,
                 seed: int | None) -> ShadowWindow | None:
    session.refresh(job)
    if job.status in FINISHED:
        return None
    deployment = session.get(Deployment, job.deployment_id)
    until = job.until or now or utcnow()
    seed = secrets.randbits(31) if seed is None else seed
    job.summary = {**(job.summary or {}), "seed": seed}
    session.flush()
    shape = dict(job_id=job.id, exit_layers=list(deployment.exit_layers),
                 num_layers=deployment.num_layers, delta=deployment.delta, seed=seed)
    known = known_segments(session=session, deployment_id=deployment.id)
    exclude = excluded_runtime_ids(session=session, deployment_id=deployment.id)
    if job.segment is not None:
        own = shadow_evidence(session=session, deployment=deployment, since=job.since,
                              until=until, segment=job.segment, exclude=exclude)
        others = [shadow_evidence(session=session, deployment=deployment, since=job.since,
                                  until=until, segment=name, exclude=exclude)
                  for name in [DEFAULT_SEGMENT, *known] if name != job.segment]
        others = [(part.signals, part.matched) for part in others if len(part.requests)]
        # Its share of the joint ε beside the maps the others hold (`calibration.segments`).
        return ShadowWindow(signals=own.signals, matched=own.matched, segment=job.segment,
                            requests=own.keyed_requests(),
                            witnesses=np.asarray(own.witnesses, dtype=str),
                            epsilon=recalibration_level(deployment.epsilon, 1 + len(known)),
                            borrowed=(np.concatenate([part[0] for part in others]),
                                      np.concatenate([part[1] for part in others]))
                            if others else None, **shape)
    if known:
        window = _segmented_window(session=session, deployment=deployment, since=job.since,
                                   until=until, names=[DEFAULT_SEGMENT, *known], shape=shape,
                                   exclude=exclude)
        if window is not None:
            return window
    found = shadow_evidence(session=session, deployment=deployment, since=job.since,
                            until=until, exclude=exclude)
    return ShadowWindow(signals=found.signals, matched=found.matched,
                        epsilon=deployment.epsilon, requests=found.keyed_requests(),
                        witnesses=np.asarray(found.witnesses, dtype=str), **shape)


def _segmented_window(*, session: Session, deployment: Deployment, since: datetime,
                      until: datetime, names: list[str], shape: dict,
                      exclude: set[str]) -> ShadowWindow | None:
    """Every segment's shadow tokens with their segment, request and runtime ids; None when
    only 'default' has any (the window is then calibrated as before segments existed)."""
    parts = {name: shadow_evidence(session=session, deployment=deployment, since=since,
                                   until=until, segment=name, exclude=exclude)
             for name in names}
    parts = {name: part for name, part in parts.items() if len(part.requests)}
    if set(parts) <= {DEFAULT_SEGMENT}:
        return None
    # Request ids are unique per segment only as far as the runtime made them so: keep them
    # apart, so that the pooled set's check tokens never split a request across segments.
    return ShadowWindow(
        signals=np.concatenate([part.signals for part in parts.values()]),
        matched=np.concatenate([part.matched for part in parts.values()]),
        segments=np.concatenate([np.full(len(part.requests), name, dtype=object)
                                 for name, part in parts.items()]).astype(str),
        requests=np.concatenate([np.char.add(f"{name}/", part.keyed_requests())
                                 for name, part in parts.items()]),
        witnesses=np.concatenate([np.asarray(part.witnesses, dtype=str)
                                  for part in parts.values()]),
        epsilon=deployment.epsilon, **shape)


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
    if window.segments is not None:
        return calibrate_segments(
            signals=window.signals, matched=window.matched, segments=window.segments,
            requests=window.requests, exit_layers=window.exit_layers, **robust,
            num_layers=window.num_layers, delta=window.delta, epsilon=window.epsilon,
            strategy=policy.strategy, min_samples_per_layer=policy.min_samples_per_layer,
            learn_fraction=policy.learn_fraction, seed=window.seed)
    try:
        return calibrate_thresholds(
            signals=window.signals, matched=window.matched, exit_layers=window.exit_layers,
            requests=window.requests,
            num_layers=window.num_layers, delta=window.delta, epsilon=window.epsilon,
            strategy=policy.strategy, min_samples_per_layer=policy.min_samples_per_layer,
            learn_fraction=policy.learn_fraction, seed=window.seed, **robust,
            **path_borrowing(len(window.signals), window.borrowed))
    except NotEnoughShadowData as shortage:
        return shortage


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


def apply_outcome(*, session: Session, job: CalibrationJob, outcome: Outcome,
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
    if isinstance(outcome, SegmentedCalibration):
        return _apply_segmented(session=session, deployment=deployment, job=job,
                                outcome=outcome, policy=policy, now=now)
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
    thresholds, segments, metrics = dict(outcome.thresholds), None, expected_metrics(outcome)
    scope = ""
    if job.segment is not None:
        # Only this segment's map changes; every other segment keeps the active set's.
        active_set = get_threshold_set(session=session, deployment=deployment, version=active)
        thresholds, segments = replace_segment_map(active_set, job.segment, outcome.thresholds)
        metrics = _segment_metrics(active_set.expected_metrics or {}, job.segment, metrics)
        scope = f" of segment {job.segment}"
    candidate = publish(
        session=session, deployment=deployment, thresholds=thresholds, segments=segments,
        origin=Origin.calibration, parent_version=active, calibration_job_id=job.id,
        actor=f"calibration-job-{job.id}", expected_metrics=metrics,
        reason=f"calibration job {job.id} ({job.trigger}){scope}: {outcome.samples['total']} "
               f"shadow samples{_requests_note(outcome)}, disagreement <= {outcome.delta} "
               f"with probability >= {1 - outcome.epsilon:g}")
    job.result_version = candidate.version
    _apply_policy(session=session, deployment=deployment, job=job, candidate=candidate,
                  policy=policy, now=now)
    _finish(job, "succeeded", f"published version {candidate.version} ({job.promotion})"
                              f"{_held(job)}", now)
    session.flush()
    log.info("%s: calibration job %d published version %d (%s): exit rate %.3f, risk bound "
             "%.4f", deployment.name, job.id, candidate.version, job.promotion,
             outcome.exit_rate, outcome.risk_bound)
    return job


def _segment_metrics(active_metrics: dict, segment: str, metrics: dict) -> dict:
    """A segment job's expected metrics: the active set's, with the recalibrated segment's
    replaced (the set's own for 'default', under `segments` for any other)."""
    others = dict(active_metrics.get("segments") or {})
    if segment == DEFAULT_SEGMENT:
        return metrics | ({"segments": others} if others else {})
    return active_metrics | {"segments": others | {segment: metrics}}


def _apply_segmented(*, session: Session, deployment: Deployment, job: CalibrationJob,
                     outcome: SegmentedCalibration, policy: CalibrationPolicy,
                     now: datetime) -> CalibrationJob:
    """Record each segment's outcome (under `summary["segments"]`) and publish one version
    with every segment's map, unless no segment may exit at all (an automatic job with an open
    window then waits for more samples, as an unsegmented one does)."""
    lead = _lead_result(outcome)
    if lead is not None:
        _record_result(job=job, result=lead)
    report = outcome.summary()
    job.summary = {**(job.summary or {}), "segments": report["segments"],
                   "segmented": {key: value for key, value in report.items()
                                 if key != "segments"}}
    exiting = [name for name, seg in outcome.segments.items() if seg.exits]
    failed = [f"{name} (disagreement {seg.result.holdout.disagreement:.4f} on "
              f"{seg.result.holdout.tokens} held-out tokens)"
              for name, seg in sorted(outcome.segments.items())
              if seg.source == "segment" and seg.result is not None
              and seg.result.holdout is not None and not seg.result.holdout.passed]
    if failed:
        # As for one set: a held-out check significantly above δ publishes nothing.
        _finish(job, "failed", f"holdout check failed for segment {', '.join(failed)}: "
                               f"significantly above δ={deployment.delta}; nothing was "
                               "published", now)
        session.flush()
        return job
    if not exiting and all(value >= 1.0 for value in outcome.thresholds.values()):
        refusal = (f"no segment could be certified at δ={deployment.delta}, "
                   f"ε={deployment.epsilon} (split over {len(outcome.segments)} segments, "
                   f"{outcome.split}); the current "
                   "active set stays.")
        if (job.trigger != "manual" and job.until is None
                and now - job.created_at < policy.wait_max):
            job.status = "waiting_for_data"
            job.status_reason = (f"{refusal} Waiting for more shadow samples: the window "
                                 f"grows until {policy.wait_max.total_seconds():.0f} s after "
                                 "the request.")
        else:
            _finish(job, "failed", refusal, now)
        session.flush()
        return job
    active = aliases_of(session=session, deployment=deployment).get("active")
    metrics = expected_metrics(lead) if (
        lead is not None and outcome.segments.get(DEFAULT_SEGMENT) is not None
        and outcome.segments[DEFAULT_SEGMENT].source == "segment") else {
        "delta": outcome.delta, "epsilon": outcome.epsilon}
    own = {name: expected_metrics(seg.result) for name, seg in outcome.segments.items()
           if name != DEFAULT_SEGMENT and seg.source == "segment" and seg.result is not None}
    # a segment that takes the pooled set is bounded by the pooled set's figures
    own |= {name: expected_metrics(outcome.pooled) for name, seg in outcome.segments.items()
            if name != DEFAULT_SEGMENT and seg.source == "pooled" and outcome.pooled is not None}
    if own:
        metrics["segments"] = own
    metrics["epsilon_per_segment"] = outcome.epsilon_per_segment
    sources = ", ".join(f"{name}: {seg.source}" for name, seg in sorted(outcome.segments.items()))
    candidate = publish(
        session=session, deployment=deployment, thresholds=outcome.thresholds,
        segments=outcome.segment_thresholds() or None, origin=Origin.calibration,
        parent_version=active, calibration_job_id=job.id, actor=f"calibration-job-{job.id}",
        expected_metrics=metrics,
        reason=f"calibration job {job.id} ({job.trigger}) per segment ({sources}): every "
               f"segment's disagreement <= {outcome.delta} jointly with probability >= "
               f"{1 - outcome.epsilon:g}")
    job.result_version = candidate.version
    _apply_policy(session=session, deployment=deployment, job=job, candidate=candidate,
                  policy=policy, now=now)
    _finish(job, "succeeded", f"published version {candidate.version} ({job.promotion}) with "
                              f"thresholds per segment ({sources}){_held(job)}", now)
    session.flush()
    log.info("%s: calibration job %d published version %d per segment (%s)", deployment.name,
             job.id, candidate.version, sources)
    return job


def _lead_result(outcome: SegmentedCalibration) -> CalibrationResult | None:
    """What the job's per-layer figures and curve show: the default segment's own LTT, else
    the pooled set's."""
    default = outcome.segments.get(DEFAULT_SEGMENT)
    if default is not None and default.source == "segment":
        return default.result
    return outcome.pooled


def run_calibration(*, session: Session, job: CalibrationJob,
                    policy: CalibrationPolicy = CalibrationPolicy(),
                    now: datetime | None = None) -> CalibrationJob:
    """Read, calibrate and apply in the caller's one transaction (the worker task runs the
    three steps in separate short transactions instead); a finished job is returned
    unchanged."""
    window = read_window(session=session, job=job, now=now, seed=policy.seed)
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
        # the chosen set's exit rate on the median witness's evidence (`promotion` bounds the
        # rise by the larger of this and total_exit_rate: no minority of witnesses sets it)
        "median_witness_exit_rate": float(np.median(list(result.witness_exit_rates.values())))
        if result.witness_exit_rates else None,
        "witnesses": len(result.witness_exit_rates),
    }


def _not_enough_data(*, job: CalibrationJob, shortage: NotEnoughShadowData,
                     policy: CalibrationPolicy, now: datetime) -> None:
    job.summary = {**_kept(job),
                   "counts": {str(k): v for k, v in shortage.counts.items()},
                   "required": shortage.required}
    if now - job.created_at >= policy.wait_max:
        _finish(job, "failed", f"{shortage} (gave up after waiting "
                               f"{policy.wait_max.total_seconds():.0f} s)", now)
    else:
        job.status, job.status_reason = "waiting_for_data", str(shortage)


def _kept(job: CalibrationJob) -> dict:
    """What a job's summary keeps from its reading of the window: its seed and the witnesses
    its screen set aside."""
    return {key: value for key, value in (job.summary or {}).items()
            if key in ("seed", "witnesses_set_aside")}


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
        **_kept(job),
        "thresholds": {str(k): v for k, v in result.thresholds.items()},
        "risk": result.risk, "risk_bound": result.risk_bound, "p_value": result.p_value,
        "exit_rate": result.exit_rate, "mean_depth": result.mean_depth,
        "speedup": result.speedup, "delta": result.delta, "epsilon": result.epsilon,
        "strategy": result.strategy, "samples": result.samples, "notes": result.notes,
        "risk_test": result.risk_test, "risk_unit": result.risk_unit,
        "design_effect": result.design_effect,
        "holdout": None if holdout is None else {
            "tokens": holdout.tokens, "disagreements": holdout.disagreements,
            "disagreement": holdout.disagreement, "exit_rate": holdout.exit_rate,
            "mean_depth": holdout.mean_depth, "p_value": holdout.p_value,
            "passed": holdout.passed},
    }


def _requests_note(result: CalibrationResult) -> str:
    """' of N requests (tested per request)' when the test ran at the request level."""
    if result.risk_unit != "request":
        return " (tokens tested as independent)"
    return f" of {result.samples['requests']} requests (tested per request)"


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
                  candidate: ThresholdSet, policy: CalibrationPolicy, now: datetime) -> None:
    _supersede_pending(session=session, deployment=deployment, keep=job.id)
    actor = f"calibration-job-{job.id}"
    aliases = aliases_of(session=session, deployment=deployment)
    hold = "" if deployment.policy == "approval" else promotion_hold(
        session=session, deployment=deployment, candidate=candidate,
        active=get_threshold_set(session=session, deployment=deployment,
                                 version=aliases["active"]),
        conservative=aliases.get("conservative"), since=job.since, until=job.until or now,
        bounds=policy.bounds)
    if hold:
        job.promotion = "awaiting_approval"
        job.summary = {**(job.summary or {}), "promotion_hold": hold}
        record_audit(session=session, deployment=deployment, actor=actor,
                     action="candidate.hold", reason=hold, to_version=candidate.version,
                     details={"calibration_job_id": job.id})
        log.warning("%s: calibration job %d waits for approval: %s", deployment.name, job.id,
                    hold)
    elif deployment.policy == "auto":
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


def _held(job: CalibrationJob) -> str:
    """'; <why it waits>' when the promotion bounds held the candidate back."""
    hold = (job.summary or {}).get("promotion_hold")
    return f"; {hold}" if hold else ""


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
