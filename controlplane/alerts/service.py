"""Alerts, hooks and deliveries: plain keyword-only functions over the store.

An alert is raised from a `Condition` a detector observed; while one is open (firing or
acknowledged) for the same dedup key, observing the condition again only refreshes it. When a
check no longer sees the condition, the alert resolves itself once it stayed clear for
`clear_after_s`. Delivery to hooks happens in the `alerts.deliver` task, enqueued only after the
commit that stored the alert (`controlplane.outbox`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import delete, func, or_, select
from sqlalchemy.orm import Session

from controlplane.alerts import hooks, reactions
from controlplane.alerts.guard import DestinationRefused, HookGuard
from controlplane.alerts.models import (
    HOOK_KINDS,
    KINDS,
    SEVERITIES,
    STATUSES,
    Alert,
    AlertDelivery,
    AlertHook,
)
from controlplane.db import utcnow
from controlplane.errors import Conflict, Invalid, NotFound
from controlplane.keys import SecretUnreadable
from controlplane.outbox import enqueue_task
from controlplane.thresholds.models import Deployment
from exitplane import tracing

log = logging.getLogger("exitplane.alerts")

SEVERITY_RANK = {name: rank for rank, name in enumerate(SEVERITIES)}
SYSTEM_ACTOR = "system"


@dataclass(frozen=True)
class Condition:
    """What a detector observed on a deployment; `subject` tells one instance from another
    (the exit layer, a runtime id, or "all")."""

    kind: str
    severity: str
    summary: str
    subject: str = "all"
    layer: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    report_html: str | None = None

    def dedup_key(self, deployment: Deployment) -> str:
        return f"{deployment.name}:{self.kind}:{self.subject}"


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
                kinds: Iterable[str] | None = None) -> list[Alert]:
    query = select(Alert).where(Alert.deployment_id == deployment.id, Alert.open_key.is_not(None))
    if kinds is not None:
        query = query.where(Alert.kind.in_(list(kinds)))
    return list(session.scalars(query.order_by(Alert.id)))


def fire(*, session: Session, deployment: Deployment, condition: Condition,
         now: datetime | None = None, reports_dir: Path | None = None) -> tuple[Alert, bool]:
    """The open alert for the condition's key, refreshed; or a new one (True) that fires."""
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
        session.flush()
        return alert, False
    alert = Alert(deployment_id=deployment.id, kind=condition.kind, layer=condition.layer,
                  severity=condition.severity, dedup_key=key, open_key=key, status="firing",
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
    if condition.report_html and reports_dir is not None:
        alert.report_path = _write_report(reports_dir, deployment, alert, condition.report_html)
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
              reports_dir: Path | None = None) -> Reconciled:
    """Fire/refresh alerts for `conditions`; open alerts of `checked_kinds` that were not
    observed start their clear period and resolve once it has lasted `clear_after_s`."""
    now = now or utcnow()
    result = Reconciled()
    seen = set()
    for condition in conditions:
        alert, created = fire(session=session, deployment=deployment, condition=condition,
                              now=now, reports_dir=reports_dir)
        seen.add(alert.id)
        if created:
            result.fired.append(alert)
        else:
            result.refreshed.append(alert)
            refresh_if_due(session=session, alert=alert, now=now)
    for alert in open_alerts(session=session, deployment=deployment, kinds=checked_kinds):
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
    enqueue_deliveries(session=session, alert=alert, event="acknowledged")
    return alert


def resolve(*, session: Session, alert: Alert, actor: str, reason: str) -> Alert:
    """Close an open alert by hand; a later observation of its condition fires a new one."""
    if alert.status == "resolved":
        raise Conflict(f"alert {alert.id} is already resolved")
    _resolve(session=session, alert=alert, actor=actor, reason=reason, now=utcnow())
    session.flush()
    return alert


def _resolve(*, session: Session, alert: Alert, actor: str, reason: str, now: datetime) -> None:
    alert.status = "resolved"
    alert.open_key = None
    alert.resolved_at = now
    alert.resolved_by = actor
    alert.resolution = reason
    log.info("alert %s resolved by %s: %s", alert.dedup_key, actor, reason)
    enqueue_deliveries(session=session, alert=alert, event="resolved")


