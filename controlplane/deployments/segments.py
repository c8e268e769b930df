"""The traffic segments a deployment knows: the operator's to declare and remove, capped so that
the segment label's cardinality stays bounded in the store, the gauges and the UI.

A name is in use once an operator declares it, or publishes a threshold set that maps it, while
fewer than EXITPLANE_MAX_SEGMENTS_PER_DEPLOYMENT are in use. Runtime telemetry registers a name
only where the deployment opted in (`auto_segments`), and never one an operator removed: a
runtime names the segment of each request, but what a runtime says is evidence, not a
decision. Traffic of any name not in use is stored as `default` (and applies the default
thresholds on the runtime, which has no map for it). `default` itself is always known and never
registered.

Removing a segment keeps its row (`removed_at`): its traffic stored so far stays readable under
its name (`readable_segments`); from then on its traffic is stored as `default`. A segment that
an aliased threshold set maps cannot be removed: the runtimes apply that map to its traffic.
`undeclared_tokens` reads what telemetry ingest counted of traffic stored as `default` so.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controlplane.db import utcnow
from controlplane.deployments.audit import record_audit
from controlplane.deployments.locks import lock_deployment
from controlplane.deployments.models import (
    Alias,
    Deployment,
    DeploymentSegment,
    ThresholdSet,
    UndeclaredSegmentTokens,
)
from controlplane.errors import Conflict, Invalid, NotFound
from controlplane.settings import get_settings
from exitplane.wire import DEFAULT_SEGMENT, NAME_PATTERN

# session.info key: deployment ids whose registry this transaction changed (the per-process
# admission cache, controlplane/telemetry/admission.py, drops them when it commits).
REGISTRY_CHANGED = "exitplane.segment_registry_changed"


def known_segments(*, session: Session, deployment_id: int) -> list[str]:
    """The deployment's segments in use, sorted (`default` and removed ones not included)."""
    return list(session.scalars(select(DeploymentSegment.name)
                                .where(DeploymentSegment.deployment_id == deployment_id,
                                       DeploymentSegment.removed_at.is_(None))
                                .order_by(DeploymentSegment.name)))


def readable_segments(*, session: Session, deployment_id: int) -> list[str]:
    """Every segment whose stored traffic can be read: in use or removed, sorted."""
    return list(session.scalars(select(DeploymentSegment.name)
                                .where(DeploymentSegment.deployment_id == deployment_id)
                                .order_by(DeploymentSegment.name)))


def segment_registry(*, session: Session, deployment_id: int) -> list[DeploymentSegment]:
    """The deployment's segment rows, in use and removed, by name."""
    return list(session.scalars(select(DeploymentSegment)
                                .where(DeploymentSegment.deployment_id == deployment_id)
                                .order_by(DeploymentSegment.name)))


def _registry(session: Session, deployment_id: int) -> dict[str, DeploymentSegment]:
    return {row.name: row for row in segment_registry(session=session,
                                                      deployment_id=deployment_id)}


def registry_changed(*, session: Session, deployment_id: int) -> None:
    """Say that this transaction changed what the deployment stores under which segment (its
    registry or its opt-in): each process's admission cache reads it again after the commit."""
    session.info.setdefault(REGISTRY_CHANGED, set()).add(deployment_id)


def check_segment_name(name: str) -> str:
    """`name` if an operator may declare it, else Invalid saying why."""
    if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name):
        raise Invalid(f"segment name {str(name)[:80]!r} is invalid: use 1-63 lowercase "
                      "letters, digits, '_', '.' or '-', starting with a letter or digit")
    if name == DEFAULT_SEGMENT:
        raise Invalid(f"{DEFAULT_SEGMENT!r} is every deployment's own segment; it needs no "
                      "declaration and cannot be removed")
    return name


def _full(deployment: str, in_use: int, adding: list[str]) -> Invalid:
    return Invalid(f"deployment {deployment!r} already uses {in_use} segments, the most it may "
                   f"(EXITPLANE_MAX_SEGMENTS_PER_DEPLOYMENT); cannot add {adding}: remove one "
                   "first (exitplane segments remove)")


def declare_segment(*, session: Session, deployment: Deployment, name: str, actor: str,
                    reason: str = "declared", limit: int | None = None) -> DeploymentSegment:
    """Put `name` in use for `deployment` (again, if it was removed); a name in use is left as
    it is. Invalid for a bad name or a full registry."""
    check_segment_name(name)
    lock_deployment(session=session, deployment_id=deployment.id)
    registry = _registry(session, deployment.id)
    row = registry.get(name)
    if row is not None and row.removed_at is None:
        return row
    in_use = sum(1 for other in registry.values() if other.removed_at is None)
    if in_use >= (limit if limit is not None else get_settings().max_segments_per_deployment):
        raise _full(deployment.name, in_use, [name])
    if row is None:
        row = DeploymentSegment(deployment_id=deployment.id, name=name, origin="operator")
        session.add(row)
    else:
        row.removed_at, row.origin, row.created_at = None, "operator", utcnow()
    record_audit(session=session, deployment=deployment, actor=actor, action="segment.declare",
                 reason=reason, details={"segment": name})
    registry_changed(session=session, deployment_id=deployment.id)
    session.flush()
    return row


