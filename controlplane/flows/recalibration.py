"""The recalibration flow: a job's shadow window read and screened, its outcome recorded, its
candidate published and the deployment's policy applied; operators approve or reject.

It spans telemetry (the shadow evidence), runtimes and drift (witnesses set aside by the outlier
screen), calibration (the job and the statistics), deployments (publish, aliases), promotion
bounds and the canary. A run is three steps: `read_window` (the job's shadow samples),
`calibration.service.calibrate_window` (the statistics, outside any transaction) and
`apply_outcome`, which publishes the candidate, moves the alias and marks the job succeeded in
one transaction under the job's row lock (`_publish_candidate`, the one publish path for a
single set and for a set per segment). `run_calibration` does all three in the caller's
transaction; the worker task gives each its own so that the store is not held while the
statistics run.

Crash safety: a worker killed before `apply_outcome` commits leaves no version behind; the job
stays `running` (or `queued`) and a rerun starts again from the samples; a rerun after the
commit, or a duplicate run racing it, finds the job finished and does nothing.

A segment job publishes the active set with only that segment's map replaced; a
whole-deployment job over segmented traffic publishes one version with every segment's map.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import replace
from datetime import datetime

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.calibration.learn_then_test import CalibrationResult, NotEnoughShadowData
from controlplane.calibration.models import CalibrationJob, CanaryRun
from controlplane.calibration.promotion import promotion_hold
from controlplane.calibration.segments import SegmentedCalibration, recalibration_level
from controlplane.calibration.service import (
    FINISHED,
    CalibrationPolicy,
    Outcome,
    ShadowWindow,
    calibrate_window,
    expected_metrics,
    finish,
    publish_refusal,
    record_result,
    record_shortage,
    waits_for_more,
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
from controlplane.errors import Conflict
from controlplane.flows.canary import promote_canary, revert_canary, start_canary
from controlplane.runtimes.outliers import excluded_runtime_ids
from controlplane.settings import get_settings
from controlplane.telemetry.service import shadow_evidence
from controlplane.telemetry.shadow_requests import shadow_request_evidence
from exitplane.wire import DEFAULT_SEGMENT, Origin

log = logging.getLogger("exitplane.calibration")


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
    window = _with_answers(session=session, job=job, window=window, now=now or utcnow())
    return screen_window(session=session, job=job, window=window, now=now or utcnow())


def _with_answers(*, session: Session, job: CalibrationJob, window: ShadowWindow,
                  now: datetime) -> ShadowWindow:
    """With an answer target, the window's complete shadow requests (the job's segment's for
    a segment job) under the trust rules, and the shadow tokens without theirs: the path is
    then never drawn from the requests that test the answer target. Without one, `window`."""
    deployment = session.get(Deployment, job.deployment_id)
    if deployment.delta_answer is None:
        return window
    answers = shadow_request_evidence(
        session=session, deployment_id=deployment.id, width=len(deployment.exit_layers),
        since=job.since, until=job.until or now, segment=job.segment)
    # the same keys the window's requests carry (segment-prefixed in a segmented window)
    keys = answers.keyed_requests()
    if window.segments is not None:
        keys = np.char.add(np.char.add(np.asarray(answers.segments, dtype=str), "/"), keys)
    keep = ~np.isin(window.requests, keys) if window.requests is not None and len(keys) \
        else np.ones(len(window.signals), dtype=bool)
    return replace(window, delta_answer=deployment.delta_answer, answers=answers,
                   signals=window.signals[keep], matched=window.matched[keep],
                   requests=None if window.requests is None else window.requests[keep],
                   witnesses=None if window.witnesses is None else window.witnesses[keep],
                   segments=None if window.segments is None else window.segments[keep])


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
    if window.answers is not None:
        window = replace(window, answers=window.answers.take(
            ~np.isin(np.asarray(window.answers.witnesses, dtype=str), witnesses)))
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
    only 'default' has any (the window is then calibrated as one, without segments)."""
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
        record_shortage(job=job, shortage=outcome, policy=policy, now=now)
        session.flush()
        return job
    deployment = session.get(Deployment, job.deployment_id)
    if isinstance(outcome, SegmentedCalibration):
        return _apply_segmented(session=session, deployment=deployment, job=job,
                                outcome=outcome, policy=policy, now=now)
    record_result(job=job, result=outcome)
    refusal = publish_refusal(result=outcome, deployment=deployment)
    if refusal and waits_for_more(job=job, result=outcome, policy=policy, now=now):
        job.status = "waiting_for_data"
        job.status_reason = (f"{refusal} Waiting for more shadow samples: the window grows "
                             f"until {policy.wait_max.total_seconds():.0f} s after the request.")
        session.flush()
        return job
    if refusal:
        finish(job, "failed", refusal, now)
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
    candidate = _publish_candidate(
        session=session, deployment=deployment, job=job, policy=policy, now=now,
        thresholds=thresholds, segments=segments, parent_version=active, metrics=metrics,
        reason=f"calibration job {job.id} ({job.trigger}){scope}: {outcome.samples['total']} "
               f"shadow samples{_requests_note(outcome)}, disagreement <= {outcome.delta} "
               f"with probability >= {1 - outcome.epsilon:g}{_answers_note(outcome)}")
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
        record_result(job=job, result=lead)
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
        finish(job, "failed", f"holdout check failed for segment {', '.join(failed)}: "
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
            finish(job, "failed", refusal, now)
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
    candidate = _publish_candidate(
        session=session, deployment=deployment, job=job, policy=policy, now=now,
        thresholds=outcome.thresholds, segments=outcome.segment_thresholds() or None,
        parent_version=active, metrics=metrics,
        reason=f"calibration job {job.id} ({job.trigger}) per segment ({sources}): every "
               f"segment's disagreement <= {outcome.delta} jointly with probability >= "
               f"{1 - outcome.epsilon:g}",
        detail=f" with thresholds per segment ({sources})")
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


def _requests_note(result: CalibrationResult) -> str:
    """' of N requests (tested per request)' when the test ran at the request level."""
    if result.risk_unit != "request":
        return " (tokens tested as independent)"
    return f" of {result.samples['requests']} requests (tested per request)"


def _answers_note(result: CalibrationResult) -> str:
    """', answers differing <= δ_answer (bound b on n shadow requests)' with an answer target."""
    if not result.answers:
        return ""
    answers = result.answers
    return (f"; answers differing from full depth <= {answers['delta_answer']} (bound "
            f"{answers['differing_bound']:.4g} on {answers['requests']} shadow requests)")


def _publish_candidate(*, session: Session, deployment: Deployment, job: CalibrationJob,
                       policy: CalibrationPolicy, now: datetime,
                       thresholds: dict[int, float],
                       segments: dict[str, dict[int, float]] | None,
                       parent_version: int | None, metrics: dict,
                       reason: str, detail: str = "") -> ThresholdSet:
    """The one publish path of a recalibration: publish the job's candidate (origin
    calibration), apply the deployment's policy to it and mark the job succeeded; `detail`
    joins the job's status after the version and its promotion."""
    candidate = publish(
        session=session, deployment=deployment, thresholds=thresholds, segments=segments,
        origin=Origin.calibration, parent_version=parent_version, calibration_job_id=job.id,
        actor=f"system:calibration-job-{job.id}", expected_metrics=metrics, reason=reason)
    job.result_version = candidate.version
    _apply_policy(session=session, deployment=deployment, job=job, candidate=candidate,
                  policy=policy, now=now)
    finish(job, "succeeded", f"published version {candidate.version} ({job.promotion})"
                             f"{detail}{_held(job)}", now)
    session.flush()
    return candidate


def _apply_policy(*, session: Session, deployment: Deployment, job: CalibrationJob,
                  candidate: ThresholdSet, policy: CalibrationPolicy, now: datetime) -> None:
    _supersede_pending(session=session, deployment=deployment, keep=job.id)
    actor = f"system:calibration-job-{job.id}"
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
