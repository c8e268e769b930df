"""Alert delivery: one attempt per run, logged; retried with exponential backoff and jitter."""

from __future__ import annotations

import random
from datetime import timedelta

from celery import shared_task

from controlplane.alerts.delivery_service import deliver as deliver_once
from controlplane.alerts.delivery_service import is_retryable, undelivered
from controlplane.db import get_engine, session_scope, utcnow
from controlplane.settings import get_settings

BACKOFF_MAX_S = 600.0


def backoff_s(retries: int, base_s: float, *, rng: random.Random | None = None) -> float:
    """Full-jitter exponential backoff: uniform in [base/2, base * 2^retries], capped."""
    ceiling = min(BACKOFF_MAX_S, base_s * 2 ** retries)
    return (rng or random).uniform(min(base_s / 2, ceiling), ceiling)


@shared_task(name="alerts.deliver", bind=True, max_retries=None)
def deliver(self, alert_id: int, hook_id: int, event: str) -> dict:
    """Send `event` of an alert to a hook; a no-op once it was delivered."""
    settings = get_settings()
    with session_scope(get_engine(settings.effective_database_url)) as session:
        delivery = deliver_once(session=session, alert_id=alert_id, hook_id=hook_id, event=event,
                                base_url=settings.base_url,
                                timeout_s=settings.delivery_timeout_s)
        outcome = None if delivery is None else {
            "attempt": delivery.attempt, "ok": delivery.ok, "status_code": delivery.status_code,
            "error": delivery.error, "retry": is_retryable(delivery)}
    if outcome is None:
        return {"skipped": "already delivered, or the alert or hook is gone"}
    if outcome["retry"] and self.request.retries < settings.delivery_max_retries:
        raise self.retry(countdown=backoff_s(self.request.retries, settings.delivery_backoff_s))
    return outcome


@shared_task(name="alerts.sweep")
def sweep() -> list[list]:
    """Queue deliveries whose send was lost (broker away at commit) in the last day."""
    settings = get_settings()
    now = utcnow()
    with session_scope(get_engine(settings.effective_database_url)) as session:
        missing = undelivered(session=session, since=now - timedelta(days=1),
                              before=now - timedelta(minutes=2))
    for alert_id, hook_id, event in missing:
        deliver.apply_async(args=[alert_id, hook_id, event])
    return [list(item) for item in missing]
