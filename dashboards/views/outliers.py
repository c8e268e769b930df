"""Runtimes set aside as outliers: an operator clears one (its evidence counts again)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import Response

from controlplane.db import SessionDep
from controlplane.deployments import service as thresholds
from controlplane.errors import Invalid
from controlplane.runtimes import outliers
from dashboards.security import Csrf, Operator, actor
from dashboards.views import attempt

router = APIRouter()


@router.post("/deployments/{name}/outliers/{outlier_id}/clear", dependencies=[Csrf])
def clear(name: str, outlier_id: int, request: Request, session: SessionDep, user: Operator,
          reason: Annotated[str, Form(max_length=2000)] = "") -> Response:
    def perform() -> str:
        if not reason.strip():
            raise Invalid("give a reason: it is recorded in the audit log and on the alert")
        deployment = thresholds.get_deployment(session=session, name=name)
        record = outliers.clear(session=session, deployment=deployment, outlier_id=outlier_id,
                                actor=actor(user), reason=reason.strip())
        thresholds.record_audit(session=session, deployment=deployment, actor=actor(user),
                                action="runtime.outlier_clear", reason=reason.strip(),
                                details={"runtime_id": record.runtime_id,
                                         "outlier_id": record.id})
        return (f"Runtime {record.runtime_id} cleared: its shadow tokens count again, and it "
                "is tested against the fleet every drift cycle.")

    return attempt(request, session, f"/deployments/{name}", perform)
