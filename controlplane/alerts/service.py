"""The alert lifecycle: fire, refresh, reconcile, acknowledge, resolve (plain keyword-only
functions over the store). Hooks are managed in `hook_service`, deliveries in
`delivery_service`.

An alert is raised from a `Condition` a detector observed; while one is open (firing or
acknowledged) for the same dedup key, observing the condition again only refreshes it. When a
check no longer sees the condition, the alert resolves itself once it stayed clear for
`clear_after_s`. Delivery to hooks happens in the `alerts.deliver` task, enqueued only after the
commit that stored the alert (`delivery_service.enqueue_deliveries`, `controlplane.outbox`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.alerts import reactions
from controlplane.alerts.delivery_service import enqueue_deliveries, refresh_if_due
from controlplane.alerts.models import KINDS, SEVERITIES, STATUSES, Alert
from controlplane.alerts.reports import store_report
from controlplane.auth.audit import record_admin_event
from controlplane.db import utcnow
from controlplane.deployments.models import Deployment
from controlplane.errors import Conflict, Invalid, NotFound
from controlplane.settings import get_settings
from exitplane.kit import tracing
from exitplane.wire import DEFAULT_SEGMENT

log = logging.getLogger("exitplane.alerts")

SYSTEM_ACTOR = "system"


@dataclass(frozen=True)
class Condition:
    """What a detector observed on a deployment; `subject` tells one instance from another
    (the exit layer, a runtime id, or "all"), `segment` the traffic segment it was seen on."""

    kind: str
    severity: str
    summary: str
    subject: str = "all"
    layer: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    report_html: str | None = None
    segment: str = DEFAULT_SEGMENT

    def dedup_key(self, deployment: Deployment) -> str:
        # A 'default' key names no segment: a deployment without segments keys its alerts so.
        if self.segment == DEFAULT_SEGMENT:
            return f"{deployment.name}:{self.kind}:{self.subject}"
        return f"{deployment.name}:{self.segment}:{self.kind}:{self.subject}"


@dataclass
class Reconciled:
    fired: list[Alert] = field(default_factory=list)
    refreshed: list[Alert] = field(default_factory=list)
    resolved: list[Alert] = field(default_factory=list)


# -- alerts ------------------------------------------------------------------------------------

def get_alert(*, session: Session, alert_id: int, lock: bool = False) -> Alert:
    query = select(Alert).where(Alert.id == alert_id)
    if lock:
        query = query.with_for_update()
    alert = session.scalars(query).one_or_none()
    if alert is None:
        raise NotFound(f"alert {alert_id} does not exist")
    return alert


def list_alerts(*, session: Session, deployment: Deployment | None = None,
                status: str | None = None, kind: str | None = None, limit: int = 100,
                before_id: int | None = None) -> list[Alert]:
    """Newest first; `status="open"` means firing or acknowledged."""
    query = select(Alert)
    if deployment is not None:
        query = query.where(Alert.deployment_id == deployment.id)
    if status == "open":
        query = query.where(Alert.open_key.is_not(None))
    elif status is not None:
        if status not in STATUSES:
            raise Invalid(f"unknown status {status!r}; use open or one of {', '.join(STATUSES)}")
        query = query.where(Alert.status == status)
    if kind is not None:
        query = query.where(Alert.kind == kind)
    if before_id is not None:
        query = query.where(Alert.id < before_id)
    return list(session.scalars(query.order_by(Alert.id.desc()).limit(limit)))


def open_alerts(*, session: Session, deployment: Deployment,
                kinds: Iterable[str] | None = None, segment: str | None = None) -> list[Alert]:
    """The deployment's open alerts (of `kinds`, of one traffic `segment` when given)."""
    query = select(Alert).where(Alert.deployment_id == deployment.id, Alert.open_key.is_not(None))
    if segment is not None:
        query = query.where(Alert.segment == segment)
    if kinds is not None:
        query = query.where(Alert.kind.in_(list(kinds)))
    return list(session.scalars(query.order_by(Alert.id)))


def fire(*, session: Session, deployment: Deployment, condition: Condition,
         now: datetime | None = None, keep_report: bool = False) -> tuple[Alert, bool]:
    """The open alert for the condition's key, refreshed; or a new one (True) that fires.
    With `keep_report`, the condition's Evidently report is stored for an alert that has none."""
    if condition.kind not in KINDS:
        raise Invalid(f"unknown alert kind {condition.kind!r}")
    if condition.severity not in SEVERITIES:
        raise Invalid(f"unknown severity {condition.severity!r}")
    now = now or utcnow()
    key = condition.dedup_key(deployment)
    alert = session.scalars(select(Alert).where(
        Alert.deployment_id == deployment.id, Alert.open_key == key)).one_or_none()
    if alert is not None:
        alert.last_seen_at = now
        alert.clear_since = None
        if condition.report_html and keep_report and not alert.has_report:
            store_report(session=session, alert=alert, html=condition.report_html,
                         max_bytes=get_settings().report_max_bytes)
        session.flush()
        return alert, False
    alert = Alert(deployment_id=deployment.id, kind=condition.kind, layer=condition.layer,
                  segment=condition.segment, severity=condition.severity, dedup_key=key,
                  open_key=key, status="firing",
                  summary=condition.summary, evidence=jsonable(condition.evidence),
                  fired_at=now, last_seen_at=now)
    # A savepoint: a concurrent checker that inserted the same key first wins, we refresh it.
    savepoint = session.begin_nested()
    try:
        session.add(alert)
        session.flush()
        savepoint.commit()
    except Exception:
        savepoint.rollback()
        existing = session.scalars(select(Alert).where(
            Alert.deployment_id == deployment.id, Alert.open_key == key)).one_or_none()
        if existing is None:
            raise
        existing.last_seen_at = now
        session.flush()
        return existing, False
    if condition.report_html and keep_report:
        store_report(session=session, alert=alert, html=condition.report_html,
                     max_bytes=get_settings().report_max_bytes)
    session.flush()
    log.warning("alert %s fired: %s", key, condition.summary)
    on_alert_fired(session, alert)
    return alert, True


