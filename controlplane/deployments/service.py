"""Deployments, threshold-set publishing, alias moves and rollback: plain keyword-only functions.

Services flush, never commit: the caller's unit of work (the request dependency, a worker's
session_scope) commits. Every alias move locks the deployment row, so concurrent moves queue
instead of losing an update, and writes an audit event in the same transaction.
"""

from __future__ import annotations

import hashlib
import re

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controlplane.coordination.bus import notify_after_commit
from controlplane.db import utcnow
from controlplane.deployments import shadow_rate
from controlplane.deployments.audit import record_audit
from controlplane.deployments.locks import DEPLOYMENT_LOCK, lock_deployment
from controlplane.deployments.models import ALIASES, Alias, AuditEvent, Deployment, ThresholdSet
from controlplane.deployments.schemas import DeploymentCreate, DeploymentUpdate
from controlplane.deployments.segments import register_set_segments, registry_changed
from controlplane.errors import Conflict, Invalid, NotFound
from controlplane.settings import get_settings
from exitplane.kit import tracing
from exitplane.wire import (
    DEFAULT_SEGMENT,
    NAME_PATTERN,
    NEVER_EXIT,
    Origin,
    Signal,
    ThresholdSetWire,
    validate_thresholds,
)


def get_deployment(*, session: Session, name: str, lock: bool = False) -> Deployment:
    """The deployment called `name`; `lock` takes its row lock for a read-modify-write."""
    query = select(Deployment).where(Deployment.name == name)
    if lock:
        query = query.with_for_update(**DEPLOYMENT_LOCK)
    deployment = session.scalars(query).one_or_none()
    if deployment is None:
        raise NotFound(f"deployment {name!r} does not exist")
    return deployment


def list_deployments(*, session: Session) -> list[Deployment]:
    return list(session.scalars(select(Deployment).order_by(Deployment.name)))


def aliases_of(*, session: Session, deployment: Deployment) -> dict[str, int]:
    rows = session.execute(select(Alias.name, Alias.version)
                           .where(Alias.deployment_id == deployment.id))
    return {name: version for name, version in rows}


def create_deployment(*, session: Session, spec: DeploymentCreate, actor: str) -> Deployment:
    """Create a deployment with version 1, a never-exit set that is both active and conservative."""
    exists = session.scalar(select(Deployment.id).where(Deployment.name == spec.name))
    if exists is not None:
        raise Conflict(f"deployment {spec.name!r} already exists")
    deployment = Deployment(**spec.model_dump())
    session.add(deployment)
    session.flush()
    record_audit(session=session, deployment=deployment, actor=actor,
                 action="deployment.create", reason="created",
                 details={"exit_layers": deployment.exit_layers})
    conservative = publish(
        session=session, deployment=deployment, actor=actor, origin=Origin.fallback,
        thresholds=dict.fromkeys(deployment.exit_layers, NEVER_EXIT),
        reason="built-in conservative set: never exit")
    for alias in ("conservative", "active"):
        move_alias(session=session, deployment=deployment, alias=alias,
                   version=conservative.version, actor=actor, reason="deployment created")
    shadow_rate.bounds_changed(session=session, deployment=deployment)
    return deployment


def update_deployment(*, session: Session, deployment: Deployment, spec: DeploymentUpdate,
                      actor: str) -> Deployment:
    """Apply the settings `spec` changes; an audit event names each one that takes a new
    value (before and after). Values equal to the current ones change nothing and record
    nothing."""
    changes = {key: value for key, value in spec.changes().items()
               if getattr(deployment, key) != value}
    if not changes:
        return deployment
    low = changes.get("shadow_rate_min", deployment.shadow_rate_min)
    high = changes.get("shadow_rate_max", deployment.shadow_rate_max)
    if low > high:
        raise Invalid(f"shadow_rate_min ({low:g}) must not exceed shadow_rate_max ({high:g})")
    before = {key: getattr(deployment, key) for key in changes}
    for key, value in changes.items():
        setattr(deployment, key, value)
    if "auto_segments" in changes:
        registry_changed(session=session, deployment_id=deployment.id)
    if {"shadow_rate_min", "shadow_rate_max"} & changes.keys():
        shadow_rate.bounds_changed(session=session, deployment=deployment)
    if "shadow_request_rate" in changes and before["shadow_request_rate"] != \
            changes["shadow_request_rate"]:
        # It goes out with every pull: long-polls wake, as for an alias move.
        notify_after_commit(session=session, topic="config", message=deployment.name)
    record_audit(session=session, deployment=deployment, actor=actor,
                 action="deployment.update", reason="settings changed",
                 details={"before": before, "after": changes})
    session.flush()
    return deployment


