"""Runtime heartbeats: what each runtime applies, whether it is ready, when it was last seen."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controlplane.db import utcnow
from controlplane.errors import Conflict
from controlplane.runtimes.models import Runtime
from controlplane.thresholds.locks import lock_deployment
from controlplane.thresholds.models import Deployment
from exitplane.wire import Heartbeat

# A runtime silent this long is gone: it leaves the gauges and no longer counts against the
# deployment's cap of runtimes.
FORGET_AFTER = timedelta(days=1)


def record_heartbeat(*, session: Session, deployment: Deployment, beat: Heartbeat,
                     max_runtimes: int | None = None) -> Runtime:
    """Upsert the runtime's row from a heartbeat; a new runtime beyond `max_runtimes` live
    ones (seen within FORGET_AFTER) is refused with Conflict."""
    runtime = session.scalars(select(Runtime).where(
        Runtime.deployment_id == deployment.id, Runtime.runtime_id == beat.runtime_id)
    ).one_or_none()
    if runtime is None:
        if max_runtimes is not None:
            _check_room(session=session, deployment=deployment, max_runtimes=max_runtimes)
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


def _check_room(*, session: Session, deployment: Deployment, max_runtimes: int) -> None:
    # The deployment's row lock serialises new runtimes, so concurrent ones cannot all slip
    # under the cap (SQLite's BEGIN IMMEDIATE already serialises writers).
    lock_deployment(session=session, deployment_id=deployment.id)
    live = session.scalar(select(func.count()).select_from(Runtime).where(
        Runtime.deployment_id == deployment.id, Runtime.last_seen >= utcnow() - FORGET_AFTER))
    if live >= max_runtimes:
        raise Conflict(f"deployment {deployment.name!r} already has {live} runtimes reporting "
                       f"(the cap is {max_runtimes}); reuse a runtime_id, or raise "
                       "EXITPLANE_MAX_RUNTIMES_PER_DEPLOYMENT")


def list_runtimes(*, session: Session, deployment: Deployment) -> list[Runtime]:
    return list(session.scalars(select(Runtime).where(Runtime.deployment_id == deployment.id)
                                .order_by(Runtime.runtime_id)))
