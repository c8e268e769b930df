"""The audit trail's one writer for administrative actions (tokens, users and roles, alert
hooks, alert acknowledgements and resolutions), and the log line every audit event also
writes: one line of the `exitplane.audit` logger per event, once the transaction that stores
the event commits (none for a transaction rolled back), carrying the fields the fleet-wide
audit log answers with (`audit` in a JSON log line). An install without a log pipeline still
has each step in its process log; one with a pipeline ships the lines."""

from __future__ import annotations

import logging
from datetime import datetime

from sqlalchemy import event, inspect, select
from sqlalchemy.orm import Session

from controlplane.auth.models import AdminEvent
from controlplane.db import utcnow

log = logging.getLogger("exitplane.audit")

# The actor of a change made with direct access to the store (the `exitplane` CLI's store
# commands on the control plane's host).
LOCAL_ACTOR = "local"

# session.info key: the audit lines a transaction writes once it commits.
PENDING_LINES = "exitplane_audit_lines"


def split_target(target: str) -> tuple[str, str]:
    """("token", "12") for the target "token:12"; a target without a kind is its own id."""
    kind, sep, ident = target.partition(":")
    return (kind, ident) if sep else ("", target)


def audit_line(*, at: datetime, actor: str, action: str, object_kind: str, object_id: str,
               deployment: str | None, reason: str, details: dict) -> dict:
    """An audit event as its log line carries it: the fleet-wide log's fields."""
    return {"at": at.isoformat(), "actor": actor, "action": action,
            "object": {"kind": object_kind, "id": object_id}, "deployment": deployment,
            "reason": reason or None, "details": details}


def log_after_commit(*, session: Session, row: object, line: dict) -> None:
    """Write `line` to the `exitplane.audit` log once the session's transaction commits, if
    `row` (the stored event) is in the store by then."""
    session.info.setdefault(PENDING_LINES, []).append((row, line))


def escape_field(text: str) -> str:
    """`text` for one field of the text log line: every character that is not printable
    (newlines, tabs, terminal escapes, DEL, the C1 range, line separators) and the backslash
    written as a Python escape (\\n, \\x1b, \\u2028, \\\\), so no value can end the line
    or forge another. The stored event and the JSON line keep the value as given."""
    return "".join(char if char.isprintable() and char != "\\"
                   else char.encode("unicode_escape").decode("ascii") for char in text)


def _write(line: dict) -> None:
    target = f"{line['object']['kind']}:{line['object']['id']}"
    reason = f": {escape_field(line['reason'])}" if line["reason"] else ""
    log.info("audit: %s %s %s%s", escape_field(line["actor"]), escape_field(line["action"]),
             escape_field(target), reason, extra={"audit": line})


@event.listens_for(Session, "after_commit")
def _write_committed_lines(session: Session) -> None:
    if session.in_nested_transaction():  # a savepoint released; the transaction goes on
        return
    for row, line in session.info.pop(PENDING_LINES, []):
        # A row added in a savepoint that rolled back is no longer persistent.
        if inspect(row).persistent:
            _write(line)


@event.listens_for(Session, "after_transaction_end")
def _drop_uncommitted_lines(session: Session, transaction) -> None:
    # After a commit the lines were written; whatever is left was rolled back.
    if transaction.parent is None:
        session.info.pop(PENDING_LINES, None)


def record_admin_event(*, session: Session, actor: str, action: str, target: str,
                       reason: str = "", details: dict | None = None,
                       deployment: str | None = None) -> AdminEvent:
    """Add one administrative audit event to the session (stored with the caller's
    transaction, logged when it commits). `target` names what the action was on as
    "kind:id" ("token:12", "user:alice"); `deployment` names the deployment it concerns."""
    at = utcnow()
    event_row = AdminEvent(actor=actor, action=action, target=target, reason=reason,
                           details=details or {}, deployment=deployment, created_at=at)
    session.add(event_row)
    kind, ident = split_target(target)
    log_after_commit(session=session, row=event_row, line=audit_line(
        at=at, actor=actor, action=action, object_kind=kind, object_id=ident,
        deployment=deployment, reason=reason, details=event_row.details))
    return event_row


def admin_events(*, session: Session, limit: int = 100, before_id: int | None = None,
                 action: str | None = None) -> list[AdminEvent]:
    """The newest administrative events first (`before_id`: older than that one)."""
    query = select(AdminEvent).order_by(AdminEvent.id.desc()).limit(limit)
    if before_id is not None:
        query = query.where(AdminEvent.id < before_id)
    if action is not None:
        query = query.where(AdminEvent.action == action)
    return list(session.scalars(query))
