"""Automatic conservative fallback when an alert says quality is at risk.

`engage_fallback` runs inside the task that fired the alert (no human, no second hop): it makes
a conservative set active, stops any canary, queues a recalibration on the traffic since the
alert, and writes on the alert what it did. How conservative is the deployment's choice:

- `never_exit`: the `conservative` alias (version 1 of every deployment: never exit);
- `last_good`: the most recent earlier active version whose shadow disagreement stayed within δ
  (on at least `min_shadow_tokens` of its own traffic, and on the recent traffic when there is
  enough of it), republished with every threshold raised by `fallback_margin` (origin
  `fallback`); the `conservative` alias when no version qualifies.

Which alerts fall back, and the rule that decided is written on the alert:

- `quality_regression`: at once (rule `quality_regression`);
- `answer_regression` (whole answers differ from full depth above δ_answer): at once (rule
  `answer_regression`);
- `exit_rate_spike`: only when the window's shadow tokens cannot show that disagreement stays
  within δ: the (1 - alpha) upper bound of the request-clustered disagreement the detector put
  on the alert (`quality_gate`) is above δ (rule `shadow_upper_bound_above_delta`), or there
  are too few shadow tokens or requests to tell (`too_few_shadow_tokens`), or the alert carries
  no such evidence (`no_quality_evidence`). Otherwise the current set stays and a
  recalibration is queued (rule `shadow_upper_bound_within_delta`).

Per traffic segment: an alert on segment S (`alert.segment`) falls back S alone.
A version is published (origin `fallback`) equal to the active one except S's map: never exit
(`never_exit`), or the last good version's thresholds for S raised by the margin
(`last_good`, judged on S's traffic only); S gets a map of its own if it had none, and
'default' and every other segment keep theirs. The recalibration it queues runs on S's shadow
tokens only. A 'default' alert takes this path too when the active set gives other segments
maps of their own (they keep them; segments without a map apply default's and fall back with
it); without such maps it moves the whole deployment as one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import SimpleNamespace

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.alerts import reactions
from controlplane.alerts.kinds import QUALITY_AT_RISK, AlertKind
from controlplane.calibration.last_good import last_good_version
from controlplane.calibration.service import CalibrationPolicy, request_calibration
from controlplane.db import utcnow
from controlplane.deployments.locks import DEPLOYMENT_LOCK
from controlplane.deployments.models import AuditEvent, Deployment, ThresholdSet
from controlplane.deployments.segment_sets import (
    has_own_map,
    replace_segment_map,
    thresholds_for,
)
from controlplane.deployments.service import aliases_of, get_threshold_set, move_alias, publish
from controlplane.flows.canary import abort_canary
from controlplane.settings import get_settings
from controlplane.telemetry.service import shadow_samples
from exitplane.kit import tracing
from exitplane.wire import DEFAULT_SEGMENT, NEVER_EXIT, Origin

log = logging.getLogger("exitplane.fallback")

# How the fallback appears in audit events (a worker's actions are `system:<task>`).
ACTOR = "system:fallback"
# What `react_to_alert` answers: quality at risk (fallback), and a collapse (recalibration only).
REACTS_TO = (*sorted(QUALITY_AT_RISK), AlertKind.EXIT_RATE_COLLAPSE)


@dataclass(frozen=True)
class SpikeGate:
    """How much shadow evidence keeps the current set through an exit-rate spike."""

    min_shadow_tokens: int = 200
    min_requests: int = 20

    @classmethod
    def from_settings(cls, settings) -> SpikeGate:
        return cls(min_shadow_tokens=settings.fallback_min_shadow_tokens,
                   min_requests=settings.fallback_min_shadow_requests)


@dataclass(frozen=True)
class Decision:
    """Whether an alert makes the conservative set active, and the rule that said so."""

    fall_back: bool
    rule: str
    reason: str

    def describe(self) -> str:
        return f"rule {self.rule}: {self.reason}"


def decide(*, alert, delta: float, gate: SpikeGate = SpikeGate()) -> Decision:
    """The fallback rule for a newly fired quality-at-risk alert (see the module docstring)."""
    if alert.kind == AlertKind.ANSWER_REGRESSION:
        return Decision(True, alert.kind, "answer regression falls back at once")
    if alert.kind != AlertKind.EXIT_RATE_SPIKE:
        return Decision(True, alert.kind, "quality regression falls back at once")
    evidence = (alert.evidence or {}).get("quality_gate")
    if not evidence:
        return Decision(True, "no_quality_evidence",
                        "the spike carries no shadow disagreement of its window")
    tokens, requests = int(evidence["shadow_tokens"]), int(evidence["requests"])
    if tokens < gate.min_shadow_tokens or requests < gate.min_requests:
        return Decision(True, "too_few_shadow_tokens",
                        f"{tokens} shadow tokens from {requests} requests in the window "
                        f"(need {gate.min_shadow_tokens} from {gate.min_requests}) cannot show "
                        f"disagreement within δ={delta:g}")
    bound, confidence = float(evidence["upper_bound"]), float(evidence["confidence"])
    observed = (f"{evidence['disagreements']}/{tokens} shadow tokens disagree over {requests} "
                f"requests; {confidence:.0%} upper bound {bound:.2%} (design effect "
                f"{float(evidence['design_effect']):.1f})")
    if bound > delta:
        return Decision(True, "shadow_upper_bound_above_delta", f"{observed} > δ={delta:g}")
    return Decision(False, "shadow_upper_bound_within_delta", f"{observed} <= δ={delta:g}")


@dataclass(frozen=True)
class Fallback:
    """What the fallback did: the version now active and how it was chosen."""

    from_version: int | None
    to_version: int
    mode: str
    source_version: int | None  # last_good: the version whose thresholds were raised
    calibration_job_id: int | None
    moved: bool
    segment: str | None = None  # the one segment that fell back; None: the whole deployment

    def describe(self) -> str:
        if self.segment is not None:
            return self._describe_segment()
        if not self.moved:
            text = f"conservative version {self.to_version} was already active"
        elif self.source_version is not None:
            text = (f"fallback engaged: active {self.from_version} -> {self.to_version} "
                    f"(last good version {self.source_version} with thresholds raised)")
        else:
            text = (f"fallback engaged: active {self.from_version} -> {self.to_version} "
                    "(conservative set)")
        if self.calibration_job_id is not None:
            text += f"; recalibration job {self.calibration_job_id} queued"
        return text

    def _describe_segment(self) -> str:
        if not self.moved:
            text = (f"segment {self.segment} already applies conservative thresholds in "
                    f"active version {self.to_version}")
        else:
            how = (f"last good version {self.source_version}'s thresholds raised"
                   if self.source_version is not None else "never exit")
            text = (f"fallback engaged for segment {self.segment} only: active "
                    f"{self.from_version} -> {self.to_version} ({self.segment}: {how}; every "
                    "other segment keeps its thresholds)")
        if self.calibration_job_id is not None:
            text += (f"; recalibration job {self.calibration_job_id} of segment "
                     f"{self.segment} queued")
        return text


def engage_fallback(*, session: Session, deployment: Deployment, alert,
                    policy: CalibrationPolicy = CalibrationPolicy(),
                    min_shadow_tokens: int = 200,
                    recent_window: timedelta = timedelta(minutes=10)) -> Fallback:
    """Make a conservative set active because of `alert`, queue a recalibration, and record
    both on the alert (`action_taken`). Safe to call twice for one alert.

    `last_good` checks a candidate version on the shadow samples of `recent_window` before the
    alert too (the traffic that set it off), so a version good only on the old traffic is
    skipped."""
    session.refresh(deployment, with_for_update=DEPLOYMENT_LOCK)
    aliases = aliases_of(session=session, deployment=deployment)
    current = aliases["active"]
    reason = f"automatic fallback on alert {alert.id} ({alert.kind})"
    details = {"alert_id": alert.id, "alert_kind": alert.kind, "alert_layer": alert.layer,
               "fallback_mode": deployment.fallback_mode}
    if "canary" in aliases:
        abort_canary(session=session, deployment=deployment, actor=ACTOR,
                     reason=f"{reason}: canary stopped")
    segment = getattr(alert, "segment", None) or DEFAULT_SEGMENT
    current_set = get_threshold_set(session=session, deployment=deployment, version=current)
    scoped = segment != DEFAULT_SEGMENT or bool(current_set.segments)
    details["segment"] = segment
    target, source = aliases["conservative"], None
    if _already_fell_back(session=session, deployment=deployment, alert_id=alert.id,
                          current=current):
        target = current
    elif scoped:
        target, source = _segment_target(
            session=session, deployment=deployment, current=current_set, segment=segment,
            alert=alert, since=_alert_time(alert) - recent_window,
            min_shadow_tokens=min_shadow_tokens, reason=reason)
    elif deployment.fallback_mode == "last_good":
        target, source = _last_good_target(
            session=session, deployment=deployment, current=current, alert=alert,
            since=_alert_time(alert) - recent_window, min_shadow_tokens=min_shadow_tokens,
            reason=reason)
    moved = target != current
    if moved:
        move_alias(session=session, deployment=deployment, alias="active", version=target,
                   actor=ACTOR, action="alias.fallback", reason=reason,
                   details=details | {"source_version": source})
    job, _ = request_calibration(
        session=session, deployment=deployment, actor=ACTOR, trigger="alert",
        alert_id=alert.id, since=_alert_time(alert), policy=policy,
        segment=segment if scoped else None,
        reason=f"traffic changed: alert {alert.id} ({alert.kind})")
    outcome = Fallback(from_version=current, to_version=target if moved else current,
                       mode=deployment.fallback_mode, source_version=source,
                       calibration_job_id=job.id, moved=moved,
                       segment=segment if scoped else None)
    previous = (alert.action_taken or "").strip()
    alert.action_taken = f"{previous}; {outcome.describe()}" if previous else outcome.describe()
    log.warning("%s: %s", deployment.name, outcome.describe())
    session.flush()
    return outcome


def _job_segment(alert) -> str | None:
    """The segment a recalibration answering `alert` runs on: the alert's, or the whole
    deployment for a 'default' alert."""
    segment = getattr(alert, "segment", None) or DEFAULT_SEGMENT
    return None if segment == DEFAULT_SEGMENT else segment


def _alert_time(alert) -> datetime:
    return getattr(alert, "fired_at", None) or utcnow()


def _already_fell_back(*, session: Session, deployment: Deployment, alert_id: int,
                       current: int) -> bool:
    """True when this alert's fallback already moved `active` to where it points now."""
    last = session.scalars(select(AuditEvent).where(
        AuditEvent.deployment_id == deployment.id, AuditEvent.action == "alias.fallback")
        .order_by(AuditEvent.id.desc()).limit(1)).one_or_none()
    return (last is not None and last.to_version == current
            and (last.details or {}).get("alert_id") == alert_id)