def get_threshold_set(*, session: Session, deployment: Deployment, version: int) -> ThresholdSet:
    found = session.scalars(select(ThresholdSet).where(
        ThresholdSet.deployment_id == deployment.id, ThresholdSet.version == version)
    ).one_or_none()
    if found is None:
        raise NotFound(f"deployment {deployment.name!r} has no threshold set version {version}")
    return found


def list_threshold_sets(*, session: Session, deployment: Deployment, limit: int = 100,
                        before_version: int | None = None) -> list[ThresholdSet]:
    query = select(ThresholdSet).where(ThresholdSet.deployment_id == deployment.id)
    if before_version is not None:
        query = query.where(ThresholdSet.version < before_version)
    return list(session.scalars(query.order_by(ThresholdSet.version.desc()).limit(limit)))


@tracing.traced("thresholds.publish")
def publish(*, session: Session, deployment: Deployment, thresholds: dict[int, float],
            reason: str, actor: str, origin: Origin = Origin.manual, signal: Signal | None = None,
            parent_version: int | None = None, calibration_job_id: int | None = None,
            expected_metrics: dict | None = None,
            segments: dict[str, dict[int, float]] | None = None,
            max_segments: int | None = None) -> ThresholdSet:
    """Validate and store the next immutable version of `deployment`'s thresholds.

    `thresholds` is the `default` segment's map; `segments` gives other traffic segments maps
    of their own (each covering every exit layer), at most `max_segments` of them (default:
    the setting). One version, one checksum, either way."""
    try:
        validate_thresholds(thresholds, deployment.exit_layers)
    except ValueError as error:
        raise Invalid(str(error)) from error
    if max_segments is None:
        max_segments = get_settings().max_segments_per_deployment
    segments = validate_segments(segments=segments, exit_layers=deployment.exit_layers,
                                 limit=max_segments)
    if segments:
        register_set_segments(session=session, deployment_id=deployment.id, names=segments,
                              limit=max_segments)
    signal = Signal(signal or deployment.signal)
    # The deployment row lock serialises version numbering between concurrent publishers.
    lock_deployment(session=session, deployment_id=deployment.id)
    version = (session.scalar(select(func.max(ThresholdSet.version))
                              .where(ThresholdSet.deployment_id == deployment.id)) or 0) + 1
    wire = ThresholdSetWire.build(deployment=deployment.name, version=version, signal=signal,
                                  thresholds=thresholds, segments=segments,
                                  head_digest=made_for_heads(deployment=deployment,
                                                             thresholds=thresholds,
                                                             segments=segments))
    if parent_version is None:
        parent_version = aliases_of(session=session, deployment=deployment).get("active")
    threshold_set = ThresholdSet(
        deployment_id=deployment.id, version=version, signal=str(signal),
        thresholds=_stored_map(thresholds),
        segments={name: _stored_map(by_layer) for name, by_layer in sorted(segments.items())}
        if segments else None,
        origin=str(origin), parent_version=parent_version,
        calibration_job_id=calibration_job_id, reason=reason, author=actor,
        expected_metrics=expected_metrics or {}, head_digest=wire.head_digest,
        checksum=wire.checksum)
    session.add(threshold_set)
    record_audit(session=session, deployment=deployment, actor=actor,
                 action="threshold_set.publish", reason=reason, to_version=version,
                 details={"origin": str(origin),
                          **({"segments": sorted(segments)} if segments else {})})
    session.flush()
    return threshold_set


def made_for_heads(*, deployment: Deployment, thresholds: dict[int, float],
                   segments: dict[str, dict[int, float]] | None) -> str | None:
    """The heads digest a new set names: its deployment's, when the deployment names one and
    the set can exit somewhere; a set that never exits fits any heads (None), so a runtime on
    other heads still takes the conservative set."""
    maps = [thresholds, *(segments or {}).values()]
    can_exit = any(float(value) < NEVER_EXIT for by_layer in maps for value in by_layer.values())
    return (deployment.head_digest or None) if can_exit else None


def validate_segments(*, segments: dict[str, dict[int, float]] | None, exit_layers: list[int],
                      limit: int) -> dict[str, dict[int, float]] | None:
    """The segment map to store (None when it names no segment); Invalid says what is wrong.

    Names follow the deployment-name rule because they become metric labels and URL parts;
    `limit` caps how many segments one set names, which bounds that label's cardinality."""
    if not segments:
        return None
    if DEFAULT_SEGMENT in segments:
        raise Invalid(f"segment {DEFAULT_SEGMENT!r} is the set's own `thresholds`; give its "
                      "thresholds there, not under `segments`")
    if len(segments) > limit:
        raise Invalid(f"{len(segments)} segments given; a threshold set may name at most "
                      f"{limit} besides {DEFAULT_SEGMENT!r} (EXITPLANE_MAX_SEGMENTS_PER_DEPLOYMENT)"
                      "; send the rarer ones to the default thresholds")
    for name, by_layer in segments.items():
        if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name):
            raise Invalid(f"segment name {str(name)[:80]!r} is invalid: use 1-63 lowercase "
                          "letters, digits, '_', '.' or '-', starting with a letter or digit")
        try:
            validate_thresholds(by_layer, exit_layers)
        except ValueError as error:
            raise Invalid(f"segment {name!r}: {error}") from error
    return segments


