"""A deployment's page: live charts of its exit behaviour, its runtimes and its activity."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from controlplane.alerts import service as alerts
from controlplane.deps import SessionDep
from controlplane.runtimes.lineage import mismatched_runtime_ids
from controlplane.runtimes.outliers import list_outliers
from controlplane.runtimes.service import list_runtimes
from controlplane.telemetry import reads
from controlplane.telemetry.service import raw_sample_rate
from controlplane.thresholds import service as thresholds
from dashboards import charts
from dashboards.security import Viewer
from dashboards.segments import segment_table
from dashboards.templating import render
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
