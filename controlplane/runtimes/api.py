"""Thin routes for runtime heartbeats and the fleet listing."""

from __future__ import annotations

from fastapi import APIRouter

from controlplane import metrics
from controlplane.deps import OperatorPrincipal, RuntimePrincipal, SessionDep
from controlplane.runtimes import service
from controlplane.runtimes.schemas import RuntimeRead
from controlplane.thresholds.service import get_deployment
from exitplane.wire import Heartbeat

router = APIRouter(prefix="/v1/deployments", tags=["runtimes"])


@router.post("/{name}/heartbeats", response_model=RuntimeRead)
def heartbeat(name: str, beat: Heartbeat, session: SessionDep,
              principal: RuntimePrincipal) -> RuntimeRead:
    deployment = get_deployment(session=session, name=name)
    principal.require_deployment(deployment.id)
    runtime = service.record_heartbeat(session=session, deployment=deployment, beat=beat)
    labels = (deployment.name, beat.runtime_id)
    metrics.runtime_spooled.labels(*labels).set(beat.spooled_batches)
    metrics.runtime_dropped.labels(*labels).set(beat.dropped_records)
    if beat.applied_version is not None:
        metrics.runtime_applied_version.labels(*labels).set(beat.applied_version)
    return RuntimeRead.model_validate(runtime)


@router.get("/{name}/runtimes", response_model=list[RuntimeRead])
def list_runtimes(name: str, session: SessionDep,
                  principal: OperatorPrincipal) -> list[RuntimeRead]:
    deployment = get_deployment(session=session, name=name)
    return [RuntimeRead.model_validate(r)
            for r in service.list_runtimes(session=session, deployment=deployment)]
