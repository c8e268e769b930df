"""Deleting a deployment, across the domains that keep rows under it.

The foreign keys to `deployments` cascade: threshold sets, aliases, its audit log, segments,
runtimes, calibration jobs, canary runs, operating curves, alerts and their reports go with
the row. The telemetry tables carry the deployment's id without a foreign key (they are
partitioned and bulk-written), so their rows are deleted here first. Its runtime tokens are
revoked (every API process drops its cached lookup of them when the transaction commits) and
kept, revoked and no longer bound to a deployment, so the token list still shows them; its
alert hooks are deleted with their delivery logs. Each revocation and hook deletion is an audit
event with the deletion's reason. The deployment's own audit log is copied into the fleet-wide
administrative log first (same times, actors, actions, reasons and objects), so the history
outlives the deployment, followed by the deletion's own event.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.orm import Session

from controlplane.alerts.hook_service import delete_hook
from controlplane.alerts.models import AlertHook
from controlplane.auth.audit import record_admin_event
from controlplane.auth.models import AdminEvent, ApiToken
from controlplane.auth.service import revoke_token
from controlplane.coordination.bus import notify_after_commit
from controlplane.db import utcnow
from controlplane.deployments.audit import archive_rows
from controlplane.deployments.locks import DEPLOYMENT_LOCK
from controlplane.deployments.models import Deployment, ThresholdSet, UndeclaredSegmentTokens
from controlplane.errors import Conflict
from controlplane.runtimes.models import Runtime
from controlplane.telemetry.models import Rollup, RollupHistogram, ShadowSampleRow, TokenRecordRow

# Telemetry kept by deployment id without a foreign key to cascade from.
_UNLINKED = (TokenRecordRow, ShadowSampleRow, Rollup, RollupHistogram, UndeclaredSegmentTokens)


def live_runtimes(*, session: Session, deployment: Deployment,
                  stale_after_s: float) -> list[Runtime]:
    """The deployment's runtimes heard from within `stale_after_s`, by id (what a deletion
    refuses to cut off, and what a canary's members are drawn from)."""
    since = utcnow() - timedelta(seconds=stale_after_s)
    return list(session.scalars(select(Runtime).where(
        Runtime.deployment_id == deployment.id, Runtime.last_seen >= since)
        .order_by(Runtime.runtime_id)))


def delete_deployment(*, session: Session, deployment: Deployment, actor: str, reason: str,
                      stale_after_s: float, force: bool = False) -> dict:
    """Delete `deployment` and everything stored under it; what was deleted, as the audit
    event's details. Refused (Conflict) while runtimes of it are live (heard from within
    `stale_after_s`) unless `force`: they would lose their thresholds mid-stream."""
    session.refresh(deployment, with_for_update=DEPLOYMENT_LOCK)
    live = [runtime.runtime_id for runtime in live_runtimes(
        session=session, deployment=deployment, stale_after_s=stale_after_s)]
    if live and not force:
        shown = ", ".join(live[:5]) + (f" and {len(live) - 5} more" if len(live) > 5 else "")
        raise Conflict(f"deployment {deployment.name!r} has {len(live)} live runtime(s) "
                       f"({shown}); stop them first, or delete with force")
    token_ids = list(session.scalars(select(ApiToken.id).where(
        ApiToken.deployment_id == deployment.id, ApiToken.revoked_at.is_(None))
        .order_by(ApiToken.id)))
    cause = f"deployment {deployment.name} deleted: {reason}"
    for token_id in token_ids:
        revoke_token(session=session, token_id=token_id, actor=actor, reason=cause)
    session.execute(update(ApiToken).where(ApiToken.deployment_id == deployment.id)
                    .values(deployment_id=None), execution_options={"synchronize_session": False})
    hooks = list(session.scalars(select(AlertHook).where(
        AlertHook.deployment_id == deployment.id).order_by(AlertHook.id)))
    hook_ids = [hook.id for hook in hooks]
    for hook in hooks:
        delete_hook(session=session, hook=hook, actor=actor, reason=cause)
    versions = session.scalar(select(func.count()).select_from(ThresholdSet)
                              .where(ThresholdSet.deployment_id == deployment.id)) or 0
    for model in _UNLINKED:
        session.execute(delete(model).where(model.deployment_id == deployment.id),
                        execution_options={"synchronize_session": False})
    # Kept without a log line each: they were logged when they were recorded.
    archived = archive_rows(session=session, deployment=deployment)
    if archived:
        session.execute(insert(AdminEvent), archived)
    details = {"model_ref": deployment.model_ref, "exit_layers": deployment.exit_layers,
               "threshold_sets": versions, "revoked_tokens": token_ids,
               "deleted_hooks": hook_ids,
               "live_runtimes": live, "forced": bool(live), "archived_events": len(archived)}
    record_admin_event(session=session, actor=actor, action="deployment.delete",
                       target=f"deployment:{deployment.name}", reason=reason, details=details,
                       deployment=deployment.name)
    # Config caches and long-polls of the name re-read the store and find it gone.
    notify_after_commit(session=session, topic="config", message=deployment.name)
    session.delete(deployment)
    session.flush()
    return details
