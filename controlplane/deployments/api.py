"""Thin routes for deployments, threshold sets, aliases, audit, declared segments and the
runtime config pull."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Header, Path, Query, Request, Response, status

from controlplane.auth.deps import OperatorPrincipal, get_principal
from controlplane.db import SessionDep
from controlplane.deployments import segments, service
from controlplane.deployments.access import RuntimePrincipal
from controlplane.deployments.delivery import (
    MAX_WAIT_S,
    ConfigDelivery,
    etag_matches,
    long_poll_timeout,
    pull_headers,
)
from controlplane.deployments.models import Deployment, ThresholdSet
from controlplane.deployments.schemas import (
    AliasMove,
    AliasName,
    AuditEventRead,
    DeclaredSegmentRead,
    DeploymentCreate,
    DeploymentRead,
    DeploymentUpdate,
    Rollback,
    SegmentChange,
    SegmentRegistryRead,
    ThresholdSetCreate,
    ThresholdSetRead,
    UndeclaredTraffic,
)
from controlplane.errors import RUNTIME_ERRORS, RateLimited, error_answer
from exitplane.wire import NAME_PATTERN, RUNTIME_ID_PATTERN, ThresholdPull

router = APIRouter(prefix="/v1/deployments", tags=["deployments"])


def _deployment_read(session, deployment: Deployment) -> DeploymentRead:
    read = DeploymentRead.model_validate(deployment)
    read.aliases = service.aliases_of(session=session, deployment=deployment)
    return read


def _set_read(threshold_set: ThresholdSet, aliases: dict[str, int]) -> ThresholdSetRead:
    read = ThresholdSetRead.model_validate(threshold_set)
    read.thresholds = threshold_set.thresholds_by_layer()
    read.segments = threshold_set.segments_by_layer()
    read.aliases = sorted(name for name, version in aliases.items()
                          if version == threshold_set.version)
    return read


@router.post("", status_code=status.HTTP_201_CREATED, response_model=DeploymentRead,
             responses={409: error_answer("a deployment of this name exists")})
def create_deployment(spec: DeploymentCreate, session: SessionDep,
                      principal: OperatorPrincipal) -> DeploymentRead:
    """Create a deployment: model, exit layers, signal, quality target and policy; its conservative
    set (never exit) is published as version 1 and made active (409 if the name is taken)."""
    deployment = service.create_deployment(session=session, spec=spec, actor=principal.actor)
    return _deployment_read(session, deployment)


@router.get("", response_model=list[DeploymentRead])
def list_deployments(session: SessionDep, principal: OperatorPrincipal) -> list[DeploymentRead]:
    """Every deployment with its aliases."""
    return [_deployment_read(session, d) for d in service.list_deployments(session=session)]


@router.get("/{name}", response_model=DeploymentRead)
def show_deployment(name: str, session: SessionDep,
                    principal: RuntimePrincipal) -> DeploymentRead:
    """One deployment with its aliases (`active`, `conservative`, `canary`)."""
    deployment = service.get_deployment(session=session, name=name)
    principal.require_deployment(deployment.id)
    return _deployment_read(session, deployment)


@router.patch("/{name}", response_model=DeploymentRead)
def update_deployment(name: str, spec: DeploymentUpdate, session: SessionDep,
                      principal: OperatorPrincipal) -> DeploymentRead:
    """Change a deployment's quality target, policy, fallback, segment or lineage settings; the
    fields left out keep their values."""
    deployment = service.get_deployment(session=session, name=name, lock=True)
    service.update_deployment(session=session, deployment=deployment, spec=spec,
                              actor=principal.actor)
    return _deployment_read(session, deployment)


@router.post("/{name}/threshold-sets", status_code=status.HTTP_201_CREATED,
             response_model=ThresholdSetRead)
def publish_threshold_set(name: str, spec: ThresholdSetCreate, request: Request,
                          session: SessionDep, principal: OperatorPrincipal) -> ThresholdSetRead:
    """Publish a new immutable threshold set (the next version); `activate` also makes it active."""
    deployment = service.get_deployment(session=session, name=name, lock=True)
    threshold_set = service.publish(
        session=session, deployment=deployment, thresholds=spec.thresholds, signal=spec.signal,
        reason=spec.reason, actor=principal.actor, expected_metrics=spec.expected_metrics,
        segments=spec.segments,
        max_segments=request.app.state.settings.max_segments_per_deployment)
    if spec.activate:
        service.move_alias(session=session, deployment=deployment, alias="active",
                           version=threshold_set.version, actor=principal.actor,
                           reason=spec.reason)
    return _set_read(threshold_set, service.aliases_of(session=session, deployment=deployment))


@router.get("/{name}/threshold-sets", response_model=list[ThresholdSetRead])
def list_threshold_sets(name: str, session: SessionDep, principal: OperatorPrincipal,
                        limit: Annotated[int, Query(ge=1, le=500)] = 100,
                        before_version: int | None = None) -> list[ThresholdSetRead]:
    """The deployment's threshold sets, newest first (`limit`, `before_version` to page)."""
    deployment = service.get_deployment(session=session, name=name)
    aliases = service.aliases_of(session=session, deployment=deployment)
    sets = service.list_threshold_sets(session=session, deployment=deployment, limit=limit,
                                       before_version=before_version)
    return [_set_read(s, aliases) for s in sets]


