"""What monitors ask the API: `/metrics` (Prometheus, behind EXITPLANE_METRICS_TOKEN when it
is set), `/healthz` (liveness) and `/readyz` (readiness)."""

from __future__ import annotations

import hmac
from typing import Annotated

from anyio import to_thread
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy.engine import Engine

from controlplane import metrics
from controlplane.errors import Unauthorized
from controlplane.health import Readiness
from controlplane.settings import Settings
from exitplane import __version__
from exitplane.kit.bearer import bearer_token


def add_probes(app: FastAPI, settings: Settings, engine: Engine) -> None:
    """Register the probes' routes on `app` (its `state.redis` set)."""

    @app.get("/metrics", tags=["health"], include_in_schema=False)
    async def prometheus_metrics(request: Request) -> Response:
        if settings.metrics_token:
            require_metrics_token(request, settings.metrics_token)
        # The store-backed gauges query the store: off the event loop (and cached briefly).
        body = await to_thread.run_sync(generate_latest, metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict:
        """The process is up (liveness); no token, no store read."""
        return {"status": "ok", "version": __version__}

    readiness = Readiness(engine, app.state.redis)

    @app.get("/readyz", tags=["health"])
    async def readyz(deep: Annotated[bool, Query(description=(
            "ask the store and Redis now (for operators and monitors, not the probe)"))] = False,
    ) -> JSONResponse:
        """Readiness: 200 once the store has answered this process, and through later store or
        Redis outages (its caches answer pulls, the rest gets 503 with Retry-After), so an
        outage never takes every replica out of the Service at once. `deep=true`: 503 with
        Retry-After while the store or Redis does not answer now."""
        return await (readiness.deep() if deep else readiness.ready())


def require_metrics_token(request: Request, token: str) -> None:
    """Refuse a scrape without `Authorization: Bearer <EXITPLANE_METRICS_TOKEN>`."""
    given = bearer_token(request.headers.get("authorization", "")) or ""
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise Unauthorized("/metrics needs 'Authorization: Bearer <EXITPLANE_METRICS_TOKEN>'")
