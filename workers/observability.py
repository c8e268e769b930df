"""Logs and metrics of the Celery processes, wired through Celery's signals.

- Logging: Celery's own setup is replaced by `exitplane.kit.logs.configure_logging`, so worker and
  beat lines have the API's shape.
- Request ids: a task published while a request (or another task) is being handled carries
  its id in the message headers (`controlplane.celery_app`, the publishing side); the worker
  puts it back into the logging context for the task's lines, and passes it on to the tasks
  that task enqueues.
- Metrics: task duration by task name and outcome, and failures by task name (a series at 0
  per registered task from the start), with the process and build-info collectors, in a
  registry of this process served on `EXITPLANE_WORKER_METRICS_PORT` (one worker process per
  container with the default solo pool, so one scrape target each; no multiprocess directory
  needed). Beat serves the same registry on that port (its process and build info; it runs no
  tasks).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys
import time

from celery import signals
from prometheus_client import CollectorRegistry, Counter, Histogram

from controlplane.celery_app import REQUEST_ID_HEADER as HEADER
from exitplane.kit.build import register_process_metrics
from exitplane.kit.logs import configure_logging, log_format, request_id_var, rfc3339

log = logging.getLogger("exitplane.worker")

registry = CollectorRegistry()
register_process_metrics(registry)
task_duration = Histogram(
    "exitplane_worker_task_duration_seconds", "Celery task run time by task name and outcome",
    ["task", "state"], registry=registry,
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0))
task_failures = Counter("exitplane_worker_task_failures", "Celery tasks that raised, by name",
                        ["task"], registry=registry)
_started: dict[str, tuple[float, object]] = {}


@signals.setup_logging.connect
def _setup_logging(loglevel=None, **_kwargs) -> None:
    from controlplane.settings import get_settings

    settings = get_settings()
    level = loglevel if isinstance(loglevel, str) else (
        logging.getLevelName(loglevel) if loglevel else settings.log_level)
    role = "beat" if "beat" in sys.argv else "worker"
    configure_logging(role, level=str(level), fmt=settings.log_format,
                      environment=settings.environment)
    if log_format(settings.environment, settings.log_format) == "json":
        import celery.apps.worker

        celery.apps.worker.safe_say = functools.partial(_say_as_json, role)


def _say_as_json(role: str, message: str, stream=None) -> None:
    """Celery's signal-handler messages ("worker: Warm shutdown") as a JSON line on stdout.
    Written with one os.write, as Celery does, since a signal handler must not take the
    logging locks."""
    line = json.dumps({"time": rfc3339(time.time()), "level": "WARNING",
                       "logger": "celery.apps.worker", "message": message.strip(),
                       "process_name": role})
    with contextlib.suppress(OSError):
        os.write(sys.__stdout__.fileno(), f"{line}\n".encode())


@signals.task_prerun.connect
def _task_started(task_id=None, task=None, **_kwargs) -> None:
    request_id = getattr(task.request, HEADER, None) if task is not None else None
    token = request_id_var.set(request_id or f"task-{task_id}")
    _started[task_id] = (time.perf_counter(), token)
    log.info("task %s[%s] started", getattr(task, "name", "?"), task_id,
             extra={"task": getattr(task, "name", None), "task_id": task_id})


@signals.task_postrun.connect
def _task_finished(task_id=None, task=None, state=None, **_kwargs) -> None:
    started, token = _started.pop(task_id, (None, None))
    if started is not None:
        elapsed = time.perf_counter() - started
        name = getattr(task, "name", "unknown")
        task_duration.labels(name, state or "UNKNOWN").observe(elapsed)
        log.info("task %s[%s] %s in %.3fs", name, task_id, state, elapsed,
                 extra={"task": name, "task_id": task_id, "state": state,
                        "duration_ms": round(elapsed * 1000, 2)})
    if token is not None:
        # postrun in another context than prerun has nothing to undo
        with contextlib.suppress(ValueError):
            request_id_var.reset(token)


@signals.task_failure.connect
def _task_failed(sender=None, **_kwargs) -> None:
    task_failures.labels(getattr(sender, "name", "unknown")).inc()


@signals.worker_init.connect
def _start_tracing(**_kwargs) -> None:
    from controlplane.db import get_engine
    from controlplane.settings import get_settings
    from exitplane.kit.tracing import configure_tracing, instrument_engine

    if configure_tracing("exitplane-worker"):
        instrument_engine(get_engine(get_settings().effective_database_url))


@signals.beat_init.connect
def _start_beat_tracing(**_kwargs) -> None:
    """Beat's scheduled sends are producer spans (the Celery instrumentation's
    `apply_async/<task>`), each the root of the trace its task continues in a worker."""
    from exitplane.kit.tracing import configure_tracing

    configure_tracing("exitplane-beat")


@signals.worker_init.connect
def _serve_metrics(sender=None, **_kwargs) -> None:
    from prometheus_client import start_http_server

    from controlplane.settings import get_settings

    app = getattr(sender, "app", None)
    for name in getattr(app, "tasks", {}):
        if not name.startswith("celery."):
            task_failures.labels(name)  # a zero series per task, so rate() has a baseline
    port = get_settings().worker_metrics_port
    if port:
        start_http_server(port, registry=registry)
        log.info("worker metrics on :%d/metrics", port)


@signals.beat_init.connect
def _serve_beat_metrics(**_kwargs) -> None:
    from prometheus_client import start_http_server

    from controlplane.settings import get_settings

    port = get_settings().worker_metrics_port
    if port:
        try:
            start_http_server(port, registry=registry)
        except OSError as error:  # a worker on this host (`exitplane up`) serves that port
            log.warning("beat metrics not served on :%d (%s)", port, error)
            return
        log.info("beat metrics on :%d/metrics", port)
