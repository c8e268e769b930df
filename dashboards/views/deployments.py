"""A deployment's page: live charts of its exit behaviour, its runtimes and its activity; an
operator removes a runtime from it (through a confirmation page)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import JSONResponse, Response

from controlplane.alerts import service as alerts
from controlplane.db import SessionDep
from controlplane.deployments import service as thresholds
from controlplane.errors import Invalid, NotFound
from controlplane.runtimes.lineage import mismatched_runtime_ids
from controlplane.runtimes.outliers import list_outliers
from controlplane.runtimes.service import list_runtimes, remove_runtimes
from controlplane.telemetry import reads
from controlplane.telemetry.service import raw_sample_rate
from dashboards import charts
from dashboards.answers_panel import answers_panel
from dashboards.curve_panel import curve_panel
from dashboards.savings_panel import savings_panel
from dashboards.security import Csrf, Operator, Viewer, actor
from dashboards.segments import segment_table
from dashboards.templating import render
from dashboards.views import attempt
from dashboards.views.overview import REPORTING_WITHIN, runtime_counts
from exitplane.wire import NEVER_EXIT

router = APIRouter()

REFRESH_S = 15  # default; the UI app's state.refresh_s overrides it


def _window(window: str) -> tuple[str, int]:
    return (window, charts.WINDOWS[window]) if window in charts.WINDOWS else ("1h", 60)


@router.get("/deployments/{name}")
def deployment_page(name: str, request: Request, session: SessionDep, _user: Viewer,
                    window: str = "1h", segment: str | None = None) -> Response:
    deployment = thresholds.get_deployment(session=session, name=name)
    reads.check_segment(session=session, deployment=deployment, segment=segment)
    window, minutes = _window(window)
    aliases = thresholds.aliases_of(session=session, deployment=deployment)
    active = thresholds.get_threshold_set(session=session, deployment=deployment,
                                          version=aliases["active"])
    request.app.state.heartbeats.flush()  # the beats this process holds, written first
    runtimes = list_runtimes(session=session, deployment=deployment)
    markers = charts.markers_for(session=session, deployment=deployment,
                                 since=charts.since_for(minutes))
    initial = charts.deployment_figures(session=session, deployment=deployment,
                                        minutes=minutes, markers=markers, segment=segment)
    return render(
        request, "deployment.html", deployment=deployment, aliases=aliases, active=active,
        runtimes=runtimes, counts=runtime_counts(runtimes, aliases.get("active")),
        mismatched=mismatched_runtime_ids(session=session, deployment_id=deployment.id),
        outliers=list_outliers(session=session, deployment=deployment, limit=20),
        reporting_within=REPORTING_WITHIN, window=window, windows=charts.WINDOWS,
        initial=initial, totals=initial["totals"], alerts_enabled=True,
        segments=segment_table(initial["segments"], active), never_exit=NEVER_EXIT,
        segment=segment,
        curve_panel=curve_panel(
            session=session, deployment=deployment, segment=segment,
            interval_s=request.app.state.settings.operating_curve_interval_s),
        savings_panel=savings_panel(session=session, deployments=[deployment],
                                    minutes=minutes, segment=segment,
                                    settings=request.app.state.settings),
        answers_panel=answers_panel(session=session, deployment=deployment,
                                    threshold_set=active, minutes=minutes, segment=segment,
                                    settings=request.app.state.settings),
        raw_sample_rate=raw_sample_rate(session=session, deployment=deployment),
        refresh_s=getattr(request.app.state, "refresh_s", REFRESH_S),
        open_alerts=alerts.open_alerts(session=session, deployment=deployment),
        events=thresholds.audit_log(session=session, deployment=deployment, limit=20))


@router.get("/deployments/{name}/charts.json")
def deployment_charts(name: str, session: SessionDep, _user: Viewer,
                      window: str = "1h", segment: str | None = None) -> JSONResponse:
    """The deployment page's figures, fetched again every REFRESH_S seconds."""
    deployment = thresholds.get_deployment(session=session, name=name)
    reads.check_segment(session=session, deployment=deployment, segment=segment)
    _, minutes = _window(window)
    markers = charts.markers_for(session=session, deployment=deployment,
                                 since=charts.since_for(minutes))
    return JSONResponse(charts.deployment_figures(session=session, deployment=deployment,
                                                  minutes=minutes, markers=markers,
                                                  segment=segment),
                        headers={"Cache-Control": "no-store"})


@router.get("/deployments/{name}/runtimes/{runtime_id}/remove")
def remove_runtime_page(name: str, runtime_id: str, request: Request, session: SessionDep,
                        _user: Operator) -> Response:
    """What removing the runtime does, and the form that does it."""
    deployment = thresholds.get_deployment(session=session, name=name)
    runtime = next((r for r in list_runtimes(session=session, deployment=deployment)
                    if r.runtime_id == runtime_id), None)
    if runtime is None:
        raise NotFound(f"deployment {deployment.name!r} has no runtime {runtime_id!r}")
    return render(request, "runtime_remove.html", deployment=deployment, runtime=runtime,
                  aliases=thresholds.aliases_of(session=session, deployment=deployment))


@router.post("/deployments/{name}/runtimes/{runtime_id}/remove", dependencies=[Csrf])
def remove_runtime(name: str, runtime_id: str, request: Request, session: SessionDep,
                   user: Operator, reason: Annotated[str, Form(max_length=2000)] = "") -> Response:
    """Remove a runtime from the fleet view and the caps (as DELETE
    /v1/deployments/{name}/runtimes/{runtime_id}), recorded in the audit log."""
    def perform() -> str:
        if not reason.strip():
            raise Invalid("give a reason: it is recorded in the audit log")
        deployment = thresholds.get_deployment(session=session, name=name)
        removed = remove_runtimes(session=session, deployment=deployment,
                                  runtime_id=runtime_id)
        request.app.state.heartbeats.forget(deployment.id, removed)
        thresholds.record_audit(session=session, deployment=deployment, actor=actor(user),
                                action="runtime.remove", reason=reason.strip(),
                                details={"runtime_id": runtime_id})
        return (f"Runtime {runtime_id} removed: it no longer counts against the caps on "
                "runtimes. If it sends another heartbeat it registers anew.")

    return attempt(request, session, f"/deployments/{name}", perform)
