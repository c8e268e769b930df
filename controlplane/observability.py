"""Request ids, access logs and HTTP request metrics for the control plane (issue 15).

One pure-ASGI middleware per request: it takes the caller's `X-Request-ID` (or makes one),
keeps it in the logging context for every line the request logs and for the Celery tasks it
enqueues, returns it in the response, writes one access-log line and observes the request's
duration by route template (never the raw path: ids in paths would explode the series).
"""

from __future__ import annotations

import logging
import time

from prometheus_client import Histogram

from controlplane.metrics import registry
from exitplane.logs import access_log_enabled, new_request_id, request_id_var

access_log = logging.getLogger("exitplane.access")

# Prometheus' default buckets stretched to the long polls (up to 60 s) the config route holds.
http_request_duration = Histogram(
    "exitplane_http_request_duration_seconds", "HTTP request duration by route template",
    ["method", "route", "status"], registry=registry,
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0))


def route_template(scope: dict) -> str:
    """The matched route's path template (`/v1/deployments/{name}`), or 'unmatched'."""
    route = scope.get("route")
    path = getattr(route, "path", None) or getattr(route, "path_format", None)
    if not path:
        return "unmatched"
    return f"{scope.get('root_path', '')}{path}"


class RequestContext:
    """X-Request-ID in and out, one access line and one duration sample per HTTP request."""

    def __init__(self, app, *, access_log: bool | None = None) -> None:
        self.app = app
        self.access_log = access_log_enabled() if access_log is None else access_log

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        offered = next((value.decode("latin-1") for name, value in scope["headers"]
                        if name == b"x-request-id"), None)
        request_id = new_request_id(offered)
        token = request_id_var.set(request_id)
        started = time.perf_counter()
        status = 500

        async def send_with_id(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"],
                                      (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            elapsed = time.perf_counter() - started
            route = route_template(scope)
            http_request_duration.labels(scope["method"], route, str(status)).observe(elapsed)
            if self.access_log:
                access_log.info("%s %s %s %.1fms", scope["method"], scope["path"], status,
                                elapsed * 1000, extra={
                                    "method": scope["method"], "path": scope["path"],
                                    "route": route, "status": status,
                                    "duration_ms": round(elapsed * 1000, 2),
                                    "client": (scope.get("client") or ("", 0))[0]})
            request_id_var.reset(token)


def install(app, *, access_log: bool | None = None) -> None:
    """Add the middleware as the outermost layer, so its timing and id cover everything."""
    app.add_middleware(RequestContext, access_log=access_log)
