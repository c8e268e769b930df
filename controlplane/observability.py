"""The control plane's process metrics: HTTP request durations by route template (never the
raw path: ids in paths would explode the series; observed by the edge's `RequestContext`),
long-poll waits, event-loop lag and garbage-collection pauses.

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

# The current request's long-poll wait in seconds, a one-item list set by the edge's
# RequestContext for a request whose query asks to wait (the others pay nothing), filled by
# `long_poll_waited`.
request_long_poll_wait: contextvars.ContextVar[list[float] | None] = contextvars.ContextVar(
    "exitplane_long_poll_waited", default=None)


def long_poll_waited(seconds: float) -> None:
    """Record a long-poll wait: its histogram, and the current request's total (taken out of
    the request's duration)."""
    long_poll_wait.observe(seconds)
    cell = request_long_poll_wait.get()
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