@tracing.traced("alert.fired")
def on_alert_fired(session: Session, alert: Alert) -> None:
    """The one place where the system reacts to a newly fired alert.

    First the automatic responses registered for its kind (`controlplane.alerts.reactions`;
    the calibration fallback: for the QUALITY_AT_RISK kinds the `conservative` set becomes
    active and a recalibration is queued), which record what they did in `alert.action_taken`;
    then every matching hook gets a delivery, enqueued after the commit, so the page says what
    the system already did."""
    reactions.react(session=session, alert=alert)
    enqueue_deliveries(session=session, alert=alert, event="firing")


def reconcile(*, session: Session, deployment: Deployment, conditions: list[Condition],
              checked_kinds: Iterable[str], clear_after_s: float, now: datetime | None = None,
              keep_reports: bool = False, segment: str = DEFAULT_SEGMENT) -> Reconciled:
    """Fire/refresh alerts for `conditions`; open alerts of `checked_kinds` that were not
    observed start their clear period and resolve once it has lasted `clear_after_s`.

    One call covers one traffic `segment`: only that segment's open alerts can clear (a check
    of 'code' says nothing about 'chat')."""
    now = now or utcnow()
    result = Reconciled()
    seen = set()
    for condition in conditions:
        alert, created = fire(session=session, deployment=deployment, condition=condition,
                              now=now, keep_report=keep_reports)
        seen.add(alert.id)
        if created:
            result.fired.append(alert)
        else:
            result.refreshed.append(alert)
            refresh_if_due(session=session, alert=alert, now=now)
    for alert in open_alerts(session=session, deployment=deployment, kinds=checked_kinds,
                             segment=segment):
        if alert.id in seen:
            continue
        if alert.clear_since is None:
            alert.clear_since = now
        if (now - alert.clear_since).total_seconds() >= clear_after_s:
            _resolve(session=session, alert=alert, actor=SYSTEM_ACTOR, now=now,
                     reason=f"condition cleared for {clear_after_s:g} s")
            result.resolved.append(alert)
    session.flush()
    return result


def acknowledge(*, session: Session, alert: Alert, actor: str, note: str = "") -> Alert:
    """firing -> acknowledged (the page stops escalating; the alert stays open)."""
    if alert.status == "resolved":
        raise Conflict(f"alert {alert.id} is already resolved")
    if alert.status == "acknowledged":
        return alert
    alert.status = "acknowledged"
    alert.acknowledged_at = utcnow()
    alert.acknowledged_by = actor
    if note:
        alert.resolution = note
    session.flush()
    record_admin_event(session=session, actor=actor, action="alert.acknowledge",
                       target=f"alert:{alert.id}", reason=note,
                       details={"kind": alert.kind, "deployment_id": alert.deployment_id},
                       deployment=_deployment_name(session, alert))
    enqueue_deliveries(session=session, alert=alert, event="acknowledged")
    return alert


def _deployment_name(session: Session, alert: Alert) -> str | None:
    deployment = session.get(Deployment, alert.deployment_id)
    return deployment.name if deployment else None


def resolve(*, session: Session, alert: Alert, actor: str, reason: str) -> Alert:
    """Close an open alert by hand; a later observation of its condition fires a new one."""
    if alert.status == "resolved":
        raise Conflict(f"alert {alert.id} is already resolved")
    _resolve(session=session, alert=alert, actor=actor, reason=reason, now=utcnow())
    session.flush()
    record_admin_event(session=session, actor=actor, action="alert.resolve",
                       target=f"alert:{alert.id}", reason=reason,
                       details={"kind": alert.kind, "deployment_id": alert.deployment_id},
                       deployment=_deployment_name(session, alert))
    return alert


def _resolve(*, session: Session, alert: Alert, actor: str, reason: str, now: datetime) -> None:
    alert.status = "resolved"
    alert.open_key = None
    alert.resolved_at = now
    alert.resolved_by = actor
    alert.resolution = reason
    log.info("alert %s resolved by %s: %s", alert.dedup_key, actor, reason)
    enqueue_deliveries(session=session, alert=alert, event="resolved")


# -- helpers -----------------------------------------------------------------------------------

def jsonable(value: Any) -> Any:
    """Evidence as plain JSON: non-finite floats become None, numpy scalars Python numbers."""
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple | set):
        return [jsonable(item) for item in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if hasattr(value, "item"):  # numpy scalar
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, int):
        return value
    return str(value)
