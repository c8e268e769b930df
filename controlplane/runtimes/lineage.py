"""Lineage: the model revision and exit-heads digest a runtime serves, against its deployment's.

A runtime whose heads or model differ from its deployment's is still served and its telemetry
stored and shown, but its evidence never calibrates, judges a canary or pages on quality.

A runtime reports its lineage in every heartbeat (kept on its row: what the fleet view shows)
and in every telemetry batch. Whenever a report names a model revision or heads digest that
differs from the one its deployment names at that moment, the runtime's row keeps when
(`lineage_mismatch_at`) and what it reported (`mismatch_model_revision`,
`mismatch_head_digest`). A field the runtime leaves out is unknown and a field the deployment
leaves empty names nothing: neither is compared, so a runtime that reports nothing keeps
working and counts as a witness like any other (a runtime is trusted to say what it serves
only as far as it says it: lineage separates honest mistakes, not lies).

Mismatched (`mismatched_runtime_ids`): a runtime whose last heartbeat names another lineage
than the deployment names now, or that reported another lineage at any time within the longest
evidence window a consumer reads (`evidence_window`): its samples in that window may have come
from the other heads, and a runtime's evidence is set aside whole, never sample by sample.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

from sqlalchemy import String, and_, bindparam, case, or_, select, update
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from controlplane.alerts.kinds import AlertKind
from controlplane.alerts.service import Condition, Reconciled, jsonable, reconcile
from controlplane.db import utcnow
from controlplane.deployments.models import Deployment
from controlplane.runtimes.models import Runtime
from controlplane.settings import Settings, get_settings

RUNTIME_MISMATCH = AlertKind.RUNTIME_MISMATCH
MISMATCH_NAMED = 20  # runtimes named in a runtime_mismatch summary; the evidence lists up to 200
MISMATCH_LISTED = 200
LINEAGE_FIELDS = ("model_revision", "head_digest")
_WHEN = Runtime.__table__.c.lineage_mismatch_at.type  # binds of it convert as the column's do


def evidence_window(settings: Settings | None = None) -> timedelta:
    """How long a runtime stays mismatched after it last reported another lineage: the
    longest window calibration or drift detection reads samples from."""
    settings = settings or get_settings()
    return timedelta(seconds=max(settings.calibration_lookback_s, settings.drift_lookback_s))


def _differs(reported: ColumnElement, named: ColumnElement) -> ColumnElement[bool]:
    """SQL: the runtime reported a value (not NULL) and the deployment names another (not '').
    NULL on either side is not true, so an unknown never counts as a difference."""
    return and_(reported.is_not(None), named != "", named != reported)


def _foreign(model_revision: ColumnElement, head_digest: ColumnElement,
             deployment_id: ColumnElement) -> ColumnElement[bool]:
    """SQL: a report of (`model_revision`, `head_digest`) differs from what deployment
    `deployment_id` names at the moment the statement runs."""
    named_model = select(Deployment.model_revision).where(
        Deployment.id == deployment_id).scalar_subquery()
    named_heads = select(Deployment.head_digest).where(
        Deployment.id == deployment_id).scalar_subquery()
    return or_(_differs(model_revision, named_model), _differs(head_digest, named_heads))


def beat_mismatch_values() -> dict[str, ColumnElement]:
    """The mismatch columns of a heartbeat's UPDATE of its runtime's row, for a statement
    bound with `beat_deployment`, `model_revision`, `head_digest` and `last_seen` (the
    heartbeat service's and the bulk writer's): set to this beat when it names another
    lineage than its deployment, else kept."""
    foreign = _foreign(bindparam("model_revision", type_=String),
                       bindparam("head_digest", type_=String), bindparam("beat_deployment"))
    return {"lineage_mismatch_at": case((foreign, bindparam("last_seen", type_=_WHEN)),
                                        else_=Runtime.lineage_mismatch_at),
            "mismatch_model_revision": case((foreign, bindparam("model_revision", type_=String)),
                                            else_=Runtime.mismatch_model_revision),
            "mismatch_head_digest": case((foreign, bindparam("head_digest", type_=String)),
                                         else_=Runtime.mismatch_head_digest)}


# One statement per reported lineage: only a foreign report writes (the common, matching
# case costs an index lookup and no row lock).
# (Core, not ORM: executed once per report, executemany.)
_RUNTIMES = Runtime.__table__
_NOTE = (update(_RUNTIMES)
         .where(_RUNTIMES.c.deployment_id == bindparam("note_deployment"),
                _RUNTIMES.c.runtime_id == bindparam("note_runtime"),
                _foreign(bindparam("note_model", type_=String),
                         bindparam("note_heads", type_=String), bindparam("note_deployment")))
         .values(lineage_mismatch_at=bindparam("note_seen", type_=_WHEN),
                 mismatch_model_revision=bindparam("note_model", type_=String),
                 mismatch_head_digest=bindparam("note_heads", type_=String)))


def note_reported(*, session: Session, deployment_id: int,
                  reports: Iterable[tuple[str, str | None, str | None]],
                  seen: datetime | None = None) -> None:
    """Record on the runtimes' rows which of `reports` ((runtime id, model revision, heads
    digest), e.g. one per telemetry batch) name another lineage than the deployment. Reports
    that name nothing are skipped; a runtime without a row (it never sent a heartbeat) is not
    recorded."""
    seen = seen or utcnow()
    rows = [{"note_deployment": deployment_id, "note_runtime": runtime_id,
             "note_model": model_revision, "note_heads": head_digest, "note_seen": seen}
            for runtime_id, model_revision, head_digest in dict.fromkeys(reports)
            if model_revision is not None or head_digest is not None]
    if rows:
        session.execute(_NOTE, rows)


def note_batches(*, session: Session, deployment_id: int, batches: Iterable) -> None:
    """`note_reported` for telemetry batches (anything with runtime_id, model_revision and
    head_digest attributes)."""
    note_reported(session=session, deployment_id=deployment_id,
                  reports=[(batch.runtime_id, batch.model_revision, batch.head_digest)
                           for batch in batches])


def mismatched_runtime_ids(*, session: Session, deployment_id: int) -> set[str]:
    """Runtimes of the deployment whose reported model revision or exit-heads digest differs
    from the deployment's."""
    return set(session.scalars(_mismatched(deployment_id, utcnow() - evidence_window())
                               .with_only_columns(Runtime.runtime_id)))


