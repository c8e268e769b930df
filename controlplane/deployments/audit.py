"""The deployment audit log's one writer (thresholds, segments and runtimes services use it)."""

from __future__ import annotations

from sqlalchemy.orm import Session

from controlplane.auth.audit import log_audit
from controlplane.deployments.models import AuditEvent, Deployment


def record_audit(*, session: Session, deployment: Deployment, actor: str, action: str,
                 reason: str, alias: str | None = None, from_version: int | None = None,
                 to_version: int | None = None, details: dict | None = None) -> AuditEvent:
    """One line of the deployment's audit log (who did what, from and to which version, why),
    added to the session: it is stored with the caller's transaction, and logged
    (`exitplane.audit`)."""
    event = AuditEvent(deployment_id=deployment.id, actor=actor, action=action, alias=alias,
                       from_version=from_version, to_version=to_version, reason=reason,
                       details=details or {})
    session.add(event)
    log_audit(actor=actor, action=action, target=f"deployment:{deployment.name}",
              reason=reason)
    return event