def report_file(*, alert: Alert, reports_dir: Path) -> Path:
    """The stored HTML report of `alert`, or NotFound."""
    if not alert.report_path:
        raise NotFound(f"alert {alert.id} has no report")
    path = (reports_dir / alert.report_path).resolve()
    if not path.is_relative_to(reports_dir.resolve()) or not path.is_file():
        raise NotFound(f"the report of alert {alert.id} is no longer stored")
    return path


def _write_report(reports_dir: Path, deployment: Deployment, alert: Alert, html: str) -> str:
    relative = Path(deployment.name) / f"alert-{alert.id}-{alert.kind}.html"
    target = reports_dir / relative
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_suffix(".tmp")
    temporary.write_text(html, encoding="utf-8")
    temporary.replace(target)
    return str(relative)


# -- hooks -------------------------------------------------------------------------------------

def list_hooks(*, session: Session, deployment: Deployment | None = None) -> list[AlertHook]:
    query = select(AlertHook).order_by(AlertHook.id)
    if deployment is not None:
        query = query.where(or_(AlertHook.deployment_id == deployment.id,
                                AlertHook.deployment_id.is_(None)))
    return list(session.scalars(query))


def get_hook(*, session: Session, hook_id: int) -> AlertHook:
    hook = session.get(AlertHook, hook_id)
    if hook is None:
        raise NotFound(f"alert hook {hook_id} does not exist")
    return hook


def hook_guard(settings=None) -> HookGuard:
    """The allow-list and vault of `settings` (default: this process's)."""
    from controlplane.settings import get_settings

    return HookGuard.from_settings(settings or get_settings())


def create_hook(*, session: Session, name: str, kind: str, url: str, actor: str,
                deployment: Deployment | None = None, min_severity: str = "warning",
                secret: str | None = None, routing_key: str | None = None,
                enabled: bool = True, guard: HookGuard | None = None) -> AlertHook:
    """A hook whose URL may be reached (`guard.check`); webhook hooks get a random HMAC
    secret unless one is given. URL, secret and routing key are stored encrypted."""
    if kind not in HOOK_KINDS:
        raise Invalid(f"unknown hook kind {kind!r}; use one of {', '.join(HOOK_KINDS)}")
    if min_severity not in SEVERITIES:
        raise Invalid(f"unknown severity {min_severity!r}; use one of {', '.join(SEVERITIES)}")
    if kind == "pagerduty" and not routing_key:
        raise Invalid("a pagerduty hook needs routing_key (the integration key of the service)")
    guard = guard or hook_guard()
    guard.check(url, kind=kind, must_resolve=False)
    if kind == "webhook" and not secret:
        secret = hooks.new_secret()
    vault = guard.vault
    hook = AlertHook(deployment_id=deployment.id if deployment else None, name=name, kind=kind,
                     url=vault.encrypt(url), secret=vault.encrypt(secret),
                     routing_key=vault.encrypt(routing_key), min_severity=min_severity,
                     enabled=enabled, created_by=actor)
    session.add(hook)
    session.flush()
    return hook


def update_hook(*, session: Session, hook: AlertHook, changes: dict[str, Any],
                guard: HookGuard | None = None) -> AlertHook:
    """Apply `changes`; a new URL is checked like a new hook's, credentials are encrypted."""
    guard = guard or hook_guard()
    for name, value in changes.items():
        if name == "min_severity" and value not in SEVERITIES:
            raise Invalid(f"unknown severity {value!r}")
        if name == "url":
            guard.check(value, kind=hook.kind, must_resolve=False)
        if name in ("url", "secret", "routing_key"):
            value = guard.vault.encrypt(value)
        setattr(hook, name, value)
    if hook.kind == "pagerduty" and not hook.routing_key:
        raise Invalid("a pagerduty hook needs routing_key")
    session.flush()
    return hook


def hook_target(*, hook: AlertHook, guard: HookGuard) -> hooks.HookTarget:
    """The hook's URL and credentials decrypted, for one delivery (SecretUnreadable when the
    secret key changed since they were stored)."""
    vault = guard.vault
    return hooks.HookTarget(kind=hook.kind, url=vault.decrypt(hook.url),
                            secret=vault.decrypt(hook.secret),
                            routing_key=vault.decrypt(hook.routing_key))


