"""Request ids, access logs and HTTP request metrics for the control plane.

One pure-ASGI middleware per request: it takes the caller's `X-Request-ID` (or makes one),
keeps it in the logging context for every line the request logs and for the Celery tasks it
enqueues, returns it in the response, writes one access-log line and observes the request's
duration by route template (never the raw path: ids in paths would explode the series).

A long-poll's wait (a runtime's pull held until its set changes) is not work: it goes into
`exitplane_config_long_poll_wait_seconds`, and the request's duration counts the rest only, so
the pull route's latency histogram says how fast the API answers, whatever `wait` runtimes ask.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import time

from prometheus_client import Histogram

from controlplane.metrics import registry
from exitplane.kit import tracing
from exitplane.kit.logs import (
    access_log_enabled,
    new_request_id,
    offered_request_id,
    request_id_var,
    write_access_line,
)

# Prometheus' default buckets with a finer start (a 304 pull takes well under a millisecond of
# handler time) and a longer end (a slow store).
http_request_duration = Histogram(
    "exitplane_http_request_duration_seconds",
    "HTTP request duration by route template, less any long-poll wait",
    ["method", "route", "status"], registry=registry,
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
             60.0))

long_poll_wait = Histogram(
    "exitplane_config_long_poll_wait_seconds",
    "Time a runtime's threshold pull was held waiting for its set to change (long-poll)",
    registry=registry,
    buckets=(0.01, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 120.0, 300.0))

# The current request's long-poll wait in seconds, a one-item list set by RequestContext for a
# request whose query asks to wait (the others pay nothing), filled by `long_poll_waited`.
_waited: contextvars.ContextVar[list[float] | None] = contextvars.ContextVar(
    "exitplane_long_poll_waited", default=None)


def long_poll_waited(seconds: float) -> None:
    """Record a long-poll wait: its histogram, and the current request's total (taken out of
    the request's duration)."""
    long_poll_wait.observe(seconds)
    cell = _waited.get()
    if cell is not None:
        cell[0] += seconds


# How late the API's event loop wakes a sleeper: every request the process serves waits at least
# this long; a tail here with fast handlers means the loop (or the CPU) is shared too thinly.
event_loop_lag = Histogram(
    "exitplane_event_loop_lag_seconds", "Delay of the API event loop waking a 250 ms sleeper",
    registry=registry,
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))

LOOP_LAG_PERIOD_S = 0.25


async def watch_loop_lag(period: float = LOOP_LAG_PERIOD_S) -> None:
    """Observe `event_loop_lag` every `period` seconds until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        start = loop.time()
        await asyncio.sleep(period)
        event_loop_lag.observe(max(0.0, loop.time() - start - period))


# The collector stops every thread of the process while it runs: a long pause is a latency
# tail for every request in flight, whatever the handlers cost.
gc_pause = Histogram(
    "exitplane_gc_pause_seconds", "Python garbage collection pauses, by generation",
    ["generation"], registry=registry,
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0))


class _GcTimer:
    """A gc callback timing each collection into `gc_pause`."""

    def __init__(self) -> None:
        self._started = 0.0
        self._children = [gc_pause.labels(str(generation)) for generation in range(3)]

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._children[info["generation"]].observe(time.perf_counter() - self._started)


@contextlib.asynccontextmanager
async def loop_lag_watcher():
    """Run `watch_loop_lag` and time garbage collections for the life of the app (its
    lifespan)."""
    task = asyncio.create_task(watch_loop_lag())
    timer = _GcTimer()
    gc.callbacks.append(timer)
    try:
        yield
    finally:
        gc.callbacks.remove(timer)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


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
            waited_token = _waited.set(waited)
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
                message["headers"] = [*message["headers"],
                                      (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            elapsed = time.perf_counter() - started
            worked = elapsed
            if waited is not None:
                _waited.reset(waited_token)
                worked = max(0.0, elapsed - waited[0])
            route = route_template(scope)
            self._duration(scope["method"], route, status).observe(worked)
            if self.access_log:
                write_access_line(scope, request_id=request_id, route=route, status=status,
                                  elapsed=elapsed, trace_ids=trace_ids)
            request_id_var.reset(token)