def _segment_target(*, session: Session, deployment: Deployment, current: ThresholdSet,
                    segment: str, alert, since: datetime, min_shadow_tokens: int,
                    reason: str) -> tuple[int, int | None]:
    """(version to make active, the good version S's thresholds came from) when only
    `segment` falls back: the active set with S's map made conservative (module docstring)."""
    conservative = aliases_of(session=session, deployment=deployment)["conservative"]
    by_layer = dict.fromkeys(deployment.exit_layers, NEVER_EXIT)
    good = None
    if deployment.fallback_mode == "last_good":
        recent = shadow_samples(session=session, deployment=deployment, since=since,
                                segment=segment)
        good = last_good_version(session=session, deployment=deployment,
                                 exclude={current.version, conservative},
                                 min_shadow_tokens=min_shadow_tokens, recent=recent,
                                 segment=segment)
        if good is not None:
            by_layer = {layer: min(NEVER_EXIT, value + deployment.fallback_margin)
                        for layer, value in thresholds_for(good, segment).items()}
    if has_own_map(current, segment) and thresholds_for(current, segment) == by_layer:
        return current.version, None  # S is already as conservative as it gets
    thresholds, segments = replace_segment_map(current, segment, by_layer)
    # The other segments' expected metrics stay their drift reference; S's no longer hold.
    expected = dict(current.expected_metrics or {})
    if segment == DEFAULT_SEGMENT:
        expected = {key: value for key, value in expected.items() if key == "segments"}
    elif isinstance(expected.get("segments"), dict):
        expected["segments"] = {name: value for name, value in expected["segments"].items()
                                if name != segment}
    how = (f"version {good.version}'s thresholds raised by {deployment.fallback_margin:g}"
           if good is not None else "never exit")
    published = publish(
        session=session, deployment=deployment, thresholds=thresholds, segments=segments,
        origin=Origin.fallback, parent_version=current.version, actor=ACTOR,
        reason=f"{reason}: segment {segment} falls back ({how}); the others keep theirs",
        expected_metrics=expected | {"fallback": {
            "segment": segment, "alert_id": alert.id, "from_version": current.version,
            "source_version": None if good is None else good.version,
            "margin": deployment.fallback_margin if good is not None else None}})
    return published.version, None if good is None else good.version