def shown_url(*, hook: AlertHook, guard: HookGuard) -> str:
    """The hook's URL as people see it after creation: scheme, host and port only."""
    try:
        return hooks.redact_url(guard.vault.decrypt(hook.url))
    except SecretUnreadable:
        return "(unreadable with this secret key)"


def delete_hook(*, session: Session, hook: AlertHook) -> None:
    session.execute(delete(AlertDelivery).where(AlertDelivery.hook_id == hook.id))
    session.delete(hook)
    session.flush()


def hooks_for(*, session: Session, alert: Alert, event: str) -> list[AlertHook]:
    """Enabled hooks of the alert's deployment (or of all) whose severity filter it passes."""
    rank = SEVERITY_RANK[alert.severity]
    return [hook for hook in session.scalars(
        select(AlertHook).where(AlertHook.enabled.is_(True),
                                or_(AlertHook.deployment_id == alert.deployment_id,
                                    AlertHook.deployment_id.is_(None))).order_by(AlertHook.id))
            if SEVERITY_RANK[hook.min_severity] <= rank and hooks.accepts(hook.kind, event)]


# -- deliveries --------------------------------------------------------------------------------

def enqueue_deliveries(*, session: Session, alert: Alert, event: str) -> int:
    """One `alerts.deliver` task per matching hook, sent after the commit; returns how many."""
    matching = hooks_for(session=session, alert=alert, event=event)
    for hook in matching:
        enqueue_task(session, "alerts.deliver", [alert.id, hook.id, event])
    return len(matching)


def deliver(*, session: Session, alert_id: int, hook_id: int, event: str, base_url: str,
            timeout_s: float = 10.0, guard: HookGuard | None = None) -> AlertDelivery | None:
    """One attempt to send `event` of the alert to the hook, logged; None when already sent
    (the task is idempotent) or when the alert or hook no longer exists."""
    alert = session.get(Alert, alert_id)
    hook = session.get(AlertHook, hook_id)
    if alert is None or hook is None:
        return None
    if event == "refresh":
        last = _last_success(session=session, alert_id=alert_id, hook_id=hook_id)
        if last is not None and utcnow() - last < hooks.ALERTMANAGER_HOLD / 2:
            return None
    elif session.scalar(select(func.count()).select_from(AlertDelivery).where(
            AlertDelivery.alert_id == alert_id, AlertDelivery.hook_id == hook_id,
            AlertDelivery.event == event, AlertDelivery.ok.is_(True))):
        return None
    attempts = session.scalar(select(func.count()).select_from(AlertDelivery).where(
        AlertDelivery.alert_id == alert_id, AlertDelivery.hook_id == hook_id,
        AlertDelivery.event == event)) or 0
    deployment = session.get(Deployment, alert.deployment_id)
    snapshot = hooks.snapshot(alert=alert, deployment=deployment.name, base_url=base_url)
    return _attempt(session=session, hook=hook, alert_id=alert_id, event=event,
                    snapshot=snapshot, attempt=attempts + 1, timeout_s=timeout_s,
                    guard=guard or hook_guard())


def is_retryable(delivery: AlertDelivery) -> bool:
    """Network errors, 429 and 5xx are worth another attempt; other 4xx are not, nor a
    destination the guard refused or credentials that do not decrypt."""
    code = delivery.status_code
    if (delivery.error or "").startswith((hooks.REFUSED, hooks.UNREADABLE)):
        return False
    return not delivery.ok and (code is None or code == 429 or code >= 500)


def _last_success(*, session: Session, alert_id: int, hook_id: int) -> datetime | None:
    return session.scalar(select(func.max(AlertDelivery.created_at)).where(
        AlertDelivery.alert_id == alert_id, AlertDelivery.hook_id == hook_id,
        AlertDelivery.event.in_(("firing", "refresh")), AlertDelivery.ok.is_(True)))


def refresh_if_due(*, session: Session, alert: Alert, now: datetime | None = None) -> int:
    """Re-send a still-open alert to Alertmanager hooks before its endsAt lapses."""
    now = now or utcnow()
    due = 0
    for hook in hooks_for(session=session, alert=alert, event="refresh"):
        last = _last_success(session=session, alert_id=alert.id, hook_id=hook.id)
        if last is not None and now - last >= hooks.ALERTMANAGER_HOLD / 2:
            enqueue_task(session, "alerts.deliver", [alert.id, hook.id, "refresh"])
            due += 1
    return due