@router.get("/{name}/threshold-sets/{version}", response_model=ThresholdSetRead)
def show_threshold_set(name: str, version: int, session: SessionDep,
                       principal: OperatorPrincipal) -> ThresholdSetRead:
    """One threshold set with its thresholds, expected metrics and the aliases on it."""
    deployment = service.get_deployment(session=session, name=name)
    threshold_set = service.get_threshold_set(session=session, deployment=deployment,
                                              version=version)
    return _set_read(threshold_set, service.aliases_of(session=session, deployment=deployment))


@router.put("/{name}/aliases/{alias}", response_model=AuditEventRead)
def move_alias(name: str, alias: AliasName, move: AliasMove, session: SessionDep,
               principal: OperatorPrincipal) -> AuditEventRead:
    """Point an alias (`active`, `conservative`, `canary`) at a version; recorded as an audit event
    with the reason."""
    deployment = service.get_deployment(session=session, name=name, lock=True)
    event = service.move_alias(session=session, deployment=deployment, alias=alias,
                               version=move.version, actor=principal.actor, reason=move.reason)
    return AuditEventRead.model_validate(event)


@router.delete("/{name}/aliases/{alias}", response_model=AuditEventRead)
def clear_alias(name: str, alias: AliasName, session: SessionDep, principal: OperatorPrincipal,
                reason: Annotated[str, Query(min_length=1, max_length=2000)]) -> AuditEventRead:
    """Remove the `canary` alias (the others can only move); recorded as an audit event."""
    deployment = service.get_deployment(session=session, name=name, lock=True)
    event = service.clear_alias(session=session, deployment=deployment, alias=alias,
                                actor=principal.actor, reason=reason)
    return AuditEventRead.model_validate(event)


@router.post("/{name}/rollback", response_model=AuditEventRead,
             responses={409: error_answer("no earlier active version, or it is active")})
def rollback(name: str, spec: Rollback, session: SessionDep,
             principal: OperatorPrincipal) -> AuditEventRead:
    """Make the previously active version (or `to_version`) active again (409 when there is none, or
    it is active already)."""
    deployment = service.get_deployment(session=session, name=name, lock=True)
    event = service.rollback(session=session, deployment=deployment, actor=principal.actor,
                             reason=spec.reason, to_version=spec.to_version)
    return AuditEventRead.model_validate(event)


@router.get("/{name}/audit", response_model=list[AuditEventRead])
def audit_log(name: str, session: SessionDep, principal: OperatorPrincipal,
              limit: Annotated[int, Query(ge=1, le=1000)] = 100,
              before_id: int | None = None) -> list[AuditEventRead]:
    """The deployment's audit events (alias moves, publications, decisions), newest first."""
    deployment = service.get_deployment(session=session, name=name)
    events = service.audit_log(session=session, deployment=deployment, limit=limit,
                               before_id=before_id)
    return [AuditEventRead.model_validate(e) for e in events]


SegmentPath = Annotated[str, Path(pattern=NAME_PATTERN, description=(
    "the segment: lowercase letters, digits, _ . - (as deployment names)"))]


@router.get("/{name}/declared-segments", response_model=SegmentRegistryRead)
def declared_segments(name: str, request: Request, session: SessionDep,
                      principal: OperatorPrincipal,
                      window_s: Annotated[int, Query(ge=60, le=31 * 86400, description=(
                          "the window of undeclared traffic, ending now, in seconds"))] = 86400
                      ) -> SegmentRegistryRead:
    """The deployment's segments (in use and removed) and, per runtime over the window, the
    tokens stored as `default` because their segment was not in use."""
    deployment = service.get_deployment(session=session, name=name)
    return segment_registry_read(session=session, deployment=deployment, window_s=window_s,
                                 limit=request.app.state.settings.max_segments_per_deployment)


