"""Alerts (list, detail with evidence and the Evidently report, acknowledge, resolve) and the
hooks that page on them (admin: create, enable, delete, send a test alert, delivery log)."""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, Response
from pydantic import ValidationError

from controlplane.alerts import delivery_service, hook_service
from controlplane.alerts import service as alerts
from controlplane.alerts.models import HOOK_KINDS, KINDS, SEVERITIES
from controlplane.alerts.reports import REPORT_HEADERS, report_html
from controlplane.alerts.schemas import HookCreate
from controlplane.db import SessionDep
from controlplane.deployments import service as thresholds
from controlplane.deployments.models import Deployment
from controlplane.errors import DomainError, Invalid
from dashboards.security import Admin, Csrf, Operator, Viewer, actor
from dashboards.templating import redirect, render
from dashboards.views import attempt

router = APIRouter()

STATUS_FILTERS = ("open", "firing", "acknowledged", "resolved", "all")


def _names(session) -> dict[int, str]:
    return {d.id: d.name for d in thresholds.list_deployments(session=session)}


@router.get("/alerts")
def alerts_page(request: Request, session: SessionDep, _user: Viewer, status: str = "open",
                deployment: str = "", kind: str = "") -> Response:
    status = status if status in STATUS_FILTERS else "open"
    target = thresholds.get_deployment(session=session, name=deployment) if deployment else None
    found = alerts.list_alerts(session=session, deployment=target,
                               status=None if status == "all" else status,
                               kind=kind if kind in KINDS else None, limit=200)
    return render(request, "alerts.html", nav="alerts", alerts=found, names=_names(session),
                  status=status, statuses=STATUS_FILTERS, deployment=deployment, kind=kind,
                  kinds=KINDS)


def _evidence_rows(evidence: dict, prefix: str = "") -> list[tuple[str, str]]:
    rows = []
    for key, value in evidence.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            rows.extend(_evidence_rows(value, f"{name}."))
        elif isinstance(value, float):
            rows.append((name, f"{value:.6g}"))
        elif isinstance(value, list) and len(value) > 12:
            rows.append((name, json.dumps(value[:12])[:-1] + f", … ({len(value)} values)]"))
        else:
            rows.append((name, value if isinstance(value, str) else json.dumps(value)))
    return rows


@router.get("/alerts/{alert_id}")
def alert_page(alert_id: int, request: Request, session: SessionDep, _user: Viewer) -> Response:
    alert = alerts.get_alert(session=session, alert_id=alert_id)
    deployment = session.get(Deployment, alert.deployment_id)
    hooks = {h.id: h for h in hook_service.list_hooks(session=session)}
    return render(request, "alert.html", nav="alerts", alert=alert, deployment=deployment,
                  evidence=_evidence_rows(alert.evidence or {}),
                  deliveries=delivery_service.list_deliveries(session=session, alert=alert,
                                                              limit=50),
                  hooks=hooks, has_report=alert.has_report)


@router.get("/alerts/{alert_id}/report")
def alert_report(alert_id: int, session: SessionDep, _user: Viewer) -> HTMLResponse:
    alert = alerts.get_alert(session=session, alert_id=alert_id)
    return HTMLResponse(report_html(session=session, alert=alert), headers=REPORT_HEADERS)


@router.post("/alerts/{alert_id}/ack", dependencies=[Csrf])
def acknowledge(alert_id: int, request: Request, session: SessionDep, user: Operator,
                note: Annotated[str, Form(max_length=2000)] = "") -> Response:
    def perform() -> str:
        alert = alerts.get_alert(session=session, alert_id=alert_id, lock=True)
        alerts.acknowledge(session=session, alert=alert, actor=actor(user), note=note.strip())
        return f"Alert {alert_id} acknowledged; it stays open until its condition clears."

    return attempt(request, session, f"/alerts/{alert_id}", perform)


@router.post("/alerts/{alert_id}/resolve", dependencies=[Csrf])
def resolve(alert_id: int, request: Request, session: SessionDep, user: Operator,
            reason: Annotated[str, Form(max_length=2000)] = "") -> Response:
    def perform() -> str:
        if not reason.strip():
            raise Invalid("give a reason: it is recorded with the alert and sent to the hooks")
        alert = alerts.get_alert(session=session, alert_id=alert_id, lock=True)
        alerts.resolve(session=session, alert=alert, actor=actor(user), reason=reason.strip())
        return f"Alert {alert_id} resolved."

    return attempt(request, session, f"/alerts/{alert_id}", perform)


@router.get("/hooks")
def hooks_page(request: Request, session: SessionDep, _user: Admin) -> Response:
    return _hooks_page(request, session)


