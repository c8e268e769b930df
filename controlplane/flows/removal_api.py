"""Thin route that deletes a deployment (admin only); the flow is `flows.removal`."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field

from controlplane.auth.deps import AdminPrincipal
from controlplane.db import SessionDep, utcnow
from controlplane.deployments.service import get_deployment
from controlplane.errors import error_answer
from controlplane.flows.removal import delete_deployment

router = APIRouter(prefix="/v1/deployments", tags=["deployments"])


class DeploymentDeleted(BaseModel):
    """What a deletion took with it."""

    name: str
    deleted_at: datetime
    threshold_sets: int
    revoked_tokens: list[int]
    deleted_hooks: list[int] = Field(default_factory=list,
                                     description="the alert hooks bound to it, deleted")
    live_runtimes: list[str]


@router.delete("/{name}", response_model=DeploymentDeleted,
               responses={409: error_answer("runtimes of the deployment are live (without "
                                            "force)")})
def delete(name: str, request: Request, session: SessionDep, principal: AdminPrincipal,
           reason: Annotated[str, Query(min_length=1, max_length=2000,
                                        description="why (written to the audit log)")],
           force: Annotated[bool, Query(description=(
               "delete even while runtimes are live: they lose their thresholds and "
               "their tokens"))] = False) -> DeploymentDeleted:
    """Delete a deployment with its threshold sets, aliases, audit log, segments, alert hooks,
    runtimes, calibration jobs, canaries, alerts and telemetry; its runtime tokens are revoked
    (kept in the token list, bound to no deployment). 409 while runtimes heard from within
    EXITPLANE_RUNTIME_STALE_AFTER_S are live, unless `force`. The deletion is an
    administrative audit event (`GET /v1/audit`)."""
    deployment = get_deployment(session=session, name=name)
    details = delete_deployment(
        session=session, deployment=deployment, actor=principal.actor, reason=reason,
        stale_after_s=request.app.state.settings.runtime_stale_after_s, force=force)
    return DeploymentDeleted(name=name, deleted_at=utcnow(),
                             threshold_sets=details["threshold_sets"],
                             revoked_tokens=details["revoked_tokens"],
                             deleted_hooks=details["deleted_hooks"],
                             live_runtimes=details["live_runtimes"])
