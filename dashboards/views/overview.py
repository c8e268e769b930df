"""The overview: every deployment's health at a glance."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from fastapi import APIRouter, Request
from fastapi.responses import Response
from markupsafe import Markup
from sqlalchemy.orm import Session

from controlplane.alerts import service as alerts
from controlplane.db import SessionDep, utcnow
from controlplane.deployments import service as thresholds
from controlplane.deployments.models import Deployment
from controlplane.runtimes.models import Runtime
from controlplane.runtimes.service import list_runtimes
from dashboards import charts
from dashboards.savings_panel import savings_panel
from dashboards.security import Viewer
from dashboards.templating import render

router = APIRouter()

SPARK_MINUTES = 60
SAVINGS_MINUTES = 24 * 60  # the fleet's savings panel: the last day
# A runtime heartbeats every few seconds; one silent this long is not reporting.
REPORTING_WITHIN = timedelta(minutes=2)


@dataclass
class RuntimeCounts:
    total: int
    reporting: int
    on_active: int
    ready: int


def runtime_counts(runtimes: list[Runtime], active: int | None) -> RuntimeCounts:
    cutoff = utcnow() - REPORTING_WITHIN
    reporting = [r for r in runtimes if r.last_seen >= cutoff]
    return RuntimeCounts(total=len(runtimes), reporting=len(reporting),
                         on_active=sum(1 for r in reporting if r.applied_version == active),
                         ready=sum(1 for r in reporting if r.ready))


@dataclass
class DeploymentHealth:
    deployment: Deployment
    aliases: dict[str, int]
    runtimes: RuntimeCounts
    totals: dict
    exit_spark: Markup
    disagreement_spark: Markup
    firing_alerts: int

    @property
    def fallback_engaged(self) -> bool:
        return self.aliases.get("active") == self.aliases.get("conservative")

    @property
    def status(self) -> tuple[str, str]:
        """(css class, words) for the deployment's badge."""
        disagreement = self.totals["disagreement"]
        if self.firing_alerts:
            return "bad", f"{self.firing_alerts} alert{'s' * (self.firing_alerts > 1)} firing"
        if disagreement is not None and disagreement > self.deployment.delta:
            return "bad", "disagreement above δ"
        if self.fallback_engaged:
            return "warn", "fallback engaged"
        if not self.totals["tokens"]:
            return "muted", "no recent telemetry"
        return "ok", "healthy"


def health(*, session: Session, deployment: Deployment) -> DeploymentHealth:
    aliases = thresholds.aliases_of(session=session, deployment=deployment)
    since = charts.since_for(SPARK_MINUTES)
    summary = charts.per_minute(session=session, deployment=deployment, since=since)
    exit_series = charts.minute_series(summary, since, SPARK_MINUTES, "exit_rate")
    dis_series = charts.minute_series(summary, since, SPARK_MINUTES, "disagreement")
    return DeploymentHealth(
        deployment=deployment, aliases=aliases,
        runtimes=runtime_counts(list_runtimes(session=session, deployment=deployment),
                                aliases.get("active")),
        totals=charts.totals(deployment, summary),
        exit_spark=charts.sparkline(exit_series, ceiling=1.0,
                                    label="early-exit rate per minute, last hour"),
        disagreement_spark=charts.sparkline(
            dis_series, limit=deployment.delta, ceiling=deployment.delta * 2,
            label=f"shadow disagreement per minute vs δ {deployment.delta:g}, last hour"),
        firing_alerts=sum(1 for a in alerts.open_alerts(session=session, deployment=deployment)
                          if a.status == "firing"))


@router.get("/")
def overview(request: Request, session: SessionDep, _user: Viewer) -> Response:
    deployments = thresholds.list_deployments(session=session)
    rows = [health(session=session, deployment=d) for d in deployments]
    return render(request, "overview.html", rows=rows, minutes=SPARK_MINUTES,
                  savings_panel=savings_panel(session=session, deployments=deployments,
                                              minutes=SAVINGS_MINUTES, fleet=True,
                                              settings=request.app.state.settings))
