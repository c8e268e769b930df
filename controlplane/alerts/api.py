"""Thin routes: alerts (list, show, ack, resolve, report), hooks (admin) and deliveries."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response, status
from fastapi.responses import HTMLResponse

from controlplane.alerts import delivery_service, hook_service, reports, service
from controlplane.alerts.guard import HookGuard
from controlplane.alerts.models import Alert, AlertHook
from controlplane.alerts.schemas import (
    AlertAck,
    AlertRead,
    AlertResolve,
    DeliveryRead,
    HookCreate,
    HookCreated,
    HookRead,
    HookUpdate,
)
from controlplane.auth.deps import AdminPrincipal, OperatorPrincipal
from controlplane.db import SessionDep
from controlplane.deployments.models import Deployment
from controlplane.deployments.service import get_deployment
from controlplane.errors import error_answer

router = APIRouter(prefix="/v1", tags=["alerts"])
Limit = Annotated[int, Query(ge=1, le=1000)]


def _names(session, ids) -> dict[int, str]:
    return {d.id: d.name for d in (session.get(Deployment, i) for i in set(ids) if i) if d}


def _alert_read(request: Request, alert: Alert, names: dict[int, str]) -> AlertRead:
    read = AlertRead.model_validate(alert)
    read.deployment = names.get(alert.deployment_id, "")
    if alert.has_report:
        read.report_url = f"{request.app.state.settings.base_url}/v1/alerts/{alert.id}/report"
    return read


def _guard(request: Request) -> HookGuard:
    return hook_service.hook_guard(request.app.state.settings)


def _hook_read(hook: AlertHook, names: dict[int, str], guard: HookGuard,
               model=HookRead) -> HookRead:
    # The URL is a credential for many receivers (Slack's carries its key): masked.
    read = model.model_validate(hook)
    read.url = hook_service.shown_url(hook=hook, guard=guard)
    read.deployment = names.get(hook.deployment_id) if hook.deployment_id else None
    read.has_secret = bool(hook.secret)
    read.has_routing_key = bool(hook.routing_key)
    return read


@router.get("/alerts", response_model=list[AlertRead])
def list_alerts(request: Request, session: SessionDep, principal: OperatorPrincipal,
                deployment: str | None = None,
                status: Annotated[str | None, Query(description="open, firing, acknowledged, "
                                                    "resolved")] = None,
                kind: str | None = None, limit: Limit = 100,
                before_id: int | None = None) -> list[AlertRead]:
    """Alerts, newest first, filtered by deployment, status and kind (`before_id` to page)."""
    target = get_deployment(session=session, name=deployment) if deployment else None
    alerts = service.list_alerts(session=session, deployment=target, status=status, kind=kind,
                                 limit=limit, before_id=before_id)
    names = _names(session, [a.deployment_id for a in alerts])
    return [_alert_read(request, a, names) for a in alerts]


@router.get("/alerts/{alert_id}", response_model=AlertRead)
def show_alert(alert_id: int, request: Request, session: SessionDep,
               principal: OperatorPrincipal) -> AlertRead:
    """One alert with its evidence (test, statistic, windows)."""
    alert = service.get_alert(session=session, alert_id=alert_id)
    return _alert_read(request, alert, _names(session, [alert.deployment_id]))


@router.post("/alerts/{alert_id}/ack", response_model=AlertRead,
             responses={409: error_answer("the alert is resolved")})
def acknowledge(alert_id: int, body: AlertAck, request: Request, session: SessionDep,
                principal: OperatorPrincipal) -> AlertRead:
    """Acknowledge a firing alert: it stops paging (409 once resolved)."""
    alert = service.get_alert(session=session, alert_id=alert_id, lock=True)
    service.acknowledge(session=session, alert=alert, actor=principal.actor, note=body.note)
    return _alert_read(request, alert, _names(session, [alert.deployment_id]))


@router.post("/alerts/{alert_id}/resolve", response_model=AlertRead,
             responses={409: error_answer("the alert is resolved already")})
def resolve(alert_id: int, body: AlertResolve, request: Request, session: SessionDep,
            principal: OperatorPrincipal) -> AlertRead:
    """Resolve an alert (409 if it is resolved already)."""
    alert = service.get_alert(session=session, alert_id=alert_id, lock=True)
    service.resolve(session=session, alert=alert, actor=principal.actor, reason=body.reason)
    return _alert_read(request, alert, _names(session, [alert.deployment_id]))


@router.get("/alerts/{alert_id}/report", response_class=HTMLResponse)
def alert_report(alert_id: int, session: SessionDep,
                 principal: OperatorPrincipal) -> HTMLResponse:
    """An alert's report as an HTML page: its evidence and the windows it compared."""
    alert = service.get_alert(session=session, alert_id=alert_id)
    return HTMLResponse(reports.report_html(session=session, alert=alert),
                        headers=reports.REPORT_HEADERS)


