"""Thin routes of the savings (`telemetry.savings`): what early exit saved in accelerator time
against full depth, net of exit checks and shadow tokens, for one deployment or the fleet."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query, Request
from pydantic import AwareDatetime
from sqlalchemy import select

from controlplane.auth.deps import OperatorPrincipal
from controlplane.db import SessionDep
from controlplane.deployments.access import RuntimePrincipal
from controlplane.deployments.models import Deployment
from controlplane.deployments.service import get_deployment
from controlplane.errors import Invalid
from controlplane.telemetry import reads
from controlplane.telemetry.savings import fleet_total, savings
from controlplane.telemetry.schemas import DeploymentSavings, FleetSavings
from exitplane.wire import NAME_PATTERN

router = APIRouter(tags=["telemetry"])

MAX_WINDOW_S = 31 * 86400

WindowS = Annotated[int, Query(ge=60, le=MAX_WINDOW_S, description=(
    "the window ending at `until` (default: now), in seconds; `since` overrides it"))]
Since = Annotated[AwareDatetime | None, Query(description="start of the window")]
Until = Annotated[AwareDatetime | None, Query(description="end of the window (default: now)")]
Segment = Annotated[str | None, Query(pattern=NAME_PATTERN, max_length=64, description=(
    "one traffic segment ('default' or a registered name); default: every segment"))]
RuntimeId = Annotated[str | None, Query(min_length=1, max_length=128,
                                        description="one runtime; default: every runtime")]


def window(window_s: int, since: datetime | None, until: datetime | None) -> tuple[datetime,
                                                                                   datetime]:
    """[since, until) of a query: at most MAX_WINDOW_S long, `since` before `until`."""
    until = until or datetime.now(UTC)
    since = since or until - timedelta(seconds=window_s)
    if since >= until:
        raise Invalid(f"since ({since.isoformat()}) must be before until ({until.isoformat()})")
    if until - since > timedelta(seconds=MAX_WINDOW_S):
        raise Invalid(f"a savings window is at most {MAX_WINDOW_S // 86400} days; ask for a "
                      "shorter one")
    return since, until


@router.get("/v1/deployments/{name}/savings", response_model=DeploymentSavings)
def deployment_savings(name: str, request: Request, session: SessionDep,
                       principal: RuntimePrincipal, window_s: WindowS = 3600,
                       since: Since = None, until: Until = None,
                       segment: Segment = None, runtime_id: RuntimeId = None) -> dict:
    """What early exit saved the deployment over the window: tokens, layers saved, accelerator
    time at full depth and spent, the net saving (negative: a loss) split into exits, checks
    and shadow tokens, the measured speed-up, the same in the configured cost unit, and the
    fitted cost model."""
    deployment = get_deployment(session=session, name=name)
    principal.require_deployment(deployment.id)
    reads.check_segment(session=session, deployment=deployment, segment=segment)
    since, until = window(window_s, since, until)
    [report] = savings(session=session, deployments=[deployment], since=since, until=until,
                       segment=segment, runtime_id=runtime_id,
                       settings=request.app.state.settings)
    return {**report, "since": since, "until": until}


@router.get("/v1/savings", response_model=FleetSavings)
def fleet_savings(request: Request, session: SessionDep, principal: OperatorPrincipal,
                  window_s: WindowS = 3600, since: Since = None, until: Until = None,
                  segment: Segment = None, runtime_id: RuntimeId = None) -> dict:
    """What early exit saved every deployment over the window, and the fleet in total (time
    figures over the deployments with a cost model)."""
    since, until = window(window_s, since, until)
    deployments = list(session.scalars(select(Deployment).order_by(Deployment.name)))
    settings = request.app.state.settings
    reports = savings(session=session, deployments=deployments, since=since, until=until,
                      segment=segment, runtime_id=runtime_id, settings=settings)
    return {"since": since, "until": until, "segment": segment, "runtime_id": runtime_id,
            "deployments": [{**report, "since": since, "until": until} for report in reports],
            "total": fleet_total(reports, settings)}