def _mismatched(deployment_id: int, since: datetime):
    """SELECT the deployment's runtimes mismatched now: the last heartbeat names another
    lineage than the deployment does now, or one was reported at or after `since`."""
    named = select(Deployment).where(Deployment.id == deployment_id).subquery()
    return (select(Runtime)
            .join(named, named.c.id == Runtime.deployment_id)
            .where(Runtime.deployment_id == deployment_id,
                   or_(Runtime.lineage_mismatch_at >= since,
                       _differs(Runtime.model_revision, named.c.model_revision),
                       _differs(Runtime.head_digest, named.c.head_digest)))
            .order_by(Runtime.runtime_id))


def differences(*, deployment: Deployment, runtime: Runtime) -> dict[str, dict[str, str]]:
    """What differs between what `runtime` reported (its last heartbeat, else its last
    foreign report) and what `deployment` names: {field: {"reported": ..., "deployment": ...}}."""
    out = {}
    for name in LINEAGE_FIELDS:
        named = getattr(deployment, name)
        for reported in (getattr(runtime, name), getattr(runtime, f"mismatch_{name}")):
            if reported is not None and named and reported != named:
                out[name] = {"reported": reported, "deployment": named}
                break
    return out


def _short(value: str) -> str:
    return value if len(value) <= 16 else f"{value[:12]}…"


def mismatch_conditions(*, session: Session, deployment: Deployment,
                        now: datetime | None = None) -> list[Condition]:
    """At most one `runtime_mismatch` condition per deployment, naming its mismatched
    runtimes and what each reported against what the deployment names."""
    now = now or utcnow()
    window = evidence_window()
    listed = []
    for runtime in session.scalars(_mismatched(deployment.id, now - window)):
        differ = differences(deployment=deployment, runtime=runtime)
        listed.append({"runtime_id": runtime.runtime_id, "differs": differ,
                       "model_revision": runtime.model_revision,
                       "head_digest": runtime.head_digest,
                       "lineage_mismatch_at": runtime.lineage_mismatch_at})
    if not listed:
        return []

    def said(entry: dict) -> str:
        parts = [f"{name} {_short(item['reported'])} (deployment: {_short(item['deployment'])})"
                 for name, item in entry["differs"].items()]
        return f"{entry['runtime_id']}: {', '.join(parts) or 'another lineage reported'}"

    named = "; ".join(said(entry) for entry in listed[:MISMATCH_NAMED])
    more = f"; and {len(listed) - MISMATCH_NAMED} more" if len(listed) > MISMATCH_NAMED else ""
    noun = "runtime serves" if len(listed) == 1 else "runtimes serve"
    summary = (f"{len(listed)} {noun} other exit heads or another model revision than the "
               f"deployment; their telemetry is kept but never calibrates, judges a canary or "
               f"pages on quality: {named}{more}")
    evidence = {"mismatched_runtimes": len(listed), "runtimes": listed[:MISMATCH_LISTED],
                "deployment": {name: getattr(deployment, name) for name in LINEAGE_FIELDS},
                "window_s": window.total_seconds()}
    return [Condition(kind=RUNTIME_MISMATCH, severity="warning", summary=summary,
                      subject="all", evidence=evidence)]


def check_lineage(*, session: Session, deployment: Deployment, clear_after_s: float,
                  now: datetime | None = None) -> Reconciled:
    """Fire, refresh or resolve the deployment's `runtime_mismatch` alert."""
    now = now or utcnow()
    conditions = mismatch_conditions(session=session, deployment=deployment, now=now)
    result = reconcile(session=session, deployment=deployment, conditions=conditions,
                       checked_kinds=[RUNTIME_MISMATCH], clear_after_s=clear_after_s, now=now)
    for alert in result.refreshed:  # the open alert says which runtimes differ now
        alert.summary = conditions[0].summary
        alert.evidence = jsonable(conditions[0].evidence)
    session.flush()
    return result