def remove_segment(*, session: Session, deployment: Deployment, name: str, actor: str,
                   reason: str = "removed") -> DeploymentSegment:
    """Take `name` out of use: its traffic is stored as `default` from now on, what was stored
    stays readable. NotFound when it is not in use; Conflict while an aliased set maps it."""
    check_segment_name(name)
    lock_deployment(session=session, deployment_id=deployment.id)
    row = _registry(session, deployment.id).get(name)
    if row is None or row.removed_at is not None:
        raise NotFound(f"deployment {deployment.name!r} has no segment {name!r} in use")
    mapped = session.execute(
        select(Alias.name, ThresholdSet.version, ThresholdSet.segments)
        .join(ThresholdSet, (ThresholdSet.deployment_id == Alias.deployment_id)
              & (ThresholdSet.version == Alias.version))
        .where(Alias.deployment_id == deployment.id).order_by(Alias.name)).all()
    holding = [f"{alias} (v{version})" for alias, version, segments in mapped
               if name in (segments or {})]
    if holding:
        raise Conflict(f"segment {name!r} has thresholds of its own in {', '.join(holding)}; "
                       "publish and activate a version without its map first")
    row.removed_at = utcnow()
    record_audit(session=session, deployment=deployment, actor=actor, action="segment.remove",
                 reason=reason, details={"segment": name, "origin": row.origin})
    registry_changed(session=session, deployment_id=deployment.id)
    session.flush()
    return row


def admit_segments(*, session: Session, deployment_id: int, names: Iterable[str],
                   auto: bool = False, limit: int | None = None) -> dict[str, str]:
    """Each of `names` -> the segment its traffic is stored under: itself when it is in use,
    else `default`. With `auto` (the deployment opted in), a name never seen before is
    registered (origin 'telemetry', in the caller's transaction) while the registry has room;
    new names are taken in sorted order, so concurrent writers agree."""
    names = set(names)
    wanted = sorted(names - {DEFAULT_SEGMENT})
    admitted = {DEFAULT_SEGMENT: DEFAULT_SEGMENT} if DEFAULT_SEGMENT in names else {}
    if not wanted:
        return admitted
    if limit is None:
        limit = get_settings().max_segments_per_deployment
    registry = _registry(session, deployment_id)
    in_use = {name for name, row in registry.items() if row.removed_at is None}
    new = [name for name in wanted if name not in registry]  # a removed name is not revived
    if auto and new and len(in_use) < limit:
        # The deployment row lock serialises registrations, so the cap holds across writers
        # (FOR NO KEY UPDATE: see locks.py).
        lock_deployment(session=session, deployment_id=deployment_id)
        registry = _registry(session, deployment_id)
        in_use = {name for name, row in registry.items() if row.removed_at is None}
        for name in new:
            if name not in registry and len(in_use) < limit:
                session.add(DeploymentSegment(deployment_id=deployment_id, name=name,
                                              origin="telemetry"))
                in_use.add(name)
                registry_changed(session=session, deployment_id=deployment_id)
        session.flush()
    return admitted | {name: name if name in in_use else DEFAULT_SEGMENT for name in wanted}


def register_set_segments(*, session: Session, deployment_id: int, names: Iterable[str],
                          limit: int | None = None) -> None:
    """Put in use the segments a threshold set maps (publishing one is an operator's or a
    calibration's act); Invalid when the deployment cannot take them all (a set's map for a
    segment whose traffic would be stored as `default` would never be checked against it)."""
    names = sorted(set(names))
    if not names:
        return
    if limit is None:
        limit = get_settings().max_segments_per_deployment
    registry = _registry(session, deployment_id)
    missing = [name for name in names
               if name not in registry or registry[name].removed_at is not None]
    if not missing:
        return
    lock_deployment(session=session, deployment_id=deployment_id)
    registry = _registry(session, deployment_id)
    in_use = sum(1 for row in registry.values() if row.removed_at is None)
    missing = [name for name in names
               if name not in registry or registry[name].removed_at is not None]
    if in_use + len(missing) > limit:
        deployment = session.get(Deployment, deployment_id)
        raise _full(deployment.name if deployment else str(deployment_id), in_use, missing)
    for name in missing:
        row = registry.get(name)
        if row is None:
            session.add(DeploymentSegment(deployment_id=deployment_id, name=name,
                                          origin="threshold_set"))
        else:
            row.removed_at, row.origin, row.created_at = None, "threshold_set", utcnow()
    registry_changed(session=session, deployment_id=deployment_id)
    session.flush()


def undeclared_tokens(*, session: Session, deployment: Deployment, since: datetime
                      ) -> list[dict]:
    """Per runtime since `since`: tokens stored as `default` because their segment was not in
    use, and the batches that carried them; most tokens first."""
    rows = session.execute(
        select(UndeclaredSegmentTokens.runtime_id,
               func.sum(UndeclaredSegmentTokens.tokens).label("tokens"),
               func.sum(UndeclaredSegmentTokens.batches).label("batches"),
               func.max(UndeclaredSegmentTokens.minute).label("last"))
        .where(UndeclaredSegmentTokens.deployment_id == deployment.id,
               UndeclaredSegmentTokens.minute >= since)
        .group_by(UndeclaredSegmentTokens.runtime_id))
    found = [{"runtime_id": row.runtime_id, "tokens": int(row.tokens or 0),
              "batches": int(row.batches or 0), "last_minute": row.last} for row in rows]
    return sorted(found, key=lambda item: (-item["tokens"], item["runtime_id"]))