def _hooks_page(request: Request, session, status_code: int = 200, **extra) -> Response:
    deployments = thresholds.list_deployments(session=session)
    guard = hook_service.hook_guard(request.app.state.settings)
    found = hook_service.list_hooks(session=session)
    return render(request, "hooks.html", status_code=status_code, nav="hooks",
                  hooks=found, kinds=HOOK_KINDS,
                  urls={h.id: hook_service.shown_url(hook=h, guard=guard) for h in found},
                  severities=SEVERITIES, deployments=deployments,
                  names={d.id: d.name for d in deployments}, **extra)


@router.post("/hooks", dependencies=[Csrf])
def create_hook(request: Request, session: SessionDep, user: Admin,
                name: Annotated[str, Form()], kind: Annotated[str, Form()],
                url: Annotated[str, Form()], deployment: Annotated[str, Form()] = "",
                min_severity: Annotated[str, Form()] = "warning",
                routing_key: Annotated[str, Form()] = "") -> Response:
    """Create a hook; a webhook's generated HMAC secret is shown on this response only."""
    try:
        try:
            spec = HookCreate(name=name.strip(), kind=kind, url=url.strip(),
                              deployment=deployment or None, min_severity=min_severity,
                              routing_key=routing_key.strip() or None)
        except ValidationError as error:
            problem = error.errors()[0]
            raise Invalid(f"{'.'.join(str(p) for p in problem['loc'])}: "
                          f"{problem['msg']}") from None
        target = (thresholds.get_deployment(session=session, name=spec.deployment)
                  if spec.deployment else None)
        guard = hook_service.hook_guard(request.app.state.settings)
        hook = hook_service.create_hook(
            session=session, name=spec.name, kind=spec.kind, url=str(spec.url),
            actor=actor(user), deployment=target, min_severity=spec.min_severity,
            routing_key=spec.routing_key, guard=guard)
    except DomainError as error:
        session.rollback()
        return _hooks_page(request, session, status_code=error.status_code, error=str(error))
    return _hooks_page(request, session, status_code=201, created=hook,
                       secret=guard.vault.decrypt(hook.secret))


@router.get("/hooks/{hook_id}")
def hook_page(hook_id: int, request: Request, session: SessionDep, _user: Admin) -> Response:
    hook = hook_service.get_hook(session=session, hook_id=hook_id)
    guard = hook_service.hook_guard(request.app.state.settings)
    shown = hook_service.shown_url(hook=hook, guard=guard)
    return render(request, "hook.html", nav="hooks", hook=hook, names=_names(session),
                  url=shown,
                  deliveries=delivery_service.list_deliveries(session=session, hook=hook,
                                                              limit=100))


@router.post("/hooks/{hook_id}/test", dependencies=[Csrf])
def send_test_alert(hook_id: int, request: Request, session: SessionDep,
                    user: Admin) -> Response:
    """Send a marked test alert now; the attempt is logged whether it worked or not."""
    settings = request.app.state.settings
    hook = hook_service.get_hook(session=session, hook_id=hook_id)
    delivery = delivery_service.send_test_alert(
        session=session, hook=hook, base_url=settings.base_url, actor=actor(user),
        timeout_s=settings.delivery_timeout_s, guard=hook_service.hook_guard(settings))
    if delivery.ok:
        return redirect(request, f"/hooks/{hook_id}",
                        f"Test alert delivered to {hook.name!r} (HTTP {delivery.status_code}, "
                        f"{delivery.duration_ms:.0f} ms).")
    return redirect(request, f"/hooks/{hook_id}",
                    f"Test alert to {hook.name!r} failed: "
                    f"{delivery.error or f'HTTP {delivery.status_code}'}", "error")


@router.post("/hooks/{hook_id}/enabled", dependencies=[Csrf])
def set_hook_enabled(hook_id: int, request: Request, session: SessionDep, _user: Admin,
                     enabled: Annotated[str, Form()]) -> Response:
    def perform() -> str:
        hook = hook_service.get_hook(session=session, hook_id=hook_id)
        hook_service.update_hook(session=session, hook=hook,
                                 changes={"enabled": enabled == "true"}, actor=actor(_user))
        return f"Hook {hook.name!r} {'enabled' if hook.enabled else 'disabled'}."

    return attempt(request, session, "/hooks", perform)


@router.post("/hooks/{hook_id}/delete", dependencies=[Csrf])
def delete_hook(hook_id: int, request: Request, session: SessionDep, _user: Admin) -> Response:
    def perform() -> str:
        hook = hook_service.get_hook(session=session, hook_id=hook_id)
        name = hook.name
        hook_service.delete_hook(session=session, hook=hook, actor=actor(_user))
        return f"Hook {name!r} and its delivery log deleted."

    return attempt(request, session, "/hooks", perform)
