"""Thin routes for runtime heartbeats, the fleet listing and removing runtimes."""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Query, Request

from controlplane.auth.deps import OperatorPrincipal
from controlplane.db import SessionDep
from controlplane.deployments.access import RuntimePrincipal
from controlplane.deployments.audit import record_audit
from controlplane.deployments.service import get_deployment
from controlplane.errors import RUNTIME_ERRORS, error_answer
from controlplane.runtimes import service
from controlplane.runtimes.schemas import RuntimeRead, RuntimesRemoved
from exitplane.wire import Heartbeat

log = logging.getLogger("exitplane.api")

Reason = Annotated[str, Query(max_length=2000,
                               description="why (written to the audit log)")]


router = APIRouter(prefix="/v1/deployments", tags=["runtimes"])


@router.post("/{name}/heartbeats", response_model=RuntimeRead,
             responses={409: error_answer("the deployment, or this token on it, has its "
                                          "maximum of runtimes"),
                        **RUNTIME_ERRORS})
def heartbeat(name: str, beat: Heartbeat, request: Request, session: SessionDep,
              principal: RuntimePrincipal) -> RuntimeRead:
    """A runtime says which set it applies, whether it is ready and what it spooled or dropped; the
    first beat (or telemetry batch) registers it in the fleet to the token that sent it (409
    past the runtime caps; 403 for a runtime id another token registered)."""
    deployment = get_deployment(session=session, name=name)
    principal.require_deployment(deployment.id)
    target = request.app.state.deployment_cache.get(name, service.applied_versions(beat))
    service.check_applied_version(target=target, beat=beat)
    runtime = service.record_heartbeat(
        session=session, deployment=deployment, beat=beat, token_id=principal.token_id,
        claim=principal.scope == "runtime",
        caps=service.RuntimeCaps.from_settings(request.app.state.settings))
    return RuntimeRead.model_validate(runtime)


@router.post("/{name}/runtimes/{runtime_id}/leave", response_model=RuntimesRemoved,
             responses=RUNTIME_ERRORS)
def leave(name: str, runtime_id: str, request: Request, session: SessionDep,
          principal: RuntimePrincipal) -> RuntimesRemoved:
    """A runtime that stops cleanly leaves the fleet: it is dropped from the fleet view and
    the caps at once, so no `runtime_stale` alert fires for it. Only the runtime token that
    registered it may take it out (403 for another live one; a runtime whose token was
    revoked leaves with its new one); operator tokens may too, and a token of another
    deployment gets 403. It registers anew if it beats again."""
    deployment = get_deployment(session=session, name=name)
    principal.require_deployment(deployment.id)
    removed = service.remove_runtimes(
        session=session, deployment=deployment, runtime_id=runtime_id,
        owner=principal.token_id if principal.scope == "runtime" else None)
    request.app.state.heartbeats.forget(deployment.id, removed)
    request.app.state.runtime_claims.forget(deployment.id, removed)
    log.info("runtime %r left deployment %r", runtime_id, deployment.name)
    return RuntimesRemoved(removed=removed)


@router.get("/{name}/runtimes", response_model=list[RuntimeRead])
def list_runtimes(name: str, request: Request, session: SessionDep,
                  principal: OperatorPrincipal) -> list[RuntimeRead]:
    """The deployment's fleet: each runtime's applied version, readiness, last heartbeat and
    lineage."""
    request.app.state.heartbeats.flush()  # what this process told runtimes it recorded
    deployment = get_deployment(session=session, name=name)
    return [RuntimeRead.model_validate(r)
            for r in service.list_runtimes(session=session, deployment=deployment)]


@router.delete("/{name}/runtimes/{runtime_id}", response_model=RuntimesRemoved)
def remove_runtime(name: str, runtime_id: str, request: Request, session: SessionDep,
                   principal: OperatorPrincipal, reason: Reason = "") -> RuntimesRemoved:
    """Remove a runtime from the fleet view and the caps; it registers anew if it beats
    again."""
    deployment = get_deployment(session=session, name=name)
    removed = service.remove_runtimes(session=session, deployment=deployment,
                                      runtime_id=runtime_id)
    return _removed(request, session, deployment, removed, principal, reason)


@router.delete("/{name}/runtimes", response_model=RuntimesRemoved)
def remove_runtimes_of_token(
    name: str, request: Request, session: SessionDep, principal: OperatorPrincipal,
    token_id: Annotated[int, Query(description="remove every runtime this token registered")],
    reason: Reason = "",
) -> RuntimesRemoved:
    """Remove every runtime a token registered (a leaked token's, say, once revoked)."""
    deployment = get_deployment(session=session, name=name)
    removed = service.remove_runtimes(session=session, deployment=deployment,
                                      token_id=token_id)
    return _removed(request, session, deployment, removed, principal, reason)


def _removed(request: Request, session, deployment, removed: list[str], principal,
             reason: str) -> RuntimesRemoved:
    if removed:
        record_audit(session=session, deployment=deployment,
                     actor=principal.actor, action="runtime.remove", reason=reason,
                     details={"runtime_ids": removed})
    request.app.state.heartbeats.forget(deployment.id, removed)
    request.app.state.runtime_claims.forget(deployment.id, removed)
    log.info("%s removed %d runtime(s) of deployment %r", principal.actor, len(removed),
             deployment.name)
    return RuntimesRemoved(removed=removed)
