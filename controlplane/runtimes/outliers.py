"""Runtimes set aside as outliers, and every runtime whose evidence the fleet does not take.

A runtime is a witness, not a judge: the drift cycle (`controlplane.drift.outliers`) sets aside
a runtime whose shadow evidence differs from the rest of its fleet beyond chance; its samples
then feed no calibration, quality drift test or canary verdict until an operator clears it.
`excluded_runtime_ids` is the one definition of what the evidence loaders leave out: the
runtimes set aside here and those whose heads or model differ from the deployment's (lineage).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.db import utcnow
from controlplane.deployments.models import Deployment
from controlplane.errors import Conflict, NotFound
from controlplane.runtimes.lineage import mismatched_runtime_ids
from controlplane.runtimes.models import Runtime, RuntimeOutlier
from controlplane.runtimes.witnesses import token_of


def set_aside_runtime_ids(*, session: Session, deployment_id: int) -> set[str]:
    """Runtimes of the deployment currently set aside as outliers."""
    return set(session.scalars(select(RuntimeOutlier.runtime_id).where(
        RuntimeOutlier.deployment_id == deployment_id, RuntimeOutlier.open_runtime.is_not(None))))


def excluded_witnesses(*, session: Session, deployment_id: int) -> set[str]:
    """Witnesses (credentials, `runtimes.witnesses`) currently set aside as outliers: every
    shadow token they vouch for is left out, under whichever runtime id it names."""
    return set(session.scalars(select(RuntimeOutlier.witness).where(
        RuntimeOutlier.deployment_id == deployment_id, RuntimeOutlier.open_runtime.is_not(None),
        RuntimeOutlier.witness.is_not(None))))


def excluded_runtime_ids(*, session: Session, deployment_id: int) -> set[str]:
    """Runtimes whose evidence the deployment's decisions leave out: set aside as outliers
    (with every runtime registered to a witness set aside), or serving other heads or another
    model (lineage)."""
    witnesses = excluded_witnesses(session=session, deployment_id=deployment_id)
    tokens = {token for token in map(token_of, witnesses) if token is not None}
    registered = set(session.scalars(select(Runtime.runtime_id).where(
        Runtime.deployment_id == deployment_id, Runtime.token_id.in_(tokens)))) if tokens \
        else set()
    return (set_aside_runtime_ids(session=session, deployment_id=deployment_id) | registered
            | mismatched_runtime_ids(session=session, deployment_id=deployment_id))


def list_outliers(*, session: Session, deployment: Deployment, open_only: bool = False,
                  limit: int = 100) -> list[RuntimeOutlier]:
    """The deployment's outlier records, newest first (only those still set aside with
    `open_only`)."""
    query = select(RuntimeOutlier).where(RuntimeOutlier.deployment_id == deployment.id)
    if open_only:
        query = query.where(RuntimeOutlier.open_runtime.is_not(None))
    return list(session.scalars(query.order_by(RuntimeOutlier.id.desc()).limit(limit)))


def set_aside(*, session: Session, deployment: Deployment, runtime_id: str, version: int,
              segment: str, summary: str, evidence: dict, alert_id: int | None = None,
              now: datetime | None = None, witness: str | None = None
              ) -> tuple[RuntimeOutlier, bool]:
    """Set `runtime_id` aside, and with `witness` every runtime of that credential: (its open
    record, True when this call created it). A witness's record is keyed by the witness."""
    existing = session.scalars(select(RuntimeOutlier).where(
        RuntimeOutlier.deployment_id == deployment.id,
        RuntimeOutlier.open_runtime == runtime_id)).one_or_none()
    if existing is not None:
        return existing, False
    record = RuntimeOutlier(deployment_id=deployment.id, runtime_id=runtime_id,
                            witness=witness,
                            open_runtime=runtime_id, status="set_aside", version=version,
                            segment=segment, summary=summary, evidence=evidence,
                            alert_id=alert_id, detected_at=now or utcnow(), clear_reason="")
    session.add(record)
    session.flush()
    return record, True


def clear(*, session: Session, deployment: Deployment, outlier_id: int, actor: str,
          reason: str) -> RuntimeOutlier:
    """An operator takes the runtime's evidence back: its samples count again from now on
    (it is tested again each drift cycle), and its `runtime_outlier` alert resolves."""
    from controlplane.alerts.service import get_alert, resolve

    record = session.get(RuntimeOutlier, outlier_id, with_for_update=True)
    if record is None or record.deployment_id != deployment.id:
        raise NotFound(f"deployment {deployment.name!r} has no runtime outlier {outlier_id}")
    if record.open_runtime is None:
        raise Conflict(f"runtime outlier {outlier_id} ({record.runtime_id}) was already "
                       f"cleared by {record.cleared_by}")
    record.status, record.open_runtime = "cleared", None
    record.cleared_at, record.cleared_by, record.clear_reason = utcnow(), actor, reason
    if record.alert_id is not None:
        alert = get_alert(session=session, alert_id=record.alert_id)
        if alert.status != "resolved":
            resolve(session=session, alert=alert, actor=actor,
                    reason=f"runtime {record.runtime_id} cleared: {reason}")
    session.flush()
    return record
