"""One logging setup for every exitplane process (API, ingest, worker, beat, runtime, CLI).

`EXITPLANE_LOG_FORMAT=json|text` (JSON by default in production, text in the embedded default)
and `EXITPLANE_LOG_LEVEL` decide the output; one stdout handler on the root logger carries every
library's lines (uvicorn, Celery, SQLAlchemy warnings) in the same shape, one JSON object a line
in JSON mode, each with an RFC 3339 time in UTC. The request id of the HTTP request or Celery
task being handled rides in a context variable and is stamped on every line, so one request's
lines can be found across the API and the workers; while an OpenTelemetry span is active its
trace and span ids are stamped too. `RequestLog` is the ASGI middleware that takes
`X-Request-ID` (or makes one), echoes it and writes the access line.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import TextIO

from exitplane.kit import tracing

request_id_var: ContextVar[str | None] = ContextVar("exitplane_request_id", default=None)

# What a caller may send as X-Request-ID: short, printable, no separators a log parser trips on.
_VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(process_name)s rid=%(request_id)s] %(message)s"
JSON_FIELDS = "%(asctime)s %(levelname)s %(name)s %(message)s"


def new_request_id(offered: str | None = None) -> str:
    """The caller's id when it is a sane token, else a fresh one."""
    if offered and _VALID_REQUEST_ID.match(offered):
        return offered
    return os.urandom(16).hex()  # 128 random bits as 32 hex digits, a sixth of uuid4's cost


def rfc3339(created: float) -> str:
    """A record's time as RFC 3339 in UTC with milliseconds: 2026-12-03T13:28:25.123Z."""
    return datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds")[:-6] + "Z"


class ContextFilter(logging.Filter):
    """Stamps the current request id, the process role and, while a span is active, the trace
    and span ids on each record."""

    def __init__(self, process_name: str) -> None:
        super().__init__()
        self.process_name = process_name

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        record.process_name = self.process_name
        record.__dict__.pop("color_message", None)  # uvicorn's ANSI copy of the message
        if tracing.enabled():
            ids = tracing.current_ids()
            if ids is not None:
                record.trace_id, record.span_id = ids
        return True


def log_format(environment: str | None = None, explicit: str | None = None) -> str:
    """json or text: EXITPLANE_LOG_FORMAT, else JSON in production and text elsewhere."""
    chosen = (explicit or os.environ.get("EXITPLANE_LOG_FORMAT") or "").strip().lower()
    if not chosen:
        environment = environment or os.environ.get("EXITPLANE_ENVIRONMENT", "embedded")
        chosen = "json" if environment == "production" else "text"
    if chosen not in ("json", "text"):
        raise ValueError(f"EXITPLANE_LOG_FORMAT must be json or text, not {chosen!r}")
    return chosen


def access_log_enabled(environment: str | None = None) -> bool:
    """EXITPLANE_ACCESS_LOG=1/0, else on in production (operators expect one line a request)."""
    value = os.environ.get("EXITPLANE_ACCESS_LOG", "").strip().lower()
    if value:
        return value in ("1", "true", "yes", "on")
    return (environment or os.environ.get("EXITPLANE_ENVIRONMENT", "embedded")) == "production"


class _TextFormatter(logging.Formatter):
    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return rfc3339(record.created)


def make_formatter(fmt: str) -> logging.Formatter:
    """The JSON (one object a line) or text formatter, both with RFC 3339 UTC times."""
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter

        class _JsonFormatter(JsonFormatter):
            def formatTime(self, record, datefmt=None):
                return rfc3339(record.created)

        return _JsonFormatter(JSON_FIELDS, rename_fields={"levelname": "level",
                                                          "name": "logger", "asctime": "time"},
                              timestamp=False)
    return _TextFormatter(TEXT_FORMAT)


def configure_logging(process_name: str, *, level: str | None = None, fmt: str | None = None,
                      environment: str | None = None, stream: TextIO | None = None) -> None:
    """Install the one handler on the root logger (idempotent: replaces an earlier one): on
    stdout for the services; a one-shot command whose stdout is its answer passes stderr."""
    level_name = (level or os.environ.get("EXITPLANE_LOG_LEVEL") or "info").upper()
    handler = logging.StreamHandler(stream or sys.stdout)
    handler.setFormatter(make_formatter(log_format(environment, fmt)))
    handler.addFilter(ContextFilter(process_name))
    handler._exitplane = True  # type: ignore[attr-defined]  # ours, to be replaced on re-entry
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_exitplane", False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level_name)
    logging.captureWarnings(True)  # Python warnings as log lines (py.warnings), not raw stderr
    # Libraries that install their own handlers would print each line twice or in their shape.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "celery", "celery.task"):
        library = logging.getLogger(name)
        library.handlers.clear()
        library.propagate = True
    # Per-connection chatter stays at warning even when the service runs at debug.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))


access_log = logging.getLogger("exitplane.access")


def write_access_line(scope: dict, *, request_id: str, route: str, status: int,
                      elapsed: float, trace_ids: tuple[str, str] | None = None) -> None:
    """The one access-log line of an HTTP request (request id, method, path, route template,
    status, duration, client address), logged by `exitplane.access`. `trace_ids`: the
    request's (trace id, span id), for a line written after its span ended (the line of a
    request still in its span gets them from `ContextFilter`)."""
    extra = {"request_id": request_id, "method": scope["method"], "path": scope["path"],
             "route": route, "status": status, "duration_ms": round(elapsed * 1000, 2),
             "client": (scope.get("client") or ("", 0))[0]}
    if trace_ids is not None:
        extra["trace_id"], extra["span_id"] = trace_ids
    access_log.info("%s %s %s %.1fms", scope["method"], scope["path"], status, elapsed * 1000,
                    extra=extra)


def offered_request_id(scope: dict) -> str | None:
    """The X-Request-ID header of an ASGI request, as sent."""
    return next((value.decode("latin-1") for name, value in scope["headers"]
                 if name == b"x-request-id"), None)


class RequestLog:
    """ASGI middleware: X-Request-ID in (a sane caller's id, else a fresh one) and out, the id
    in the logging context while the request runs, and one access line when it ends (streamed
    answers: when the stream ends)."""

    def __init__(self, app, *, access_log: bool | None = None) -> None:
        self.app = app
        self.access_log = access_log_enabled() if access_log is None else access_log

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_request_id(offered_request_id(scope))
        header = (b"x-request-id", request_id.encode())
        token = request_id_var.set(request_id)
        started = time.perf_counter()
        status = 500

        async def send_with_id(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if self.access_log:
                route = getattr(scope.get("route"), "path", None) or "unmatched"
                write_access_line(scope, request_id=request_id, route=route, status=status,
                                  elapsed=time.perf_counter() - started)
            request_id_var.reset(token)
