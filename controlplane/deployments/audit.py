"""The deployment audit log's one writer (thresholds, segments and runtimes services use it),
and the fleet-wide audit log: deployment events and administrative events
(controlplane/auth/audit.py) read together, newest first, filtered and paged by a keyset
cursor."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import and_, case, literal, or_, select, true
from sqlalchemy.orm import Session

from controlplane.auth.audit import audit_line, log_after_commit, split_target
from controlplane.auth.models import AdminEvent
from controlplane.db import utcnow
from controlplane.deployments.models import AuditEvent, Deployment
from controlplane.errors import Invalid

SOURCES = ("deployment", "admin")
# Within one instant, deployment events come before administrative ones (newest first).
_RANK = {"deployment": 1, "admin": 0}
MAX_PAGE = 500


def record_audit(*, session: Session, deployment: Deployment, actor: str, action: str,
                 reason: str, alias: str | None = None, from_version: int | None = None,
                 to_version: int | None = None, details: dict | None = None) -> AuditEvent:
    """One line of the deployment's audit log (who did what, from and to which version, why),
    added to the session: it is stored with the caller's transaction, and logged
    (`exitplane.audit`) when that commits."""
    at = utcnow()
    event = AuditEvent(deployment_id=deployment.id, actor=actor, action=action, alias=alias,
                       from_version=from_version, to_version=to_version, reason=reason,
                       details=details or {}, created_at=at)
    session.add(event)
    kind, ident = deployment_object(action=action, alias=alias, to_version=to_version,
                                    deployment=deployment.name)
    log_after_commit(session=session, row=event, line=audit_line(
        at=at, actor=actor, action=action, object_kind=kind, object_id=ident,
        deployment=deployment.name, reason=reason,
        details=_deployment_details(event)))
    return event


def archive_rows(*, session: Session, deployment: Deployment) -> list[dict]:
    """The deployment's audit events as rows of the fleet-wide administrative log (oldest
    first), for a deletion to keep: same time, actor, action, reason and object, the version
    moves in the details (`archived_from`: the deployment they were recorded under)."""
    events = session.scalars(select(AuditEvent).where(AuditEvent.deployment_id == deployment.id)
                             .order_by(AuditEvent.created_at, AuditEvent.id))
    rows = []
    for event in events:
        kind, ident = deployment_object(action=event.action, alias=event.alias,
                                        to_version=event.to_version, deployment=deployment.name)
        rows.append({"actor": event.actor, "action": event.action, "target": f"{kind}:{ident}",
                     "deployment": deployment.name, "reason": event.reason,
                     "details": {**_deployment_details(event),
                                 "archived_from": "deployment_audit"},
                     "created_at": event.created_at})
    return rows


def deployment_object(*, action: str, alias: str | None, to_version: int | None,
                      deployment: str) -> tuple[str, str]:
    """What a deployment event acted on: an alias ("alias", "chat/active"), a published
    threshold set ("threshold_set", "chat/v4"), else the deployment itself."""
    if alias is not None:
        return "alias", f"{deployment}/{alias}"
    if action == "threshold_set.publish" and to_version is not None:
        return "threshold_set", f"{deployment}/v{to_version}"
    return "deployment", deployment


def _deployment_details(event: AuditEvent) -> dict:
    moved = {key: value for key, value in (("alias", event.alias),
                                           ("from_version", event.from_version),
                                           ("to_version", event.to_version))
             if value is not None}
    return {**moved, **(event.details or {})}


# -- the fleet-wide log ----------------------------------------------------------------------

@dataclass(frozen=True)
class FleetEvent:
    """One audit event of either kind, in the fleet-wide log's terms."""

    source: str  # "deployment" or "admin"
    id: int
    at: datetime
    actor: str
    action: str
    object_kind: str
    object_id: str
    deployment: str | None
    reason: str
    details: dict

    @property
    def target(self) -> str:
        return f"{self.object_kind}:{self.object_id}" if self.object_kind else self.object_id

    @property
    def cursor(self) -> str:
        """The keyset position just past this event, for the next page."""
        raw = f"{self.at.isoformat()}|{self.source}|{self.id}".encode()
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")


@dataclass(frozen=True)
class Position:
    at: datetime
    source: str
    id: int


