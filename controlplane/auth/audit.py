"""The audit trail's one writer for administrative actions (tokens, users and roles, alert
hooks, alert acknowledgements and resolutions), and the log line every audit event also
writes (logger `exitplane.audit`), so an embedded install without a log pipeline still has
each step in its process log."""

from __future__ import annotations

import logging

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.auth.models import AdminEvent

log = logging.getLogger("exitplane.audit")

# The actor of a change made with direct access to the store (the `exitplane` CLI's store
# commands on the control plane's host).
LOCAL_ACTOR = "local"


def log_audit(*, actor: str, action: str, target: str, reason: str = "") -> None:
    """One INFO line of the `exitplane.audit` logger for an audit event."""
    log.info("audit: %s %s %s%s", actor, action, target, f": {reason}" if reason else "",
             extra={"audit_actor": actor, "audit_action": action, "audit_target": target})


def record_admin_event(*, session: Session, actor: str, action: str, target: str,
                       reason: str = "", details: dict | None = None) -> AdminEvent:
    """Add one administrative audit event to the session (stored with the caller's
    transaction) and log it."""
    event = AdminEvent(actor=actor, action=action, target=target, reason=reason,
                       details=details or {})
    session.add(event)
    log_audit(actor=actor, action=action, target=target, reason=reason)
    return event


def admin_events(*, session: Session, limit: int = 100, before_id: int | None = None,
                 action: str | None = None) -> list[AdminEvent]:
    """The newest administrative events first (`before_id`: older than that one)."""
    query = select(AdminEvent).order_by(AdminEvent.id.desc()).limit(limit)
    if before_id is not None:
        query = query.where(AdminEvent.id < before_id)
    if action is not None:
        query = query.where(AdminEvent.action == action)
    return list(session.scalars(query))
