"""Thin routes for runtimes set aside as outliers: list them, clear one."""

from __future__ import annotations

from fastapi import APIRouter

from controlplane.auth.deps import OperatorPrincipal
from controlplane.db import SessionDep
from controlplane.deployments.service import get_deployment, record_audit
from controlplane.runtimes import outliers
from controlplane.runtimes.schemas import OutlierClear, RuntimeOutlierRead

router = APIRouter(prefix="/v1/deployments", tags=["runtimes"])


@router.get("/{name}/runtime-outliers", response_model=list[RuntimeOutlierRead])
def list_outliers(name: str, session: SessionDep, principal: OperatorPrincipal,
                  open_only: bool = False) -> list[RuntimeOutlierRead]:
    """Runtimes set aside (and, unless `open_only`, those cleared since), newest first."""
    deployment = get_deployment(session=session, name=name)
    return [RuntimeOutlierRead.model_validate(record) for record in outliers.list_outliers(
        session=session, deployment=deployment, open_only=open_only)]


@router.post("/{name}/runtime-outliers/{outlier_id}/clear", response_model=RuntimeOutlierRead,
             responses={404: {"description": "no such outlier record"},
                        409: {"description": "already cleared"}})
def clear_outlier(name: str, outlier_id: int, body: OutlierClear, session: SessionDep,
                  principal: OperatorPrincipal) -> RuntimeOutlierRead:
    """Take the runtime's evidence back: its samples count again, and it is tested again every
    drift cycle; its `runtime_outlier` alert resolves."""
    deployment = get_deployment(session=session, name=name)
    record = outliers.clear(session=session, deployment=deployment, outlier_id=outlier_id,
                            actor=principal.actor, reason=body.reason)
    record_audit(session=session, deployment=deployment, actor=principal.actor,
                 action="runtime.outlier_clear", reason=body.reason,
                 details={"runtime_id": record.runtime_id, "outlier_id": record.id})
    return RuntimeOutlierRead.model_validate(record)