def parse_cursor(cursor: str) -> Position:
    """The position a cursor from an earlier page names; Invalid for anything else."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        at, source, ident = raw.split("|")
        position = Position(at=datetime.fromisoformat(at), source=source, id=int(ident))
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise Invalid("cursor is not one this log gave out; pass the `cursor` of the last "
                      "event of the page before, or none for the newest events") from None
    if position.source not in _RANK or position.at.tzinfo is None:
        raise Invalid("cursor is not one this log gave out; pass the `cursor` of the last "
                      "event of the page before, or none for the newest events")
    return position


@dataclass(frozen=True)
class AuditFilter:
    """The fleet-wide log's filters (None: any). `action` ending in `*` matches a family
    ("token.*")."""

    actor: str | None = None
    action: str | None = None
    deployment: str | None = None
    object_kind: str | None = None
    since: datetime | None = None
    until: datetime | None = None


def _matches(column, value: str):
    if value.endswith("*"):
        prefix = value[:-1].replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        return column.like(prefix + "%", escape="\\")
    return column == value


def _after(created_at, ident, source: str, position: Position | None):
    """Rows of `source` that come after `position` in newest-first order."""
    if position is None:
        return true()
    same_instant = created_at == position.at
    if _RANK[source] < _RANK[position.source]:
        return or_(created_at < position.at, same_instant)
    if _RANK[source] > _RANK[position.source]:
        return created_at < position.at
    return or_(created_at < position.at, and_(same_instant, ident < position.id))


def _common(model, source: str, rules: AuditFilter, position: Position | None) -> list:
    where = [_after(model.created_at, model.id, source, position)]
    if rules.actor is not None:
        where.append(_matches(model.actor, rules.actor))
    if rules.action is not None:
        where.append(_matches(model.action, rules.action))
    if rules.since is not None:
        where.append(model.created_at >= rules.since)
    if rules.until is not None:
        where.append(model.created_at < rules.until)
    return where


def _deployment_events(session: Session, rules: AuditFilter, position: Position | None,
                       limit: int) -> list[FleetEvent]:
    where = _common(AuditEvent, "deployment", rules, position)
    if rules.deployment is not None:
        where.append(Deployment.name == rules.deployment)
    if rules.object_kind is not None:
        kind = case((AuditEvent.alias.is_not(None), literal("alias")),
                    (and_(AuditEvent.action == "threshold_set.publish",
                          AuditEvent.to_version.is_not(None)), literal("threshold_set")),
                    else_=literal("deployment"))
        where.append(kind == rules.object_kind)
    rows = session.execute(
        select(AuditEvent, Deployment.name).join(Deployment, Deployment.id ==
                                                 AuditEvent.deployment_id)
        .where(*where).order_by(AuditEvent.created_at.desc(), AuditEvent.id.desc())
        .limit(limit)).all()
    found = []
    for event, name in rows:
        kind, ident = deployment_object(action=event.action, alias=event.alias,
                                        to_version=event.to_version, deployment=name)
        found.append(FleetEvent(
            source="deployment", id=event.id, at=event.created_at, actor=event.actor,
            action=event.action, object_kind=kind, object_id=ident, deployment=name,
            reason=event.reason, details=_deployment_details(event)))
    return found


def _admin_events(session: Session, rules: AuditFilter, position: Position | None,
                  limit: int) -> list[FleetEvent]:
    where = _common(AdminEvent, "admin", rules, position)
    if rules.deployment is not None:
        where.append(AdminEvent.deployment == rules.deployment)
    if rules.object_kind is not None:
        where.append(_matches(AdminEvent.target, f"{rules.object_kind}:*"))
    events = session.scalars(
        select(AdminEvent).where(*where)
        .order_by(AdminEvent.created_at.desc(), AdminEvent.id.desc()).limit(limit))
    found = []
    for event in events:
        kind, ident = split_target(event.target)
        found.append(FleetEvent(
            source="admin", id=event.id, at=event.created_at, actor=event.actor,
            action=event.action, object_kind=kind, object_id=ident,
            deployment=event.deployment, reason=event.reason, details=event.details or {}))
    return found


def fleet_audit(*, session: Session, rules: AuditFilter | None = None, limit: int = 100,
                cursor: str | None = None) -> list[FleetEvent]:
    """Every audit event of the fleet, deployment and administrative alike, newest first:
    `limit` (at most MAX_PAGE) of those `rules` match, after `cursor` (the `cursor` of the
    last event of the page before). Each table is read through its (created_at, id) index,
    at most `limit` rows each."""
    rules = rules or AuditFilter()
    if not 1 <= limit <= MAX_PAGE:
        raise Invalid(f"limit must be between 1 and {MAX_PAGE}")
    if rules.since is not None and rules.until is not None and rules.since >= rules.until:
        raise Invalid("since must be earlier than until")
    position = parse_cursor(cursor) if cursor else None
    merged = (_deployment_events(session, rules, position, limit)
              + _admin_events(session, rules, position, limit))
    merged.sort(key=lambda e: (e.at, _RANK[e.source], e.id), reverse=True)
    return merged[:limit]
