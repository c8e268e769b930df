"""Runtime heartbeats: what each runtime applies, whether it is ready, when it was last seen."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import bindparam, func, select, update
from sqlalchemy.orm import Session

from controlplane.db import utcnow
from controlplane.errors import Conflict
from controlplane.runtimes.models import Runtime
from controlplane.telemetry.targets import IngestTarget
from controlplane.thresholds.locks import lock_deployment
from controlplane.thresholds.models import Deployment
from exitplane.wire import Heartbeat

# A runtime silent this long is gone: it leaves the gauges and no longer counts against the
# deployment's cap of runtimes.
FORGET_AFTER = timedelta(days=1)


# The runtime's columns a beat sets (`beat_fields`); controlplane/runtimes/beats.py writes
# the same ones for the beats an API process holds.
BEAT_FIELDS = ("applied_version", "applied_checksum", "ready", "error", "spooled_batches",
               "dropped_records", "last_seen")
# Built once (bound parameters): constructing the statement per beat cost more than running it.
# The returned row refreshes the runtime in the session (populate_existing); nothing else in it
# needs the identity map searched (synchronize_session False).
_BEAT = (update(Runtime)
         .where(Runtime.deployment_id == bindparam("beat_deployment"),
                Runtime.runtime_id == bindparam("beat_runtime"))
         .values({column: bindparam(column) for column in BEAT_FIELDS})
         .returning(Runtime))
_BEAT_OPTIONS = {"populate_existing": True, "synchronize_session": False}


def record_heartbeat(*, session: Session, deployment: Deployment | IngestTarget,
                     beat: Heartbeat, max_runtimes: int | None = None) -> Runtime:
    """Upsert the runtime's row from a heartbeat; a new runtime beyond `max_runtimes` live
    ones (seen within FORGET_AFTER) is refused with Conflict. `deployment`: its row, or the
    API's cached facts of it (only its id and name are read)."""
    fields = beat_fields(beat, utcnow())
    # A known runtime (every beat but its first) is one UPDATE ... RETURNING: at fleet scale
    # a select, then the unit of work's update, made heartbeats the API's costliest request.
    runtime = session.scalars(_BEAT, dict(fields, beat_deployment=deployment.id,
                                          beat_runtime=beat.runtime_id),
                              execution_options=_BEAT_OPTIONS).one_or_none()
    if runtime is not None:
        return runtime
    if max_runtimes is not None:
        _check_room(session=session, deployment=deployment, max_runtimes=max_runtimes)
    runtime = Runtime(deployment_id=deployment.id, runtime_id=beat.runtime_id, **fields)
    session.add(runtime)
    session.flush()
    return runtime


def beat_fields(beat: Heartbeat, seen: datetime) -> dict:
    """The runtime's columns (`BEAT_FIELDS`) as `beat`, received at `seen`, sets them."""
    return dict(applied_version=beat.applied_version, applied_checksum=beat.applied_checksum,
                ready=beat.ready, error=beat.error, spooled_batches=beat.spooled_batches,
                dropped_records=beat.dropped_records, last_seen=seen)


def _check_room(*, session: Session, deployment: Deployment | IngestTarget,
                max_runtimes: int) -> None:
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
