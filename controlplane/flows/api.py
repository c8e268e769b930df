"""Thin routes of calibration: start a recalibration, list / show jobs, approve / reject a
candidate; start, show (with its members), promote and revert a canary. They live with the
flows they set off (`flows.recalibration`, `flows.canary`)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response, status
from pydantic import BaseModel, Field

from controlplane.auth.deps import OperatorPrincipal
from controlplane.calibration import service
from controlplane.calibration.schemas import (
    CalibrationCreate,
    CalibrationJobDetail,
    CalibrationJobRead,
    CalibrationRequested,
    CanaryCreate,
    CanaryRead,
    Decision,
)
from controlplane.db import SessionDep
from controlplane.deployments.schemas import DeploymentUpdate
from controlplane.deployments.service import get_deployment, update_deployment
from controlplane.errors import Conflict, NotFound, error_answer
from controlplane.flows import canary, recalibration
from controlplane.flows.canary import (
    canary_members,
    promote_canary,
    revert_canary,
    running_canary,
)
from controlplane.flows.removal import live_runtimes

router = APIRouter(prefix="/v1/deployments/{name}", tags=["calibration"])


@router.post("/calibrations", status_code=status.HTTP_202_ACCEPTED,
             response_model=CalibrationRequested,
             responses={200: {"description": "a job was already open; it is returned"}})
def start_calibration(name: str, spec: CalibrationCreate, session: SessionDep,
                      principal: OperatorPrincipal, request: Request,
                      response: Response) -> CalibrationRequested:
    """Queue a recalibration on the shadow samples of a window (the worker runs it)."""
    settings = request.app.state.settings
    deployment = get_deployment(session=session, name=name, lock=True)
    job, created = service.request_calibration(
        session=session, deployment=deployment, actor=principal.actor, trigger="manual",
        since=spec.since, until=spec.until, reason=spec.reason or "requested by an operator",
        policy=service.CalibrationPolicy.from_settings(settings), segment=spec.segment)
    if not created:
        response.status_code = status.HTTP_200_OK
    return CalibrationRequested(job=CalibrationJobRead.model_validate(job), created=created)


@router.get("/calibrations", response_model=list[CalibrationJobRead])
def list_calibrations(name: str, session: SessionDep, principal: OperatorPrincipal,
                      limit: Annotated[int, Query(ge=1, le=500)] = 50,
                      before_id: int | None = None) -> list[CalibrationJobRead]:
    """The deployment's calibration jobs, newest first (`before_id` to page)."""
    deployment = get_deployment(session=session, name=name)
    jobs = service.list_jobs(session=session, deployment=deployment, limit=limit,
                             before_id=before_id)
    return [CalibrationJobRead.model_validate(job) for job in jobs]


@router.get("/calibrations/{job_id}", response_model=CalibrationJobDetail)
def show_calibration(name: str, job_id: int, session: SessionDep,
                     principal: OperatorPrincipal) -> CalibrationJobDetail:
    """One calibration job: the per-layer thresholds chosen with their risk, bound and p-value, the
    curve and the resulting version."""
    deployment = get_deployment(session=session, name=name)
    job = service.get_job(session=session, deployment=deployment, job_id=job_id)
    return CalibrationJobDetail.model_validate(job)


@router.post("/calibrations/{job_id}/approve", response_model=CalibrationJobRead,
             responses={409: error_answer("the job has no candidate waiting for a decision")})
def approve(name: str, job_id: int, decision: Decision, session: SessionDep,
            principal: OperatorPrincipal) -> CalibrationJobRead:
    """Promote a candidate waiting for approval (or whose canary paused) to active."""
    deployment = get_deployment(session=session, name=name, lock=True)
    job = service.get_job(session=session, deployment=deployment, job_id=job_id)
    recalibration.approve(session=session, deployment=deployment, job=job, actor=principal.actor,
                          reason=decision.reason)
    return CalibrationJobRead.model_validate(job)


@router.post("/calibrations/{job_id}/reject", response_model=CalibrationJobRead,
             responses={409: error_answer("the job has no candidate waiting for a decision")})
def reject(name: str, job_id: int, decision: Decision, session: SessionDep,
           principal: OperatorPrincipal) -> CalibrationJobRead:
    """Refuse a candidate waiting for approval, or revert its canary."""
    deployment = get_deployment(session=session, name=name, lock=True)
    job = service.get_job(session=session, deployment=deployment, job_id=job_id)
    recalibration.reject(session=session, deployment=deployment, job=job, actor=principal.actor,
                         reason=decision.reason)
    return CalibrationJobRead.model_validate(job)


class CanaryMember(BaseModel):
    """A live runtime the canary fraction serves the canary version."""

    runtime_id: str
    applied_version: int | None
    last_seen: datetime


