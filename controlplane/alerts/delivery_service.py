"""Alert deliveries: one `alerts.deliver` task per matching hook after the commit, one logged
attempt per run (the task retries), Alertmanager refreshes, test alerts, and the sweep's list
of sends lost with the broker."""

from __future__ import annotations

import logging
import time
from datetime import datetime

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from controlplane.alerts import hooks
from controlplane.alerts.guard import DestinationRefused, HookGuard
from controlplane.alerts.hook_service import hook_guard, hook_target, hooks_for
from controlplane.alerts.models import Alert, AlertDelivery, AlertHook
from controlplane.db import utcnow
from controlplane.deployments.models import Deployment
from controlplane.keys import SecretUnreadable
from controlplane.outbox import enqueue_task

log = logging.getLogger("exitplane.alerts")


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
