"""Runtime heartbeats: what each runtime applies, whether it is ready, when it was last seen."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import and_, bindparam, delete, false, func, select, update
from sqlalchemy.orm import Session

from controlplane.db import utcnow
from controlplane.errors import CapReached, Invalid, NotFound
from controlplane.runtimes import lineage
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
               "dropped_records", "last_seen", "model_revision", "head_digest")
# Built once (bound parameters): constructing the statement per beat cost more than running it.
# The returned row refreshes the runtime in the session (populate_existing); nothing else in it
# needs the identity map searched (synchronize_session False).
_BEAT = (update(Runtime)
         .where(Runtime.deployment_id == bindparam("beat_deployment"),
                Runtime.runtime_id == bindparam("beat_runtime"))
         .values({**{column: bindparam(column) for column in BEAT_FIELDS},
                  **lineage.beat_mismatch_values()})
         .returning(Runtime))
_BEAT_OPTIONS = {"populate_existing": True, "synchronize_session": False}


@dataclass(frozen=True)
class RuntimeCaps:
    """Live runtimes a deployment takes, and one token on it; how soon a runtime heard from
    only once stops counting (and is removed)."""

    per_deployment: int
    per_token: int
    single_beat_forget: timedelta = timedelta(minutes=10)

    @classmethod
    def from_settings(cls, settings) -> RuntimeCaps:
        return cls(per_deployment=settings.max_runtimes_per_deployment,
                   per_token=settings.max_runtimes_per_token,
                   single_beat_forget=timedelta(seconds=settings.runtime_single_beat_forget_s))


def record_heartbeat(*, session: Session, deployment: Deployment | IngestTarget,
                     beat: Heartbeat, caps: RuntimeCaps | None = None,
                     token_id: int | None = None) -> Runtime:
    """Upsert the runtime's row from a heartbeat. A new runtime is registered to `token_id`
    (the token that sent the beat) and refused with CapReached (409, answered after the
    refusal hold) beyond `caps` (None: no caps).
    `deployment`: its row, or the API's cached facts of it (only its id and name are read)."""
    fields = beat_fields(beat, utcnow())
    params = dict(fields, beat_deployment=deployment.id, beat_runtime=beat.runtime_id)
    # A known runtime (every beat but its first) is one UPDATE ... RETURNING: at fleet scale
    # a select, then the unit of work's update, made heartbeats the API's costliest request.
    runtime = _beat(session, params)
    if runtime is not None:
        return runtime
    # A new runtime. The deployment's row lock serialises new runtimes: concurrent ones cannot
    # all slip under the caps, and concurrent first beats of one runtime (two API processes, a
    # retry) meet here, the later one updating the row the earlier one committed (SQLite's
    # BEGIN IMMEDIATE already serialises writers).
    lock_deployment(session=session, deployment_id=deployment.id)
    runtime = _beat(session, params)
    if runtime is not None:
        return runtime
    if caps is not None:
        _check_room(session=session, deployment=deployment, caps=caps, token_id=token_id)
    # first_seen == last_seen until a second beat: how a runtime heard from once is told.
    runtime = Runtime(deployment_id=deployment.id, runtime_id=beat.runtime_id,
                      token_id=token_id, first_seen=fields["last_seen"], **fields)
    session.add(runtime)
    session.flush()
    if beat.model_revision is not None or beat.head_digest is not None:
        # The first beat's lineage, compared as every later beat's is (in the UPDATE above).
        lineage.note_reported(session=session, deployment_id=deployment.id,
                              seen=fields["last_seen"],
                              reports=[(beat.runtime_id, beat.model_revision, beat.head_digest)])
        session.refresh(runtime)
    return runtime


def applied_versions(beat: Heartbeat) -> list[int]:
    """The threshold versions a heartbeat names (for `IngestTargets.get` / `peek`)."""
    return [] if beat.applied_version is None else [beat.applied_version]


