"""Recalibration jobs: status, per-layer results, the quality-vs-speed curve with the chosen
point, the version produced, approve / reject; start a recalibration."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import Response

from controlplane.calibration import service as calibration
from controlplane.db import SessionDep, utcnow
from controlplane.deployments import service as thresholds
from controlplane.errors import Invalid
from controlplane.flows import recalibration
from controlplane.flows.canary import running_canary
from dashboards import charts
from dashboards.security import Csrf, Operator, Viewer, actor
from dashboards.segments import segment_outcome
from dashboards.templating import redirect, render
from dashboards.views import attempt
from exitplane.wire import NEVER_EXIT

router = APIRouter()

WINDOW_HOURS = (1, 6, 24, 72)
DECISION_PENDING = ("awaiting_approval", "canary")


@router.get("/deployments/{name}/calibrations")
def jobs_page(name: str, request: Request, session: SessionDep, _user: Viewer) -> Response:
    deployment = thresholds.get_deployment(session=session, name=name)
    return render(request, "calibrations.html", deployment=deployment,
                  aliases=thresholds.aliases_of(session=session, deployment=deployment),
                  jobs=calibration.list_jobs(session=session, deployment=deployment, limit=100),
                  canary=running_canary(session=session, deployment=deployment),
                  window_hours=WINDOW_HOURS,
                  min_samples=request.app.state.settings.calibration_min_samples)


@router.post("/deployments/{name}/calibrations", dependencies=[Csrf])
def start(name: str, request: Request, session: SessionDep, user: Operator,
          reason: Annotated[str, Form(max_length=2000)] = "",
          hours: Annotated[int, Form()] = 24) -> Response:
    deployment = thresholds.get_deployment(session=session, name=name, lock=True)
    back = f"/deployments/{name}/calibrations"

    def perform() -> str:
        if not reason.strip():
            raise Invalid("give a reason: it is recorded with the job")
        if hours not in WINDOW_HOURS:
            raise Invalid(f"choose a window of {', '.join(map(str, WINDOW_HOURS))} hours")
        job, created = calibration.request_calibration(
            session=session, deployment=deployment, actor=actor(user), trigger="manual",
            since=utcnow() - timedelta(hours=hours), reason=reason.strip(),
            policy=calibration.CalibrationPolicy.from_settings(request.app.state.settings))
        if not created:
            raise Invalid(f"job {job.id} is already {job.status}; one job runs at a time")
        return f"Recalibration job {job.id} queued on the last {hours} h of shadow samples."

    return attempt(request, session, back, perform)


@router.get("/deployments/{name}/calibrations/{job_id}")
def job_page(name: str, job_id: int, request: Request, session: SessionDep,
             _user: Viewer) -> Response:
    deployment = thresholds.get_deployment(session=session, name=name)
    job = calibration.get_job(session=session, deployment=deployment, job_id=job_id)
    return render(request, "calibration.html", deployment=deployment, job=job,
                  aliases=thresholds.aliases_of(session=session, deployment=deployment),
                  curve=charts.calibration_curve(job=job, delta=deployment.delta),
                  segment_outcome=segment_outcome, never_exit=NEVER_EXIT,
                  pending=job.promotion in DECISION_PENDING)


@router.post("/deployments/{name}/calibrations/{job_id}/{decision}", dependencies=[Csrf])
def decide(name: str, job_id: int, decision: str, request: Request, session: SessionDep,
           user: Operator, reason: Annotated[str, Form(max_length=2000)] = "") -> Response:
    """Approve (promote) or reject (or revert the canary of) a job's candidate."""
    if decision not in ("approve", "reject"):
        return redirect(request, f"/deployments/{name}/calibrations/{job_id}",
                        f"unknown decision {decision!r}", "error")
    deployment = thresholds.get_deployment(session=session, name=name, lock=True)

    def perform() -> str:
        if not reason.strip():
            raise Invalid("give a reason: it goes into the audit log")
        job = calibration.get_job(session=session, deployment=deployment, job_id=job_id)
        decide_with = recalibration.approve if decision == "approve" else recalibration.reject
        decide_with(session=session, deployment=deployment, job=job, actor=actor(user),
                    reason=reason.strip())
        outcome = "approved: it is active" if decision == "approve" else "rejected"
        return f"Version {job.result_version} of job {job.id} {outcome}."

    return attempt(request, session, f"/deployments/{name}/calibrations/{job_id}", perform)
