"""Runtime heartbeats: what each runtime applies, whether it is ready, when it was last seen."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import and_, bindparam, delete, event, false, func, or_, select, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from controlplane.auth.models import ApiToken
from controlplane.db import dialect_insert, utcnow
from controlplane.deployments.cache import CachedDeployment
from controlplane.deployments.locks import lock_deployment
from controlplane.deployments.models import Deployment
from controlplane.errors import CapReached, Forbidden, Invalid, NotFound
from controlplane.runtimes import lineage
from controlplane.runtimes.models import Runtime, RuntimeVersion
from controlplane.runtimes.witnesses import witness_of
from exitplane.wire import Heartbeat

# A runtime silent this long is gone: it leaves the gauges and no longer counts against the
# deployment's cap of runtimes.
FORGET_AFTER = timedelta(days=1)


# The runtime's columns a beat sets (`beat_fields`); controlplane/runtimes/beats.py writes
# the same ones for the beats an API process holds.
BEAT_FIELDS = ("applied_version", "applied_checksum", "ready", "error", "spooled_batches",
               "dropped_records", "last_seen", "model_revision", "head_digest",
               "refused_version")
# Built once (bound parameters): constructing the statement per beat cost more than running it.
# The returned row refreshes the runtime in the session (populate_existing); nothing else in it
# needs the identity map searched (synchronize_session False).
_BEAT = (update(Runtime)
         .where(Runtime.deployment_id == bindparam("beat_deployment"),
                Runtime.runtime_id == bindparam("beat_runtime"))
         .values({**{column: bindparam(column) for column in BEAT_FIELDS},
                  **lineage.beat_mismatch_values()})
         .returning(Runtime))
# The same for a beat sent with a token: only the token that registered the runtime beats
# for it (a row registered by another token is left alone: `record_heartbeat` says why).
_OWNED_BEAT = _BEAT.where(Runtime.token_id == bindparam("beat_token"))
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


def record_heartbeat(*, session: Session, deployment: Deployment | CachedDeployment,
                     beat: Heartbeat, caps: RuntimeCaps | None = None,
                     token_id: int | None = None, claim: bool = True) -> Runtime:
    """Upsert the runtime's row from a heartbeat. A new runtime is registered to `token_id`
    (the token that sent the beat) and refused with CapReached (409, answered after the
    refusal hold) beyond `caps` (None: no caps). A runtime id another live token registered
    is refused (Forbidden): a token beats only for its own runtimes (`claim_runtime_ids`);
    `claim` False (an operator's token) beats for any runtime.
    `deployment`: its row, or the API's cached facts of it (only its id and name are read)."""
    fields = beat_fields(beat, utcnow())
    params = dict(fields, beat_deployment=deployment.id, beat_runtime=beat.runtime_id)
    claims = claim and token_id is not None
    if claims:
        params["beat_token"] = token_id
    statement = _OWNED_BEAT if claims else _BEAT
    applied = [(deployment.id, beat.runtime_id, beat.applied_version)]
    # A known runtime (every beat but its first) is one UPDATE ... RETURNING: at fleet scale
    # a select, then the unit of work's update, made heartbeats the API's costliest request.
    runtime = _beat(session, params, statement)
    if runtime is not None:
        note_applied_versions(session=session, rows=applied)
        return runtime
    # A new runtime (or one this token may claim). The deployment's row lock serialises new
    # runtimes: concurrent ones cannot all slip under the caps, and concurrent first beats of
    # one runtime (two API processes, a retry) meet here, the later one updating the row the
    # earlier one committed (SQLite's BEGIN IMMEDIATE already serialises writers).
    lock_deployment(session=session, deployment_id=deployment.id)
    if claims:
        claim_runtime_ids(session=session, deployment=deployment, token_id=token_id,
                          runtime_ids=[beat.runtime_id], caps=caps, locked=True,
                          seen=fields["last_seen"])
    runtime = _beat(session, params, statement)
    if runtime is not None:
        note_applied_versions(session=session, rows=applied)
        return runtime
    if caps is not None and not claims:
        _check_room(session=session, deployment=deployment, caps=caps, token_id=token_id)
    # first_seen == last_seen until a second beat: how a runtime heard from once is told.
    runtime = Runtime(deployment_id=deployment.id, runtime_id=beat.runtime_id,
                      token_id=token_id, first_seen=fields["last_seen"], **fields)
    session.add(runtime)
    session.flush()
    note_applied_versions(session=session, rows=applied)
    if beat.model_revision is not None or beat.head_digest is not None:
        # The first beat's lineage, compared as every later beat's is (in the UPDATE above).
        lineage.note_reported(session=session, deployment_id=deployment.id,
                              seen=fields["last_seen"],
                              reports=[(beat.runtime_id, beat.model_revision, beat.head_digest)])
        session.refresh(runtime)
    return runtime


def claim_runtime_ids(*, session: Session, deployment: Deployment | CachedDeployment,
                      token_id: int, runtime_ids: Iterable[str],
                      caps: RuntimeCaps | None = None, locked: bool = False,
                      seen: datetime | None = None) -> list[str]:
    """Make sure `token_id` may report under each of `runtime_ids`, registering the new ones
    to it; the ids registered (or claimed) by this call.

    A runtime id belongs to the token that registered it (its first heartbeat or telemetry
    batch). Another token's report under it is refused (Forbidden), so no token can speak for
    a runtime it does not run, report its lineage or make it leave; an id whose token was
    revoked or deleted may be claimed by the token reporting under it now. New ids count
    against `caps` as a first heartbeat does (CapReached past them), first seen at `seen`
    (default now). `locked`: the caller holds the deployment's row lock already."""
    wanted = sorted(set(runtime_ids))
    if not wanted:
        return []
    owners = dict(session.execute(
        select(Runtime.runtime_id, Runtime.token_id).where(
            Runtime.deployment_id == deployment.id, Runtime.runtime_id.in_(wanted))).all())
    if all(owners.get(runtime_id) == token_id for runtime_id in wanted):
        return []
    if not locked:
        lock_deployment(session=session, deployment_id=deployment.id)
        owners = dict(session.execute(
            select(Runtime.runtime_id, Runtime.token_id).where(
                Runtime.deployment_id == deployment.id, Runtime.runtime_id.in_(wanted))).all())
    held = {runtime_id: owner for runtime_id, owner in owners.items()
            if owner is not None and owner != token_id}
    if held:
        live = set(session.scalars(select(ApiToken.id).where(
            ApiToken.id.in_(set(held.values())), ApiToken.revoked_at.is_(None))))
        taken = sorted(runtime_id for runtime_id, owner in held.items() if owner in live)
        if taken:
            raise Forbidden(
                f"runtime id {taken[0]!r} of deployment {deployment.name!r} was registered "
                "by another token: a token reports only for the runtimes it registered. Give "
                "each runtime an id of its own, or have an operator remove that runtime "
                f"(DELETE /v1/deployments/{deployment.name}/runtimes/{taken[0]})")
    claimed = sorted(runtime_id for runtime_id in owners if owners[runtime_id] != token_id)
    new = [runtime_id for runtime_id in wanted if runtime_id not in owners]
    now = seen or utcnow()
    for runtime_id in [*claimed, *new]:
        if caps is not None:
            _check_room(session=session, deployment=deployment, caps=caps, token_id=token_id,
                        now=now, counting_deployment=runtime_id in new)
        if runtime_id in new:
            session.add(Runtime(deployment_id=deployment.id, runtime_id=runtime_id,
                                token_id=token_id, first_seen=now, last_seen=now))
        else:
            session.execute(update(Runtime).where(
                Runtime.deployment_id == deployment.id, Runtime.runtime_id == runtime_id,
                or_(Runtime.token_id.is_(None), Runtime.token_id != token_id))
                .values(token_id=token_id), execution_options={"synchronize_session": False})
        session.flush()
    return [*claimed, *new]


def applied_versions(beat: Heartbeat) -> list[int]:
    """The threshold versions a heartbeat names (for `DeploymentCache.get` / `peek`)."""
    return [] if beat.applied_version is None else [beat.applied_version]


def check_applied_version(*, target: CachedDeployment, beat: Heartbeat) -> None:
    """Invalid unless the beat's applied_version is one the deployment published, or 0 (the
    runtime's built-in never-exit set): a runtime cannot apply a set that never existed."""
    if beat.applied_version is not None and beat.applied_version not in target.versions:
        raise Invalid(f"applied_version {beat.applied_version} was never published for "
                      f"{target.name!r} (0 is the built-in never-exit set): report the version "
                      "of the set the runtime pulled and applied")


def _beat(session: Session, params: dict, statement=_BEAT) -> Runtime | None:
    return session.scalars(statement, params, execution_options=_BEAT_OPTIONS).one_or_none()


def beat_fields(beat: Heartbeat, seen: datetime) -> dict:
    """The runtime's columns (`BEAT_FIELDS`) as `beat`, received at `seen`, sets them."""
    return dict(applied_version=beat.applied_version, applied_checksum=beat.applied_checksum,
                ready=beat.ready, error=beat.error, spooled_batches=beat.spooled_batches,
                dropped_records=beat.dropped_records, last_seen=seen,
                model_revision=beat.model_revision, head_digest=beat.head_digest,
                refused_version=beat.refused_version)


def _check_room(*, session: Session, deployment: Deployment | CachedDeployment, caps: RuntimeCaps,
                token_id: int | None, now: datetime | None = None,
                counting_deployment: bool = True) -> None:
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
    if counting_deployment and total >= caps.per_deployment:
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
                    token_id: int | None = None, owner: int | None = None) -> list[str]:
    """Remove one runtime (`runtime_id`) or every runtime `token_id` registered from the
    deployment; the ids removed (NotFound for a `runtime_id` it does not have). A removed
    runtime that beats again registers anew, under the caps. `owner`: the token asking on
    the runtime's behalf (a runtime leaving), refused (Forbidden) for a runtime another live
    token registered."""
    if (runtime_id is None) == (token_id is None):
        raise Invalid("name a runtime_id or a token_id")
    if owner is not None and runtime_id is not None:
        registered = session.execute(select(Runtime.token_id).where(
            Runtime.deployment_id == deployment.id,
            Runtime.runtime_id == runtime_id)).one_or_none()
        if registered is not None and registered[0] not in (None, owner) and session.scalar(
                select(ApiToken.id).where(ApiToken.id == registered[0],
                                          ApiToken.revoked_at.is_(None))) is not None:
            raise Forbidden(f"runtime {runtime_id!r} was registered by another token: only "
                            "the token that registered a runtime makes it leave (an operator "
                            "may remove it)")
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