def check_applied_version(*, target: IngestTarget, beat: Heartbeat) -> None:
    """Invalid unless the beat's applied_version is one the deployment published, or 0 (the
    runtime's built-in never-exit set): a runtime cannot apply a set that never existed."""
    if beat.applied_version is not None and beat.applied_version not in target.versions:
        raise Invalid(f"applied_version {beat.applied_version} was never published for "
                      f"{target.name!r} (0 is the built-in never-exit set): report the version "
                      "of the set the runtime pulled and applied")


def _beat(session: Session, params: dict) -> Runtime | None:
    return session.scalars(_BEAT, params, execution_options=_BEAT_OPTIONS).one_or_none()


def beat_fields(beat: Heartbeat, seen: datetime) -> dict:
    """The runtime's columns (`BEAT_FIELDS`) as `beat`, received at `seen`, sets them."""
    return dict(applied_version=beat.applied_version, applied_checksum=beat.applied_checksum,
                ready=beat.ready, error=beat.error, spooled_batches=beat.spooled_batches,
                dropped_records=beat.dropped_records, last_seen=seen,
                model_revision=beat.model_revision, head_digest=beat.head_digest)


def _check_room(*, session: Session, deployment: Deployment | IngestTarget, caps: RuntimeCaps,
                token_id: int | None) -> None:
    """CapReached when the deployment, or the token on it, has its cap of live runtimes: heard
    from within FORGET_AFTER, and, for one heard from only once, within
    `caps.single_beat_forget` (a crashed start, a probe, ids a flood made up): those past it
    are removed first. Called under the deployment's row lock."""
    now = utcnow()
    once_and_long_ago = and_(Runtime.last_seen == Runtime.first_seen,
                             Runtime.first_seen < now - caps.single_beat_forget)
    session.execute(delete(Runtime).where(Runtime.deployment_id == deployment.id,
                                          once_and_long_ago),
                    execution_options={"synchronize_session": False})
    own_token = Runtime.token_id == token_id if token_id is not None else false()
    total, own = session.execute(
        select(func.count(), func.count().filter(own_token)).select_from(Runtime).where(
            Runtime.deployment_id == deployment.id,
            Runtime.last_seen >= now - FORGET_AFTER)).one()
    if total >= caps.per_deployment:
        raise CapReached(
            f"deployment {deployment.name!r} already has {total} runtimes reporting "
            f"(the cap is {caps.per_deployment}); reuse a runtime_id, remove gone "
            f"runtimes (DELETE /v1/deployments/{deployment.name}/runtimes/<id>), or "
            "raise EXITPLANE_MAX_RUNTIMES_PER_DEPLOYMENT")
    if token_id is not None and own >= caps.per_token:
        raise CapReached(
            f"this token already has {own} runtimes reporting on deployment "
            f"{deployment.name!r} (the cap per token is {caps.per_token}); reuse a "
            "runtime_id, give more runtimes a token of their own, or raise "
            "EXITPLANE_MAX_RUNTIMES_PER_TOKEN")


def remove_runtimes(*, session: Session, deployment: Deployment, runtime_id: str | None = None,
                    token_id: int | None = None) -> list[str]:
    """Remove one runtime (`runtime_id`) or every runtime `token_id` registered from the
    deployment; the ids removed (NotFound for a `runtime_id` it does not have). A removed
    runtime that beats again registers anew, under the caps."""
    if (runtime_id is None) == (token_id is None):
        raise Invalid("name a runtime_id or a token_id")
    query = delete(Runtime).where(Runtime.deployment_id == deployment.id)
    if runtime_id is not None:
        query = query.where(Runtime.runtime_id == runtime_id)
    if token_id is not None:
        query = query.where(Runtime.token_id == token_id)
    removed = list(session.scalars(query.returning(Runtime.runtime_id),
                                   execution_options={"synchronize_session": False}))
    if runtime_id is not None and not removed:
        raise NotFound(f"deployment {deployment.name!r} has no runtime {runtime_id!r}")
    return sorted(removed)


def list_runtimes(*, session: Session, deployment: Deployment) -> list[Runtime]:
    return list(session.scalars(select(Runtime).where(Runtime.deployment_id == deployment.id)
                                .order_by(Runtime.runtime_id)))