def send_test_alert(*, session: Session, hook: AlertHook, base_url: str, actor: str,
                    timeout_s: float = 10.0, guard: HookGuard | None = None) -> AlertDelivery:
    """Send a clearly marked test alert to the hook now (one attempt, logged)."""
    deployment = session.get(Deployment, hook.deployment_id) if hook.deployment_id else None
    snapshot = hooks.test_snapshot(hook_id=hook.id, deployment=deployment.name if deployment
                                   else "all", actor=actor, base_url=base_url)
    return _attempt(session=session, hook=hook, alert_id=None, event="test", snapshot=snapshot,
                    attempt=1, timeout_s=timeout_s, guard=guard or hook_guard())


def _attempt(*, session: Session, hook: AlertHook, alert_id: int | None, event: str,
             snapshot: dict, attempt: int, timeout_s: float, guard: HookGuard) -> AlertDelivery:
    started = time.monotonic()
    try:
        target = hook_target(hook=hook, guard=guard)
        # Checked again at every delivery: DNS may point the name elsewhere since creation.
        destination = guard.check(target.url, kind=hook.kind)
    except SecretUnreadable as error:
        outcome = hooks.Outcome(False, None, f"{hooks.UNREADABLE}: {error}", False)
    except DestinationRefused as refused:
        # A name that does not resolve may come back; a refused address will not.
        reason = hooks.UNRESOLVED if refused.retryable else hooks.REFUSED
        outcome = hooks.Outcome(False, None, f"{reason}: {refused}", refused.retryable)
    else:
        request = hooks.build_request(hook=target, alert=snapshot, event=event)
        outcome = hooks.post(request, destination=destination, timeout_s=timeout_s,
                             verify=guard.tls_verify)
    delivery = AlertDelivery(hook_id=hook.id, alert_id=alert_id, event=event, attempt=attempt,
                             ok=outcome.ok, status_code=outcome.status_code,
                             error=outcome.error,
                             duration_ms=round((time.monotonic() - started) * 1000, 3))
    session.add(delivery)
    session.flush()
    if not outcome.ok:
        log.warning("delivery of %s/%s to hook %s failed (attempt %d): %s", alert_id, event,
                    hook.id, attempt, outcome.error)
    return delivery


def undelivered(*, session: Session, since: datetime, before: datetime
                ) -> list[tuple[int, int, str]]:
    """(alert id, hook id, event) of firing / resolved events between `since` and `before`
    that no hook attempt was ever logged for: sends lost with the broker, for a sweep."""
    window = (Alert.fired_at >= since) & (Alert.fired_at < before)
    resolved = (Alert.resolved_at >= since) & (Alert.resolved_at < before)
    alerts = list(session.scalars(select(Alert).where(or_(window, resolved))))
    if not alerts:
        return []
    attempted = {tuple(row) for row in session.execute(
        select(AlertDelivery.alert_id, AlertDelivery.hook_id, AlertDelivery.event)
        .where(AlertDelivery.alert_id.in_([a.id for a in alerts])))}
    missing = []
    for alert in alerts:
        events = [("firing", alert.fired_at), ("resolved", alert.resolved_at)]
        for event_name, moment in events:
            if moment is None or not since <= moment < before:
                continue
            for hook in hooks_for(session=session, alert=alert, event=event_name):
                if hook.created_at <= moment and (alert.id, hook.id, event_name) not in attempted:
                    missing.append((alert.id, hook.id, event_name))
    return missing


def list_deliveries(*, session: Session, hook: AlertHook | None = None,
                    alert: Alert | None = None, limit: int = 100,
                    before_id: int | None = None) -> list[AlertDelivery]:
    query = select(AlertDelivery)
    if hook is not None:
        query = query.where(AlertDelivery.hook_id == hook.id)
    if alert is not None:
        query = query.where(AlertDelivery.alert_id == alert.id)
    if before_id is not None:
        query = query.where(AlertDelivery.id < before_id)
    return list(session.scalars(query.order_by(AlertDelivery.id.desc()).limit(limit)))


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
