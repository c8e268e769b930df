"""The front door of the API: what sees every HTTP request before FastAPI's own layers do
(`ControlPlaneAPI.front`), and the request context there: X-Request-ID in and out (kept in the
logging context for every line the request logs and for the Celery tasks it enqueues), one
access line and one duration sample per request."""

from __future__ import annotations

import time

from fastapi import FastAPI

from controlplane.observability import (
    http_request_duration,
    request_long_poll_wait,
    route_template,
)
from controlplane.request_models import ignored_fields, ignored_header
from exitplane.kit import tracing
from exitplane.kit.logs import (
    access_log_enabled,
    new_request_id,
    offered_request_id,
    request_id_var,
    write_access_line,
)

_WITH_BODY = frozenset({"POST", "PUT", "PATCH", "DELETE"})


class ControlPlaneAPI(FastAPI):
    """The FastAPI app behind a front door: `front` (set by `create_api`) sees each HTTP request
    before FastAPI's and Starlette's own layers do: the request context (id, access line,
    duration), then the config pull's fast path, then `behind_front` (FastAPI as usual). A 304
    answered at the door skips those layers, about a tenth of what the pull costs the
    process. While no access line is written, a plain 304 pull (no `wait`) is answered before
    the request context, which the fast path stands in for (request id, duration)."""

    front = None

    async def __call__(self, scope, receive, send) -> None:
        if self.front is None or scope["type"] == "lifespan":
            await super().__call__(scope, receive, send)
        else:
            await self.front(scope, receive, send)

    async def behind_front(self, scope, receive, send) -> None:
        """The app without its front door."""
        await super().__call__(scope, receive, send)


class RequestContext:
    """X-Request-ID in and out, one access line and one duration sample per HTTP request; for a
    request with a body, the unknown fields its body models ignored, named in the
    `Exitplane-Ignored-Fields` answer header (`controlplane.request_models`)."""

    def __init__(self, app, *, access_log: bool | None = None) -> None:
        self.app = app
        self.access_log = access_log_enabled() if access_log is None else access_log
        # The request's span (FastAPI's, inside this layer) has ended when the access line is
        # written: its ids are taken as the answer starts, and only when both are on.
        self._trace_access = self.access_log and tracing.enabled()
        # (method, route template, status) -> its histogram child: one dict lookup per
        # request instead of `labels()` (the label set is bounded by routes x statuses).
        self._durations: dict[tuple[str, str, int], object] = {}

    def _duration(self, method: str, route: str, status: int):
        key = (method, route, status)
        child = self._durations.get(key)
        if child is None:
            child = http_request_duration.labels(method, route, str(status))
            if len(self._durations) < 4096:  # a client sending odd methods cannot grow it
                self._durations[key] = child
        return child

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_request_id(offered_request_id(scope))
        token = request_id_var.set(request_id)
        waited = waited_token = None
        if b"wait=" in scope.get("query_string", b""):  # a long-poll: its wait is not its duration
            waited = [0.0]
            waited_token = request_long_poll_wait.set(waited)
        noted = noted_token = None
        if scope["method"] in _WITH_BODY:
            noted = []
            noted_token = ignored_fields.set(noted)
        started = time.perf_counter()
        status = 500
        trace_ids = None

        async def send_with_id(message) -> None:
            nonlocal status, trace_ids
            if message["type"] == "http.response.start":
                status = message["status"]
                if self._trace_access:
                    trace_ids = tracing.current_ids()
                message.setdefault("headers", [])
                extra = [(b"x-request-id", request_id.encode())]
                if noted and (header := ignored_header(noted)) is not None:
                    extra.append(header)
                message["headers"] = [*message["headers"], *extra]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            elapsed = time.perf_counter() - started
            worked = elapsed
            if waited is not None:
                request_long_poll_wait.reset(waited_token)
                worked = max(0.0, elapsed - waited[0])
            route = route_template(scope)
            self._duration(scope["method"], route, status).observe(worked)
            if self.access_log:
                write_access_line(scope, request_id=request_id, route=route, status=status,
                                  elapsed=elapsed, trace_ids=trace_ids)
            request_id_var.reset(token)
            if noted_token is not None:
                ignored_fields.reset(noted_token)