# engine -> (deployment, runtime, version) this process has seen stored in runtime_versions
_applied_noted: weakref.WeakKeyDictionary[Engine, set[tuple[int, str, int]]] = \
    weakref.WeakKeyDictionary()
_APPLIED_PENDING = "exitplane.applied_versions"  # session.info: rows awaiting the commit
_APPLIED_NOTED_MAX = 200_000


def note_applied_versions(*, session: Session,
                          rows: Iterable[tuple[int, str, int | None]]) -> None:
    """Record that each runtime applied each version ((deployment id, runtime id, version);
    None and 0, the built-in set, are not recorded): what a runtime token's shadow tokens
    may be stamped with (`telemetry.service.shadow_evidence`). Written once per process and
    database: a version already seen stored costs nothing."""
    engine = _engine_of(session)
    noted = _applied_noted.get(engine, set())
    new = sorted({row for row in rows if row[2] not in (None, 0)} - noted)
    if not new:
        return
    values = [{"deployment_id": deployment_id, "runtime_id": runtime_id, "version": version,
               "first_at": utcnow()} for deployment_id, runtime_id, version in new]
    session.execute(dialect_insert(session, RuntimeVersion).on_conflict_do_nothing(
        index_elements=["deployment_id", "runtime_id", "version"]), values)
    session.info.setdefault(_APPLIED_PENDING, []).extend(new)


def _engine_of(session: Session) -> Engine:
    bind = session.get_bind()
    return bind.engine if isinstance(bind, Connection) else bind


@event.listens_for(Session, "after_commit")
def _applied_committed(session: Session) -> None:
    if session.in_nested_transaction():
        return
    pending = session.info.pop(_APPLIED_PENDING, None)
    if pending:
        noted = _applied_noted.setdefault(_engine_of(session), set())
        if len(noted) > _APPLIED_NOTED_MAX:
            noted.clear()
        noted.update(pending)


@event.listens_for(Session, "after_rollback")
def _applied_rolled_back(session: Session) -> None:
    session.info.pop(_APPLIED_PENDING, None)


def runtime_witnesses(*, session: Session, deployment_id: int) -> dict[str, str]:
    """Runtime id -> the witness of the token that registered it (`runtimes.witnesses`), for
    the deployment's runtimes registered by a token (aggregates are kept per runtime id; the
    robust rules count them per witness)."""
    return {runtime_id: witness_of(token_id=token_id, runtime_id=runtime_id)
            for runtime_id, token_id in session.execute(
                select(Runtime.runtime_id, Runtime.token_id).where(
                    Runtime.deployment_id == deployment_id, Runtime.token_id.is_not(None)))}
