"""Thin route for the audit log of administrative actions (admin only)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict

from controlplane.auth.audit import admin_events
from controlplane.auth.deps import AdminPrincipal
from controlplane.db import SessionDep

router = APIRouter(prefix="/v1/audit", tags=["auth"])


class AdminEventRead(BaseModel):
    """One administrative action: who, what, on what, why, when."""

    model_config = ConfigDict(from_attributes=True)

    id: int
    actor: str
    action: str
    target: str
    reason: str
    details: dict
    created_at: datetime


@router.get("", response_model=list[AdminEventRead])
def list_admin_events(session: SessionDep, principal: AdminPrincipal,
                      limit: Annotated[int, Query(ge=1, le=500)] = 100,
                      before_id: Annotated[int | None, Query(ge=1)] = None,
                      action: Annotated[str | None, Query(max_length=50)] = None
                      ) -> list[AdminEventRead]:
    """Tokens created and revoked, users created, re-roled, disabled and enabled, alert hooks
    created, changed and deleted, alerts acknowledged and resolved: newest first, `limit` at
    a time (`before_id` pages back). A deployment's own changes are in its audit log
    (`GET /v1/deployments/{name}/audit`)."""
    return [AdminEventRead.model_validate(event) for event in admin_events(
        session=session, limit=limit, before_id=before_id, action=action)]
