"""The live operating curve, and re-tuning on opportunity and on schedule.

Every `operating_curve_interval_s` the workers (`curve.refresh`) draw, per deployment and traffic
segment, the operating curve of the last `operating_curve_window_s` of shadow evidence
(`draw_curve`: the trust rules of `flows.what_if.read_evidence`, the statistics of
`calibration.curve`), mark the active, conservative, canary and last-good sets on it and store
it (one row per deployment and segment, `OperatingCurve`); the API and the UI read the stored
row (`latest_curve`), never compute it.

Opportunity (`check_opportunity`): when the curve's best certified set saves at least
`opportunity_min_gain` more net time than the active set, beyond sampling noise
(`calibration.curve.Opportunity`), an `opportunity` finding fires (info, never pages) and a
recalibration is queued (trigger "opportunity"), which then goes through the deployment's
promotion policy and bounds like any other. Its window starts where the last curve without an
opportunity was drawn (the traffic changed since; the job waits for samples while the window
grows), so that it calibrates on the new traffic, not on a mixture with the old. One
opportunity queues one job: none while a job of the scope is open, nor within
`opportunity_cooldown_s` of the last opportunity job. The finding resolves once a curve no
longer shows the gap.

Schedule (`retune_if_due`): a deployment with `retune_every_s` gets a recalibration (trigger
"schedule") when its last whole-deployment job is older than that.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.alerts.kinds import AlertKind
from controlplane.alerts.service import Condition, reconcile
from controlplane.calibration.curve import OperatingCurve as Curve
from controlplane.calibration.curve import operating_curve
from controlplane.calibration.last_good import last_good_version
from controlplane.calibration.models import CalibrationJob, OperatingCurve
from controlplane.calibration.segments import recalibration_level
from controlplane.calibration.service import CalibrationPolicy, request_calibration
from controlplane.db import utcnow
from controlplane.deployments.models import Deployment
from controlplane.deployments.segment_sets import thresholds_for
from controlplane.deployments.segments import known_segments
from controlplane.deployments.service import aliases_of, get_threshold_set
from controlplane.errors import Invalid
from controlplane.flows.answers import read_answers, with_answers
from controlplane.flows.what_if import (
    calibrate,
    deployment_cost_model,
    read_evidence,
    shadow_share,
)
from controlplane.settings import get_settings
from exitplane.wire import DEFAULT_SEGMENT

log = logging.getLogger("exitplane.curve")

SYSTEM_ACTOR = "operating-curve"


def _marks(*, session: Session, deployment: Deployment, segment: str,
           policy: CalibrationPolicy) -> dict[str, tuple[int, dict[int, float]]]:
    """name -> (version, the thresholds `segment` applies under it) for the deployment's
    aliases and its last good set."""
    aliases = aliases_of(session=session, deployment=deployment)
    marks = {}
    for name in ("active", "conservative", "canary"):
        if name in aliases:
            found = get_threshold_set(session=session, deployment=deployment,
                                      version=aliases[name])
            marks[name] = (found.version, thresholds_for(found, segment))
    good = last_good_version(
        session=session, deployment=deployment,
        exclude={aliases.get("active"), aliases.get("conservative")} - {None},
        min_shadow_tokens=policy.bounds.min_shadow_tokens,
        segment=None if segment == DEFAULT_SEGMENT else segment)
    if good is not None:
        marks["last_good"] = (good.version, thresholds_for(good, segment))
    return marks


def draw_curve(*, session: Session, deployment: Deployment, segment: str = DEFAULT_SEGMENT,
               now: datetime | None = None, settings=None,
               policy: CalibrationPolicy | None = None,
               seed: int = 0) -> tuple[OperatingCurve, Curve | None]:
    """Draw and store the curve of `segment`'s recent shadow evidence: (stored row, curve),
    the curve None (and the row saying why) when the window holds too few shadow samples."""
    settings = settings or get_settings()
    policy = policy or CalibrationPolicy.from_settings(settings)
    now = now or utcnow()
    since = now - timedelta(seconds=settings.operating_curve_window_s)
    evidence = read_evidence(session=session, deployment=deployment, since=since, until=now,
                             segment=segment, policy=policy, seed=seed)
    known = known_segments(session=session, deployment_id=deployment.id)
    # a segment's own set is certified at its share of ε, as a segment job certifies it
    epsilon = (deployment.epsilon if not known
               else recalibration_level(deployment.epsilon, 1 + len(known)))
    model = deployment_cost_model(session=session, deployment=deployment, since=since,
                                  until=now)
    share = shadow_share(session=session, deployment=deployment, since=since, until=now,
                         segment=segment)
    about = {"tokens": len(evidence), "requests": len(set(evidence.requests.tolist())),
             "witnesses": len(set(evidence.witnesses.tolist())),
             "witnesses_set_aside": list(evidence.set_aside), "epsilon": epsilon,
             "delta": deployment.delta, "shadow_share": share,
             "cost_model": None if model is None else model.as_dict()}
    curve = None
    try:
        result = calibrate(evidence=evidence, deployment=deployment, delta=deployment.delta,
                           epsilon=epsilon, policy=policy, seed=seed)
    except Invalid as shortage:
        about["note"] = str(shortage)
    else:
        curve = operating_curve(
            signals=evidence.signals, matched=evidence.matched, requests=evidence.requests,
            witnesses=evidence.witnesses, calibration=result,
            exit_layers=deployment.exit_layers, num_layers=deployment.num_layers,
            delta=deployment.delta, epsilon=epsilon,
            marks=_marks(session=session, deployment=deployment, segment=segment,
                         policy=policy),
            cost_model=model, shadow_share=share, min_gain=settings.opportunity_min_gain)
    row = session.scalars(select(OperatingCurve).where(
        OperatingCurve.deployment_id == deployment.id, OperatingCurve.segment == segment)
    ).one_or_none()
    if row is None:
        row = OperatingCurve(deployment_id=deployment.id, segment=segment)
        session.add(row)
    row.computed_at, row.window_since, row.window_until = now, since, now
    answers = read_answers(session=session, deployment=deployment, since=since, until=now,
                           segment=segment, set_aside=evidence.set_aside, policy=policy,
                           seed=seed)
    about["shadow_requests"] = len(answers)
    row.evidence = about
    annotate = dict(evidence=answers, layers=sorted(int(k) for k in deployment.exit_layers),
                    epsilon=epsilon, delta_answer=deployment.delta_answer)
    row.points = [] if curve is None else with_answers(sets=curve.points, **annotate)
    marks = {} if curve is None else curve.marks
    row.marks = dict(zip(marks, with_answers(sets=list(marks.values()), **annotate),
                         strict=True))
    row.best = None if curve is None else next(
        (point for point in row.points if point.get("chosen")), curve.best)
    row.gap = None if curve is None else curve.gap
    row.opportunity = (None if curve is None or curve.opportunity is None
                       else curve.opportunity.as_dict())
    session.flush()
    return row, curve


def latest_curve(session: Session, deployment: Deployment,
                 segment: str = DEFAULT_SEGMENT) -> dict | None:
    """The stored operating curve of `deployment`'s `segment` (None: none drawn yet). Shape:

    {"deployment": name, "segment": str, "computed_at": iso, "window": {"since", "until"},
     "evidence": {"tokens", "requests", "witnesses", "witnesses_set_aside", "delta",
                  "epsilon", "shadow_share", "cost_model": {...} | None,
                  "shadow_requests": complete shadow requests read, "note"?: why no curve},
     "points": [{"step", "thresholds": {"<layer>": t}, "exit_rate", "exit_rate_by_layer",
                 "disagreement", "disagreement_bound", "test_bound", "certified", "chosen",
                 "mean_depth", "layers_speedup", "speedup", "net_saving",
                 "answers": answer consistency on the shadow requests | None}, ...]
                 (conservative first),
     "marks": {"active" | "conservative" | "canary" | "last_good": {"version", "thresholds",
               "exit_rate", "exit_rate_by_layer", "disagreement", "disagreement_bound",
               "mean_depth", "layers_speedup", "speedup", "net_saving", "answers"}},
     "best": the chosen point (certified at δ) | None,
     "gap": {"net_saving", "speedup"} (best minus active) | None,
     "opportunity": {"gain", "gain_lower", "required", "best_certified", "qualifies"} | None}

    `speedup` and `net_saving` come from the cost model when one is fitted
    (evidence.cost_model), else they are the layers ratio."""
    row = session.scalars(select(OperatingCurve).where(
        OperatingCurve.deployment_id == deployment.id, OperatingCurve.segment == segment)
    ).one_or_none()
    if row is None:
        return None
    return {"deployment": deployment.name, "segment": row.segment,
            "computed_at": row.computed_at.isoformat(),
            "window": {"since": row.window_since.isoformat(),
                       "until": row.window_until.isoformat()},
            "evidence": row.evidence, "points": row.points, "marks": row.marks,
            "best": row.best, "gap": row.gap, "opportunity": row.opportunity}


def check_opportunity(*, session: Session, deployment: Deployment, segment: str,
                      curve: Curve | None, since: datetime, now: datetime | None = None,
                      settings=None) -> CalibrationJob | None:
    """Fire (or clear) the `opportunity` finding of `segment` from its curve and queue a
    recalibration for a qualifying one (module docstring); the job queued, if any."""
    settings = settings or get_settings()
    now = now or utcnow()
    found = curve is not None and curve.opportunity is not None and curve.opportunity.qualifies
    conditions = []
    if found:
        chance = curve.opportunity
        conditions.append(Condition(
            kind=AlertKind.OPPORTUNITY, severity="info", segment=segment,
            summary=(f"recent traffic certifies a set saving {chance.gain:+.1%} more net time "
                     f"than the active set at δ={deployment.delta} (at least "
                     f"{chance.gain_lower:+.1%} beyond noise; needed {chance.required:.1%}); "
                     "a recalibration is queued"),
            evidence={"gap": curve.gap, "opportunity": chance.as_dict(),
                      "best": curve.best, "active": curve.marks.get("active")}))
    reconcile(session=session, deployment=deployment, conditions=conditions,
              checked_kinds=[AlertKind.OPPORTUNITY], clear_after_s=0.0, now=now,
              segment=segment)
    if not found:
        return None
    scope = None if segment == DEFAULT_SEGMENT and not known_segments(
        session=session, deployment_id=deployment.id) else segment
    last = session.scalar(select(CalibrationJob.created_at).where(
        CalibrationJob.deployment_id == deployment.id, CalibrationJob.trigger == "opportunity",
        CalibrationJob.segment.is_(None) if scope is None else CalibrationJob.segment == scope)
        .order_by(CalibrationJob.id.desc()).limit(1))
    if last is not None and now - last < timedelta(seconds=settings.opportunity_cooldown_s):
        return None
    job, created = request_calibration(
        session=session, deployment=deployment, actor=SYSTEM_ACTOR, trigger="opportunity",
        since=since, segment=scope, policy=CalibrationPolicy.from_settings(settings),
        reason=f"opportunity: the best certified set saves {curve.opportunity.gain:+.1%} more "
               "net time than the active set")
    if created:
        log.info("%s: opportunity on segment %s; calibration job %d queued", deployment.name,
                 segment, job.id)
    return job if created else None


def retune_if_due(*, session: Session, deployment: Deployment, now: datetime | None = None,
                  settings=None) -> CalibrationJob | None:
    """Queue the scheduled recalibration of a deployment with `retune_every_s` once its last
    whole-deployment job is that old (None: not due, or no schedule)."""
    if not deployment.retune_every_s:
        return None
    settings = settings or get_settings()
    now = now or utcnow()
    last = session.scalar(select(CalibrationJob.created_at).where(
        CalibrationJob.deployment_id == deployment.id, CalibrationJob.segment.is_(None))
        .order_by(CalibrationJob.id.desc()).limit(1))
    if last is not None and now - last < timedelta(seconds=deployment.retune_every_s):
        return None
    job, created = request_calibration(
        session=session, deployment=deployment, actor=SYSTEM_ACTOR, trigger="schedule",
        policy=CalibrationPolicy.from_settings(settings),
        reason=f"scheduled: re-tune every {deployment.retune_every_s} s")
    return job if created else None


def _changed_since(before, row: OperatingCurve) -> datetime:
    """Where an opportunity's recalibration window starts: after the last curve that showed
    none (the traffic changed since; the job then waits for samples as the window grows), else
    where this curve's window starts."""
    if before is None or (before.opportunity or {}).get("qualifies"):
        return row.window_since
    return max(before.computed_at, row.window_since)


def refresh_deployment(*, session: Session, deployment: Deployment,
                       now: datetime | None = None, settings=None, seed: int = 0) -> dict:
    """One pass for one deployment: each segment's curve drawn and stored, its opportunity
    checked; then the schedule. What it did, for the task's result."""
    settings = settings or get_settings()
    now = now or utcnow()
    done: dict = {"deployment": deployment.name, "segments": {}}
    for segment in [DEFAULT_SEGMENT, *known_segments(session=session,
                                                     deployment_id=deployment.id)]:
        before = session.execute(select(OperatingCurve.computed_at, OperatingCurve.opportunity)
                                 .where(OperatingCurve.deployment_id == deployment.id,
                                        OperatingCurve.segment == segment)).one_or_none()
        row, curve = draw_curve(session=session, deployment=deployment, segment=segment,
                                now=now, settings=settings, seed=seed)
        job = check_opportunity(session=session, deployment=deployment, segment=segment,
                                curve=curve, since=_changed_since(before, row), now=now,
                                settings=settings)
        done["segments"][segment] = {"points": len(row.points),
                                     "opportunity": None if job is None else job.id}
    job = retune_if_due(session=session, deployment=deployment, now=now, settings=settings)
    done["scheduled"] = None if job is None else job.id
    return done
