"""Jinja2 templates, filters and the two ways a UI route answers: a page or a redirect."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from fastapi import Request
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.templating import Jinja2Templates

from controlplane.auth.users import has_role
from controlplane.db import utcnow
from dashboards.security import (
    clear_flash,
    current_session,
    read_flash,
    save_session,
    set_flash,
)

TEMPLATES = Path(__file__).parent / "templates"
templates = Jinja2Templates(directory=str(TEMPLATES))


def ago(when: datetime | None) -> str:
    """'42 s ago', '3 min ago', '5 h ago', '2 d ago'."""
    if when is None:
        return "never"
    seconds = (utcnow() - when).total_seconds()
    if seconds < 0:
        return "just now"
    for size, unit in ((86400, "d"), (3600, "h"), (60, "min")):
        if seconds >= size:
            return f"{int(seconds // size)} {unit} ago"
    return f"{int(seconds)} s ago"


def utc(when: datetime | None) -> str:
    return when.strftime("%Y-%m-%d %H:%M:%S UTC") if when else "—"


def pct(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value * 100:.{digits}f}%"


def num(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


templates.env.filters.update(ago=ago, utc=utc, pct=pct, num=num)
templates.env.globals.update(has_role=has_role)


def ui_root(request: Request) -> str:
    """Where the UI is mounted ("/ui"), for links in templates."""
    return request.scope.get("root_path", "").rstrip("/")


def render(request: Request, template: str, status_code: int = 200, **context) -> HTMLResponse:
    """A page with the signed-in user, the CSRF token and any flash message in its context."""
    body = templates.get_template(template).render(
        request=request, ui=ui_root(request), csrf_token=current_session(request).csrf,
        user=getattr(request.state, "user", None), flash=read_flash(request), **context)
    page = HTMLResponse(body, status_code=status_code, headers={"Cache-Control": "no-store"})
    clear_flash(request, page)
    save_session(request, page)
    return page


def redirect(request: Request, path: str, message: str | None = None,
             kind: str = "ok") -> RedirectResponse:
    """303 to `path` (relative to the UI root), optionally with a flash message."""
    response = RedirectResponse(ui_root(request) + path, status_code=303)
    if message:
        set_flash(request, response, message, kind)
    save_session(request, response)
    return response
