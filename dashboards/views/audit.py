"""The fleet-wide audit log (admin): every deployment's changes and every administrative
action, newest first, filtered by a GET form and paged by the log's cursor."""

from __future__ import annotations

from datetime import UTC, datetime
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.responses import Response

from controlplane.db import SessionDep
from controlplane.deployments import service as thresholds
from controlplane.deployments.audit import AuditFilter, fleet_audit
from controlplane.errors import Invalid
from dashboards.security import Admin
from dashboards.templating import render

router = APIRouter()

PAGE = 50
FILTERS = ("actor", "action", "deployment", "object_kind", "since", "until")
OBJECT_KINDS = ("deployment", "alias", "threshold_set", "token", "user", "hook", "alert")


def _moment(value: str, name: str) -> datetime | None:
    """An ISO time from the form (UTC when it has no offset); None when left empty."""
    if not value:
        return None
    try:
        found = datetime.fromisoformat(value)
    except ValueError:
        raise Invalid(f"{name}: {value[:40]!r} is not a time like 2026-12-05T09:30") from None
    return found if found.tzinfo else found.replace(tzinfo=UTC)


def _text(value: str, longest: int) -> str | None:
    value = value.strip()
    return value[:longest] if value else None


@router.get("/audit")
def audit_page(request: Request, session: SessionDep, _user: Admin) -> Response:
    form = {name: request.query_params.get(name, "").strip() for name in FILTERS}
    cursor = request.query_params.get("cursor") or None
    try:
        rules = AuditFilter(actor=_text(form["actor"], 200), action=_text(form["action"], 51),
                            deployment=_text(form["deployment"], 63),
                            object_kind=_text(form["object_kind"], 30),
                            since=_moment(form["since"], "since"),
                            until=_moment(form["until"], "until"))
        events = fleet_audit(session=session, rules=rules, limit=PAGE,
                             cursor=cursor[:200] if cursor else None)
        error, status = None, 200
    except Invalid as problem:
        events, error, status = [], str(problem), 422
    kept = {name: value for name, value in form.items() if value}
    older = (urlencode({**kept, "cursor": events[-1].cursor})
             if len(events) == PAGE else None)
    return render(request, "audit.html", status_code=status, nav="audit", events=events,
                  form=form, error=error, older=older, paged=cursor is not None,
                  newest=urlencode(kept), object_kinds=OBJECT_KINDS,
                  deployments=[d.name for d in thresholds.list_deployments(session=session)])
