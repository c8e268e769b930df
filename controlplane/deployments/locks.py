"""The deployment row lock, one definition for every writer that takes it."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.deployments.models import Deployment

# The deployment row lock serialises the control plane's read-modify-writes (version
# numbering, alias moves, fallbacks, the runtime and segment caps). It is FOR NO KEY UPDATE,
# never FOR UPDATE: none of them changes the row's key, and every transaction that inserts a
# row referencing the deployment (telemetry, heartbeats) holds a key-share lock on it, which
# FOR UPDATE waits for: an alias move queued behind every ingest transaction in flight at
# fleet scale, and the ingest transactions that came next queued behind the move.
DEPLOYMENT_LOCK = {"key_share": True}


def lock_deployment(*, session: Session, deployment_id: int) -> None:
    """Take the deployment row lock (see DEPLOYMENT_LOCK) in the session's transaction."""
    session.scalars(select(Deployment.id).where(Deployment.id == deployment_id)
                    .with_for_update(**DEPLOYMENT_LOCK))
