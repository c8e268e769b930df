"""Runtime heartbeats: what each runtime applies, whether it is ready, when it was last seen."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.db import utcnow
from controlplane.runtimes.models import Runtime
from controlplane.thresholds.models import Deployment
from exitplane.wire import Heartbeat


def record_heartbeat(*, session: Session, deployment: Deployment, beat: Heartbeat) -> Runtime:
    """Upsert the runtime's row from a heartbeat."""
    runtime = session.scalars(select(Runtime).where(
        Runtime.deployment_id == deployment.id, Runtime.runtime_id == beat.runtime_id)
    ).one_or_none()
    if runtime is None:
        runtime = Runtime(deployment_id=deployment.id, runtime_id=beat.runtime_id)
        session.add(runtime)
    runtime.applied_version = beat.applied_version
    runtime.applied_checksum = beat.applied_checksum
    runtime.ready = beat.ready
    runtime.error = beat.error
    runtime.spooled_batches = beat.spooled_batches
    runtime.dropped_records = beat.dropped_records
    runtime.last_seen = utcnow()
    session.flush()
    return runtime


def list_runtimes(*, session: Session, deployment: Deployment) -> list[Runtime]:
    return list(session.scalars(select(Runtime).where(Runtime.deployment_id == deployment.id)
                                .order_by(Runtime.runtime_id)))
