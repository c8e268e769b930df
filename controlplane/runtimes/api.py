"""Thin routes for runtime heartbeats and the fleet listing."""

from __future__ import annotations

from fastapi import APIRouter, Request

from controlplane.deps import OperatorPrincipal, RuntimePrincipal, SessionDep, rate_limited
from controlplane.errors import RUNTIME_ERRORS
from controlplane.runtimes import service
from controlplane.runtimes.schemas import RuntimeRead
from controlplane.thresholds.service import get_deployment
from exitplane.wire import Heartbeat

router = APIRouter(prefix="/v1/deployments", tags=["runtimes"])


@router.post("/{name}/heartbeats", response_model=RuntimeRead,
             responses={409: {"description": "the deployment has its maximum of runtimes"},
                        **RUNTIME_ERRORS},
             dependencies=[rate_limited("heartbeat")])
def heartbeat(name: str, beat: Heartbeat, request: Request, session: SessionDep,
              principal: RuntimePrincipal) -> RuntimeRead:
    deployment = get_deployment(session=session, name=name)
    principal.require_deployment(deployment.id)
    runtime = service.record_heartbeat(
        session=session, deployment=deployment, beat=beat,
        max_runtimes=request.app.state.settings.max_runtimes_per_deployment)
    return RuntimeRead.model_validate(runtime)


@router.get("/{name}/runtimes", response_model=list[RuntimeRead])
def list_runtimes(name: str, request: Request, session: SessionDep,
                  principal: OperatorPrincipal) -> list[RuntimeRead]:
    request.app.state.heartbeats.flush()  # what this process told runtimes it recorded
    deployment = get_deployment(session=session, name=name)
    return [RuntimeRead.model_validate(r)
            for r in service.list_runtimes(session=session, deployment=deployment)]