@router.get("/alerts/{alert_id}/deliveries", response_model=list[DeliveryRead])
def alert_deliveries(alert_id: int, session: SessionDep,
                     principal: OperatorPrincipal, limit: Limit = 100) -> list[DeliveryRead]:
    """Every delivery of the alert to the hooks: status, attempts, last answer."""
    alert = service.get_alert(session=session, alert_id=alert_id)
    return [DeliveryRead.model_validate(d)
            for d in delivery_service.list_deliveries(session=session, alert=alert, limit=limit)]


@router.get("/hooks", response_model=list[HookRead])
def list_hooks(request: Request, session: SessionDep, principal: AdminPrincipal,
               deployment: str | None = None) -> list[HookRead]:
    """Alert hooks (webhook, Alertmanager, PagerDuty, Slack), optionally of one deployment; URLs are
    shown without their secrets."""
    target = get_deployment(session=session, name=deployment) if deployment else None
    found = hook_service.list_hooks(session=session, deployment=target)
    names = _names(session, [h.deployment_id for h in found])
    guard = _guard(request)
    return [_hook_read(h, names, guard) for h in found]


@router.post("/hooks", status_code=status.HTTP_201_CREATED, response_model=HookCreated)
def create_hook(spec: HookCreate, request: Request, session: SessionDep,
                principal: AdminPrincipal) -> HookCreated:
    """Create an alert hook; a signing secret generated for it is in this answer only (one the
    request gave is never sent back)."""
    target = get_deployment(session=session, name=spec.deployment) if spec.deployment else None
    guard = _guard(request)
    hook = hook_service.create_hook(
        session=session, name=spec.name, kind=spec.kind, url=str(spec.url), actor=principal.actor,
        deployment=target, min_severity=spec.min_severity, secret=spec.secret,
        routing_key=spec.routing_key, enabled=spec.enabled, guard=guard, reason=spec.reason)
    read = _hook_read(hook, _names(session, [hook.deployment_id]), guard, model=HookCreated)
    # generated: shown once, on this response only; one the request gave is never sent back
    read.secret = guard.vault.decrypt(hook.secret) if spec.secret is None else None
    return read


@router.get("/hooks/{hook_id}", response_model=HookRead)
def show_hook(hook_id: int, request: Request, session: SessionDep,
              principal: AdminPrincipal) -> HookRead:
    """One alert hook."""
    hook = hook_service.get_hook(session=session, hook_id=hook_id)
    return _hook_read(hook, _names(session, [hook.deployment_id]), _guard(request))


@router.patch("/hooks/{hook_id}", response_model=HookRead)
def update_hook(hook_id: int, spec: HookUpdate, request: Request, session: SessionDep,
                principal: AdminPrincipal) -> HookRead:
    """Change an alert hook's URL, severity floor or enabled state."""
    hook = hook_service.get_hook(session=session, hook_id=hook_id)
    changes = spec.model_dump(exclude_none=True, exclude={"reason"})
    if "url" in changes:
        changes["url"] = str(changes["url"])
    guard = _guard(request)
    hook_service.update_hook(session=session, hook=hook, changes=changes, guard=guard,
                             actor=principal.actor, reason=spec.reason)
    return _hook_read(hook, _names(session, [hook.deployment_id]), guard)


@router.delete("/hooks/{hook_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_hook(hook_id: int, session: SessionDep, principal: AdminPrincipal,
                reason: Annotated[str, Query(max_length=2000,
                                             description="why, for the audit log")] = ""
                ) -> Response:
    """Delete an alert hook and its deliveries."""
    hook = hook_service.get_hook(session=session, hook_id=hook_id)
    hook_service.delete_hook(session=session, hook=hook, actor=principal.actor, reason=reason)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/hooks/{hook_id}/test", response_model=DeliveryRead)
def send_test_alert(hook_id: int, request: Request, session: SessionDep,
                    principal: AdminPrincipal) -> DeliveryRead:
    """Send a test alert to the hook now and return the logged attempt."""
    settings = request.app.state.settings
    hook = hook_service.get_hook(session=session, hook_id=hook_id)
    delivery = delivery_service.send_test_alert(
        session=session, hook=hook, base_url=settings.base_url, actor=principal.actor,
        timeout_s=settings.delivery_timeout_s, guard=_guard(request))
    return DeliveryRead.model_validate(delivery)


@router.get("/hooks/{hook_id}/deliveries", response_model=list[DeliveryRead])
def hook_deliveries(hook_id: int, session: SessionDep, principal: AdminPrincipal,
                    limit: Limit = 100, before_id: int | None = None) -> list[DeliveryRead]:
    """The hook's deliveries, newest first."""
    hook = hook_service.get_hook(session=session, hook_id=hook_id)
    return [DeliveryRead.model_validate(d) for d in delivery_service.list_deliveries(
        session=session, hook=hook, limit=limit, before_id=before_id)]