def _last_good_target(*, session: Session, deployment: Deployment, current: int, alert,
                      since: datetime, min_shadow_tokens: int,
                      reason: str) -> tuple[int, int | None]:
    """(version to make active, the good version it came from) for `last_good` mode."""
    conservative = aliases_of(session=session, deployment=deployment)["conservative"]
    recent = shadow_samples(session=session, deployment=deployment, since=since)
    good = last_good_version(session=session, deployment=deployment,
                             exclude={current, conservative},
                             min_shadow_tokens=min_shadow_tokens, recent=recent)
    if good is None:
        return conservative, None
    margin = deployment.fallback_margin
    raised = {layer: min(NEVER_EXIT, value + margin)
              for layer, value in good.thresholds_by_layer().items()}
    # A segment's own map may be stricter than default's: it is raised too, never dropped.
    raised_segments = {name: {layer: min(NEVER_EXIT, value + margin)
                              for layer, value in by_layer.items()}
                       for name, by_layer in (good.segments_by_layer() or {}).items()}
    published = publish(
        session=session, deployment=deployment, thresholds=raised, origin=Origin.fallback,
        segments=raised_segments or None,
        parent_version=good.version, actor=ACTOR,
        reason=f"{reason}: version {good.version} with thresholds raised by {margin:g}",
        expected_metrics={"source_version": good.version, "margin": margin,
                          "alert_id": alert.id})
    return published.version, good.version