def _stored_map(thresholds: dict[int, float]) -> dict[str, float]:
    return {str(layer): float(value) for layer, value in sorted(thresholds.items())}


def move_alias(*, session: Session, deployment: Deployment, alias: str, version: int,
               actor: str, reason: str, action: str = "alias.move",
               details: dict | None = None) -> AuditEvent:
    """Point `alias` at `version` under the deployment's row lock, with an audit event."""
    if alias not in ALIASES:
        raise Invalid(f"unknown alias {alias!r}; use one of {', '.join(ALIASES)}")
    get_threshold_set(session=session, deployment=deployment, version=version)
    current = _locked_alias(session=session, deployment=deployment, alias=alias)
    from_version = current.version if current else None
    if current is None:
        session.add(Alias(deployment_id=deployment.id, name=alias, version=version))
    else:
        current.version = version
        current.updated_at = utcnow()
    deployment.revision += 1
    notify_after_commit(session=session, topic="config", message=deployment.name)
    event = record_audit(session=session, deployment=deployment, actor=actor, action=action,
                         alias=alias, from_version=from_version, to_version=version,
                         reason=reason, details=details or {})
    session.flush()
    return event


def clear_alias(*, session: Session, deployment: Deployment, alias: str, actor: str,
                reason: str) -> AuditEvent:
    """Remove an optional alias (only `canary` may be removed)."""
    if alias != "canary":
        raise Invalid(f"alias {alias!r} cannot be removed; move it to another version instead")
    current = _locked_alias(session=session, deployment=deployment, alias=alias)
    if current is None:
        raise NotFound(f"deployment {deployment.name!r} has no {alias} alias")
    from_version = current.version
    session.delete(current)
    deployment.revision += 1
    notify_after_commit(session=session, topic="config", message=deployment.name)
    event = record_audit(session=session, deployment=deployment, actor=actor,
                         action="alias.clear", alias=alias, from_version=from_version,
                         reason=reason)
    session.flush()
    return event


def rollback(*, session: Session, deployment: Deployment, actor: str, reason: str,
             to_version: int | None = None) -> AuditEvent:
    """Move `active` back: to `to_version`, or to the version it pointed at before."""
    session.refresh(deployment, with_for_update=DEPLOYMENT_LOCK)
    current = aliases_of(session=session, deployment=deployment)["active"]
    if to_version is None:
        to_version = session.scalar(
            select(AuditEvent.from_version)
            .where(AuditEvent.deployment_id == deployment.id, AuditEvent.alias == "active",
                   AuditEvent.to_version == current, AuditEvent.from_version.is_not(None),
                   AuditEvent.from_version != current)
            .order_by(AuditEvent.id.desc()).limit(1))
        if to_version is None:
            raise Conflict("no earlier active version to roll back to; name one with to_version")
    if to_version == current:
        raise Conflict(f"version {to_version} is already active")
    return move_alias(session=session, deployment=deployment, alias="active", version=to_version,
                      actor=actor, reason=reason, action="alias.rollback")


def audit_log(*, session: Session, deployment: Deployment, limit: int = 100,
              before_id: int | None = None) -> list[AuditEvent]:
    query = select(AuditEvent).where(AuditEvent.deployment_id == deployment.id)
    if before_id is not None:
        query = query.where(AuditEvent.id < before_id)
    return list(session.scalars(query.order_by(AuditEvent.id.desc()).limit(limit)))


def in_canary(*, runtime_id: str, fraction: float) -> bool:
    """Hash-sticky canary membership: the same runtime always lands on the same side."""
    bucket = int.from_bytes(hashlib.sha256(runtime_id.encode()).digest()[:8], "big") / 2**64
    return bucket < fraction


def to_wire(*, deployment: Deployment, threshold_set: ThresholdSet) -> ThresholdSetWire:
    return ThresholdSetWire(deployment=deployment.name, version=threshold_set.version,
                            signal=Signal(threshold_set.signal),
                            thresholds=threshold_set.thresholds_by_layer(),
                            segments=threshold_set.segments_by_layer(),
                            head_digest=threshold_set.head_digest,
                            checksum=threshold_set.checksum)


def _locked_alias(*, session: Session, deployment: Deployment, alias: str) -> Alias | None:
    """Lock the deployment row, then read the alias fresh from the store (not the session)."""
    session.refresh(deployment, with_for_update=DEPLOYMENT_LOCK)
    return session.scalars(
        select(Alias).where(Alias.deployment_id == deployment.id, Alias.name == alias)
        .with_for_update().execution_options(populate_existing=True)).one_or_none()