def segment_registry_read(*, session, deployment: Deployment, window_s: int,
                          limit: int) -> SegmentRegistryRead:
    """The registry and its undeclared traffic as the API, the CLI and the UI show it."""
    since = datetime.now(UTC) - timedelta(seconds=window_s)
    by_runtime = segments.undeclared_tokens(session=session, deployment=deployment, since=since)
    return SegmentRegistryRead(
        deployment=deployment.name, auto_segments=deployment.auto_segments, max_segments=limit,
        segments=[DeclaredSegmentRead.model_validate(row) for row in segments.segment_registry(
            session=session, deployment_id=deployment.id)],
        undeclared_since=since, undeclared_tokens=sum(item["tokens"] for item in by_runtime),
        undeclared_by_runtime=[UndeclaredTraffic(**item) for item in by_runtime])


@router.put("/{name}/declared-segments/{segment}", response_model=DeclaredSegmentRead)
def declare_segment(name: str, segment: SegmentPath, request: Request, session: SessionDep,
                    principal: OperatorPrincipal,
                    change: SegmentChange | None = None) -> DeclaredSegmentRead:
    """Put `segment` in use: its traffic is stored under its name (422 past the cap)."""
    deployment = service.get_deployment(session=session, name=name)
    row = segments.declare_segment(
        session=session, deployment=deployment, name=segment, actor=principal.actor,
        reason=(change.reason if change else "") or "declared",
        limit=request.app.state.settings.max_segments_per_deployment)
    return DeclaredSegmentRead.model_validate(row)


@router.delete("/{name}/declared-segments/{segment}", response_model=DeclaredSegmentRead,
               responses={409: error_answer("an aliased set has thresholds for the segment")})
def remove_segment(name: str, segment: SegmentPath, session: SessionDep,
                   principal: OperatorPrincipal,
                   reason: Annotated[str, Query(max_length=500)] = "") -> DeclaredSegmentRead:
    """Take `segment` out of use: its traffic is stored as `default` from now on; what was
    stored stays readable under its name (409 while an aliased set maps it)."""
    deployment = service.get_deployment(session=session, name=name)
    row = segments.remove_segment(session=session, deployment=deployment, name=segment,
                                  actor=principal.actor, reason=reason or "removed")
    return DeclaredSegmentRead.model_validate(row)


@router.get("/{name}/thresholds", response_model=ThresholdPull,
            responses={304: {"description": "the runtime already applies this set (and rate)"},
                       **RUNTIME_ERRORS})
async def pull_thresholds(
    name: str, request: Request, principal: RuntimePrincipal,
    runtime_id: Annotated[str, Query(min_length=1, max_length=128, pattern=RUNTIME_ID_PATTERN)],
    wait: Annotated[float, Query(ge=0, le=MAX_WAIT_S, description="long-poll seconds")] = 0,
    applies_shadow_rate: Annotated[bool, Query(description=(
        "the runtime applies the shadow rate the control plane sets: the ETag then changes "
        "with the rate as well as with the set"))] = False,
    applies_shadow_requests: Annotated[bool, Query(description=(
        "the runtime serves shadow requests at the rate the control plane sets: the ETag "
        "then changes with that rate too"))] = False,
    if_none_match: Annotated[str | None, Header()] = None,
) -> Response:
    """The set this runtime should apply (with the shadow rate the control plane asks for);
    304 if its ETag is current; `wait` long-polls."""
    delivery: ConfigDelivery = request.app.state.config_delivery
    state = await delivery.current(name)
    principal.require_deployment(state.deployment_id)
    chosen = state.for_runtime(runtime_id)
    etag = state.etag(chosen, applies_shadow_rate, applies_shadow_requests)
    if wait > 0 and etag_matches(if_none_match, etag):
        timeout = long_poll_timeout(wait, request.app.state.settings)
        with delivery.holding(principal.token_id) as held:
            if not held:
                raise RateLimited(
                    f"this token already holds {delivery.long_polls_per_token} long-polls on "
                    "this API process (EXITPLANE_LONG_POLLS_PER_TOKEN); poll again later",
                    retry_after=min(timeout, 10.0))
            state = await delivery.wait_for_change(name, runtime_id, etag, timeout,
                                                   applies_shadow_rate=applies_shadow_rate,
                                                   applies_shadow_requests=applies_shadow_requests)
        # The token may have been revoked while the poll was held: it is checked again (the
        # token cache, within its maximum age) before anything goes out.
        principal = await get_principal(request)
        principal.require_deployment(state.deployment_id)
        chosen = state.for_runtime(runtime_id)
        etag = state.etag(chosen, applies_shadow_rate, applies_shadow_requests)
    if etag_matches(if_none_match, etag):
        response = Response(status_code=status.HTTP_304_NOT_MODIFIED)
    else:
        response = Response(content=state.body(chosen), media_type="application/json")
    response.raw_headers.extend(pull_headers(etag, chosen.version))
    return response
