"""A deployment's segments page: which segments are in use (and removed), where each came from,
the traffic stored as `default` because its segment was not declared, and the operator's
actions: declare, remove, and whether telemetry may register names."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.datastructures import FormData

from controlplane.db import SessionDep
from controlplane.deployments import segments as registry
from controlplane.deployments import service as thresholds
from controlplane.deployments.schemas import DeploymentUpdate
from controlplane.deployments.segments import undeclared_tokens
from dashboards.security import Csrf, Operator, Viewer, actor
from dashboards.segments import registry_rows
from dashboards.templating import render
from dashboards.views import attempt

router = APIRouter()

UNDECLARED_WINDOW = timedelta(hours=24)


async def _form(request: Request) -> FormData:
    return await request.form()


@router.get("/deployments/{name}/segments")
def segments_page(name: str, request: Request, session: SessionDep, _user: Viewer) -> Response:
    deployment = thresholds.get_deployment(session=session, name=name)
    aliases = thresholds.aliases_of(session=session, deployment=deployment)
    since = datetime.now(UTC) - UNDECLARED_WINDOW
    undeclared = undeclared_tokens(session=session, deployment=deployment, since=since)
    rows = registry_rows(session=session, deployment=deployment, aliases=aliases)
    return render(request, "segments.html", deployment=deployment, aliases=aliases, rows=rows,
                  in_use=sum(1 for row in rows if row.in_use),
                  limit=request.app.state.settings.max_segments_per_deployment,
                  undeclared=undeclared, undeclared_tokens=sum(u["tokens"] for u in undeclared),
                  undeclared_hours=int(UNDECLARED_WINDOW.total_seconds() // 3600))


@router.post("/deployments/{name}/segments", dependencies=[Csrf])
def declare(name: str, request: Request, session: SessionDep, user: Operator,
            form: Annotated[FormData, Depends(_form)]) -> Response:
    """Declare the form's segment (the service checks the name and the cap)."""
    deployment = thresholds.get_deployment(session=session, name=name)
    segment = str(form.get("segment", "")).strip()
    reason = str(form.get("reason", "")).strip()[:500] or "declared in the admin UI"

    def perform() -> str:
        registry.declare_segment(
            session=session, deployment=deployment, name=segment, actor=actor(user),
            reason=reason, limit=request.app.state.settings.max_segments_per_deployment)
        return f"Segment {segment} is in use: its traffic is stored under its name."

    return attempt(request, session, f"/deployments/{name}/segments", perform)


@router.post("/deployments/{name}/segments/{segment}/remove", dependencies=[Csrf])
def remove(name: str, segment: str, request: Request, session: SessionDep, user: Operator,
           form: Annotated[FormData, Depends(_form)]) -> Response:
    """Remove a segment: its traffic is stored as `default` from now on."""
    deployment = thresholds.get_deployment(session=session, name=name)
    reason = str(form.get("reason", "")).strip()[:500] or "removed in the admin UI"

    def perform() -> str:
        registry.remove_segment(session=session, deployment=deployment, name=segment,
                                actor=actor(user), reason=reason)
        return (f"Segment {segment} removed: its traffic is stored as default from now on; "
                "what was stored stays readable.")

    return attempt(request, session, f"/deployments/{name}/segments", perform)


@router.post("/deployments/{name}/segments/auto", dependencies=[Csrf])
def auto_register(name: str, request: Request, session: SessionDep, user: Operator,
                  form: Annotated[FormData, Depends(_form)]) -> Response:
    """Whether runtime telemetry may register names nobody declared (audited)."""
    deployment = thresholds.get_deployment(session=session, name=name, lock=True)
    wanted = form.get("auto_segments") == "on"

    def perform() -> str:
        if deployment.auto_segments == wanted:
            return "Nothing changed."
        thresholds.update_deployment(session=session, deployment=deployment,
                                     spec=DeploymentUpdate(auto_segments=wanted),
                                     actor=actor(user))
        return ("Telemetry registers new segment names (up to the cap)." if wanted else
                "Only declared segments are stored under their names.")

    return attempt(request, session, f"/deployments/{name}/segments", perform)