KEPT = "shadow_upper_bound_within_delta"


def recheck_spike(*, session: Session, alert, quality_gate: dict,
                  gate: SpikeGate | None = None) -> bool:
    """A still-open `exit_rate_spike` that kept the active set, seen again with the shadow
    evidence of the current window: fall back now if that evidence no longer shows
    disagreement within δ. True when it fell back."""
    if alert.kind != AlertKind.EXIT_RATE_SPIKE or not (alert.action_taken or "").startswith(
            f"rule {KEPT}"):
        return False
    deployment = session.get(Deployment, alert.deployment_id)
    gate = gate or SpikeGate.from_settings(get_settings())
    current = SimpleNamespace(kind=alert.kind, evidence={"quality_gate": quality_gate})
    decision = decide(alert=current, delta=deployment.delta, gate=gate)
    if not decision.fall_back:
        return False
    savepoint = session.begin_nested()
    try:
        alert.action_taken = f"{alert.action_taken}; re-checked: {decision.describe()}"
        engage_fallback(session=session, deployment=deployment, alert=alert)
        savepoint.commit()
    except Exception as error:
        savepoint.rollback()
        log.exception("fallback on re-checked alert %s failed", alert.id)
        alert.action_taken = (f"{alert.action_taken}; re-checked: {decision.describe()}; "
                              f"automatic fallback FAILED ({type(error).__name__}: {error})")
        session.flush()
        return False
    return True


@tracing.traced("fallback")
def react_to_alert(*, session: Session, alert,
                   policy: CalibrationPolicy = CalibrationPolicy(),
                   gate: SpikeGate | None = None) -> str:
    """What a newly fired alert sets off (registered for REACTS_TO by `install`):
    quality at risk -> fallback and recalibration, or for a spike that the shadow tokens show
    harmless only the recalibration (`decide`); exit-rate collapse -> recalibration only.

    Runs in a savepoint: if it fails, the alert still fires and says so."""
    if alert.kind not in QUALITY_AT_RISK and alert.kind != AlertKind.EXIT_RATE_COLLAPSE:
        return ""
    deployment = session.get(Deployment, alert.deployment_id)
    if gate is None:
        gate = SpikeGate.from_settings(get_settings())
    savepoint = session.begin_nested()
    try:
        decision = (decide(alert=alert, delta=deployment.delta, gate=gate)
                    if alert.kind in QUALITY_AT_RISK else None)
        if decision is not None and decision.fall_back:
            alert.action_taken = decision.describe()
            engage_fallback(session=session, deployment=deployment, alert=alert, policy=policy)
        elif decision is not None:
            job, _ = request_calibration(
                session=session, deployment=deployment, actor=ACTOR, trigger="alert",
                alert_id=alert.id, since=_alert_time(alert), policy=policy,
                segment=_job_segment(alert),
                reason=f"exit rate rose, quality held: alert {alert.id}")
            alert.action_taken = (f"{decision.describe()}; the active set stays; recalibration "
                                  f"job {job.id} queued")
            log.warning("%s: %s", deployment.name, alert.action_taken)
        else:
            job, _ = request_calibration(
                session=session, deployment=deployment, actor=ACTOR, trigger="alert",
                alert_id=alert.id, since=_alert_time(alert), policy=policy,
                segment=_job_segment(alert),
                reason=f"exits collapsed: alert {alert.id}")
            alert.action_taken = f"recalibration job {job.id} queued (quality is not at risk)"
        savepoint.commit()
    except Exception as error:
        savepoint.rollback()
        log.exception("automatic reaction to alert %s failed", alert.id)
        alert.action_taken = (f"automatic fallback FAILED ({type(error).__name__}: {error}); "
                              "move the active alias to the conservative version by hand")
        session.flush()
    return alert.action_taken


def install() -> None:
    """Register `react_to_alert` for the kinds it answers and `recheck_spike` for a spike seen
    again; every process that fires alerts calls this when it starts (`create_api`,
    `workers.app`)."""
    reactions.register(react_to_alert, kinds=REACTS_TO)
    reactions.register_recheck(recheck_spike, kinds=[AlertKind.EXIT_RATE_SPIKE])
