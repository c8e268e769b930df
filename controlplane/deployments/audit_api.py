"""Thin route for the fleet-wide audit log (admin only): deployment events and administrative
events together, filtered, newest first, paged by cursor."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel

from controlplane.auth.deps import AdminPrincipal
from controlplane.db import SessionDep
from controlplane.deployments.audit import MAX_PAGE, AuditFilter, FleetEvent, fleet_audit
from controlplane.deployments.schemas import NAME_PATTERN

router = APIRouter(prefix="/v1/audit", tags=["auth"])


class AuditObject(BaseModel):
    """What an action was on: its kind (token, user, hook, alert, deployment, alias,
    threshold_set ...) and its id or name."""

    kind: str
    id: str


class FleetEventRead(BaseModel):
    """One audit event: who (`actor`), did what (`action`), on what (`object`, and `target`
    as "kind:id"), in which deployment, why, when (`at`; `created_at` is the same instant).
    `source` says which log holds it (`deployment`: also listed at
    /v1/deployments/{name}/audit; `admin`); `id` is unique within its source. `cursor` asks
    for the events after this one."""

    id: int
    source: Literal["deployment", "admin"]
    at: datetime
    created_at: datetime
    actor: str
    action: str
    object: AuditObject
    target: str
    deployment: str | None
    reason: str | None
    details: dict
    cursor: str

    @classmethod
    def of(cls, event: FleetEvent) -> FleetEventRead:
        return cls(id=event.id, source=event.source, at=event.at, created_at=event.at,
                   actor=event.actor, action=event.action,
                   object=AuditObject(kind=event.object_kind, id=event.object_id),
                   target=event.target, deployment=event.deployment,
                   reason=event.reason or None, details=event.details, cursor=event.cursor)


def _utc(moment: datetime | None) -> datetime | None:
    if moment is None or moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=UTC)


@router.get("", response_model=list[FleetEventRead])
def list_audit_events(
        session: SessionDep, principal: AdminPrincipal,
        actor: Annotated[str | None, Query(
            max_length=200, description="only this actor (`user:alice`, `token:ci`, "
                                        "`system:fallback`); a trailing * matches a prefix")
        ] = None,
        action: Annotated[str | None, Query(
            max_length=51, description="only this action (`alias.rollback`); a trailing * "
                                       "matches a family (`token.*`)")] = None,
        deployment: Annotated[str | None, Query(
            pattern=NAME_PATTERN, description="only events of this deployment")] = None,
        object_kind: Annotated[str | None, Query(
            pattern=r"^[a-z][a-z_]{0,29}$",
            description="only actions on this kind of object (token, user, hook, alert, "
                        "deployment, alias, threshold_set ...)")] = None,
        since: Annotated[datetime | None, Query(
            description="events at or after this ISO time (UTC if no offset)")] = None,
        until: Annotated[datetime | None, Query(
            description="events before this ISO time (UTC if no offset)")] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
        cursor: Annotated[str | None, Query(
            max_length=200, description="the `cursor` of the last event of the page before"
        )] = None) -> list[FleetEventRead]:
    """Every audit event of the fleet, newest first: deployment changes (alias moves,
    publications, rollbacks, canaries, calibration decisions, segments, runtimes) and
    administrative actions (tokens, users and roles, alert hooks, alert acknowledgements and
    resolutions), by people, tokens and the workers (`system:...`). At most `limit` a page;
    pass the last event's `cursor` for the next page (an empty page is the end)."""
    rules = AuditFilter(actor=actor, action=action, deployment=deployment,
                        object_kind=object_kind, since=_utc(since), until=_utc(until))
    return [FleetEventRead.of(event) for event in fleet_audit(
        session=session, rules=rules, limit=limit, cursor=cursor)]
