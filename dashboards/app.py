"""The admin UI as an application mounted under /ui of the control plane.

It shares the control plane's settings, store and token cache, and answers errors with HTML:
not signed in -> the login page; a domain error -> a page saying what was wrong.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import plotly
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from controlplane.errors import DomainError
from controlplane.guards.holds import RefusalHold
from controlplane.guards.password_checks import PasswordChecks
from controlplane.guards.signin_gate import SignInGate
from controlplane.guards.signin_throttle import SignInThrottle
from controlplane.settings import parse_networks
from dashboards.security import LoginRequired, save_session
from dashboards.templating import render, ui_root
from dashboards.views import (
    admin,
    alerts,
    audit,
    calibration,
    deployments,
    outliers,
    overview,
    segments,
    sessions,
    versions,
    what_if,
)

STATIC = Path(__file__).parent / "static"
PLOTLY_JS = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
# Plotly injects <style> elements, hence 'unsafe-inline' for styles only; no script is inline.
CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self' "
                           "'unsafe-inline'; img-src 'self' data:; connect-src 'self'; "
                           "frame-ancestors 'none'; form-action 'self'; base-uri 'none'; "
                           "object-src 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Frame-Options": "DENY",
                    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin"}


def create_ui(parent: FastAPI) -> FastAPI:
    """The UI application, sharing `parent`'s settings, session factory and token cache."""
    ui = FastAPI(title="exitplane admin UI", docs_url=None, redoc_url=None, openapi_url=None)
    ui.state.settings = parent.state.settings
    ui.state.session_factory = parent.state.session_factory
    ui.state.principal_cache = parent.state.principal_cache
    ui.state.heartbeats = parent.state.heartbeats  # a page lists what this process holds too
    # Throttled through Redis when configured (parent.state.redis), else the store.
    ui.state.password_checks = PasswordChecks(
        factory=parent.state.session_factory,
        throttle=SignInThrottle(parent.state.redis, factory=parent.state.session_factory),
        max_concurrent=parent.state.settings.password_checks_max_concurrent)
    ui.state.trusted_proxies = parse_networks(parent.state.settings.trusted_proxies)

    @ui.middleware("http")
    async def security_headers(request: Request, call_next) -> Response:
        response = await call_next(request)
        for name, value in SECURITY_HEADERS.items():
            response.headers.setdefault(name, value)
        return response


    @ui.exception_handler(LoginRequired)
    async def login_required(request: Request, _error: LoginRequired) -> Response:
        wanted = request.url.path if request.method == "GET" else ui_root(request) + "/"
        response = RedirectResponse(f"{ui_root(request)}/login?next={quote(wanted)}",
                                    status_code=303)
        save_session(request, response)
        return response

    @ui.exception_handler(DomainError)
    async def domain_error(request: Request, error: DomainError) -> Response:
        return render(request, "error.html", status_code=error.status_code,
                      title=_TITLES.get(error.status_code, "Something went wrong"),
                      message=str(error))

    @ui.exception_handler(RequestValidationError)
    async def invalid_form(request: Request, error: RequestValidationError) -> Response:
        problems = [f"{'.'.join(str(p) for p in e.get('loc', ())[1:])}: {e.get('msg')}"
                    for e in error.errors()]
        return render(request, "error.html", status_code=422, title="Invalid input",
                      message="; ".join(problems) or "the form was incomplete")

    @ui.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> Response:
        return render(request, "error.html", status_code=error.status_code,
                      title=_TITLES.get(error.status_code, "Something went wrong"),
                      message=str(error.detail))

    @ui.get("/vendor/plotly.min.js", include_in_schema=False)
    async def plotly_js() -> FileResponse:
        """Plotly's bundle, from the installed Python package (no CDN, nothing fetched)."""
        return FileResponse(PLOTLY_JS, media_type="text/javascript",
                            headers={"Cache-Control": "public, max-age=86400"})

    ui.mount("/static", StaticFiles(directory=STATIC), name="static")
    for module in (sessions, overview, deployments, versions, calibration, alerts, admin,
                   outliers, segments, what_if, audit):
        ui.include_router(module.router)
    return ui


def mount_ui(app: FastAPI) -> None:
    """Serve the admin UI under /ui of the control plane `app` (and send / there)."""
    ui = create_ui(app)
    ui.state.sign_in_hold = RefusalHold(app.state.settings.sign_in_hold_s)
    app.mount("/ui", ui, name="ui")
    # Outside the control plane's own middleware (its body gate reads a form before routing):
    # a refused address waits, and a locked-out one is refused, before anything else runs.
    app.add_middleware(SignInGate, refused=ui.state.password_checks.refused,
                       trusted_proxies=ui.state.trusted_proxies,
                       hold=ui.state.sign_in_hold, headers=SECURITY_HEADERS,
                       prefix="/ui")

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/ui/", status_code=307)


_TITLES = {401: "Please sign in", 403: "Not allowed", 404: "Not found", 409: "Conflict",
           422: "Invalid input", 503: "Unavailable"}