class CanaryView(CanaryRead):
    """A canary run with the runtimes it reaches now."""

    canary_fraction: float = Field(description="the share of runtime ids the canary serves "
                                               "(the deployment's canary_fraction)")
    live_runtimes: int = Field(description=(
        "the deployment's runtimes heard from within EXITPLANE_RUNTIME_STALE_AFTER_S"))
    members: list[CanaryMember] = Field(description=(
        "the live runtimes that fall into the canary fraction, by runtime id"))
    warnings: list[str] = Field(default_factory=list, description=(
        "what keeps the canary from being judged, e.g. no live runtime among its members"))


def _canary_view(session, deployment, run, request: Request) -> CanaryView:
    """The run, its live members and a warning when no live runtime falls into them."""
    live = live_runtimes(session=session, deployment=deployment,
                         stale_after_s=request.app.state.settings.runtime_stale_after_s)
    chosen = canary_members(deployment=deployment, runtime_ids=[r.runtime_id for r in live])
    members = [CanaryMember(runtime_id=r.runtime_id, applied_version=r.applied_version,
                            last_seen=r.last_seen) for r in live if r.runtime_id in chosen]
    warnings = []
    if run.status in ("running", "paused") and not members:
        warnings.append(
            f"no live runtime of {deployment.name!r} falls into the canary "
            f"({deployment.canary_fraction:.0%} of {len(live)} live runtime(s)): version "
            f"{run.version} is served to none and cannot be judged until one does; raise the "
            "deployment's canary_fraction or start more runtimes")
    return CanaryView(**CanaryRead.model_validate(run).model_dump(),
                      canary_fraction=deployment.canary_fraction, live_runtimes=len(live),
                      members=members, warnings=warnings)


@router.get("/canary", response_model=CanaryView)
def canary_status(name: str, request: Request, session: SessionDep,
                  principal: OperatorPrincipal) -> CanaryView:
    """The newest canary run of the deployment with every window's verdict, and the live
    runtimes that fall into its fraction (its members)."""
    deployment = get_deployment(session=session, name=name)
    run = running_canary(session=session, deployment=deployment)
    if run is None:
        raise NotFound(f"deployment {name!r} never ran a canary")
    return _canary_view(session, deployment, run, request)


@router.post("/canary", status_code=status.HTTP_201_CREATED, response_model=CanaryView,
             responses={
                 404: error_answer("no such deployment, or it has no such threshold set "
                                   "version"),
                 409: error_answer("the version is the active one, or a canary is already "
                                   "running or paused (promote or revert it first)")})
def start_canary(name: str, spec: CanaryCreate, request: Request, session: SessionDep,
                 principal: OperatorPrincipal) -> CanaryView:
    """Start a checked canary of a published version: a hash-sticky share of runtimes (the
    deployment's `canary_fraction`) applies it while the rest keep the active one, and the
    canary monitor judges its windows against the quality target and promotes or reverts it,
    as after a calibration under the `canary` policy. The audit log records the version, the
    fraction, the stable version and the reason. The answer names the live runtimes that fall
    into the canary, with a warning in `warnings` when none does."""
    deployment = get_deployment(session=session, name=name, lock=True)
    if spec.canary_fraction is not None and spec.canary_fraction != deployment.canary_fraction:
        # One unit of work with the start: a refused start leaves the fraction as it was.
        update_deployment(session=session, deployment=deployment,
                          spec=DeploymentUpdate(canary_fraction=spec.canary_fraction),
                          actor=principal.actor)
    run = canary.start_canary(session=session, deployment=deployment, version=spec.version,
                              actor=principal.actor, reason=spec.reason, replace_open=False)
    return _canary_view(session, deployment, run, request)


@router.post("/canary/promote", response_model=CanaryRead,
             responses={409: error_answer("no running or paused canary")})
def promote(name: str, decision: Decision, session: SessionDep,
            principal: OperatorPrincipal) -> CanaryRead:
    """Promote the running (or paused) canary's version to active now (409 without one)."""
    deployment = get_deployment(session=session, name=name, lock=True)
    run = _open_canary(session, deployment)
    promote_canary(session=session, deployment=deployment, run=run, actor=principal.actor,
                   reason=decision.reason)
    return CanaryRead.model_validate(run)


@router.post("/canary/revert", response_model=CanaryRead,
             responses={409: error_answer("no running or paused canary")})
def revert(name: str, decision: Decision, session: SessionDep,
           principal: OperatorPrincipal) -> CanaryRead:
    """Revert the running (or paused) canary: the active version stays (409 without one)."""
    deployment = get_deployment(session=session, name=name, lock=True)
    run = _open_canary(session, deployment)
    revert_canary(session=session, deployment=deployment, run=run, actor=principal.actor,
                  reason=decision.reason, fire_alert=False)
    return CanaryRead.model_validate(run)


def _open_canary(session, deployment):
    run = running_canary(session=session, deployment=deployment, lock=True)
    if run is None or run.status not in ("running", "paused"):
        raise Conflict(f"deployment {deployment.name!r} has no running or paused canary")
    return run
