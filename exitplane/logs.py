"""One logging setup for every exitplane process (API, ingest, worker, beat, runtime, CLI).

`EXITPLANE_LOG_FORMAT=json|text` (JSON by default in production, text in the embedded default)
and `EXITPLANE_LOG_LEVEL` decide the output; one stderr handler on the root logger carries every
library's lines (uvicorn, Celery, SQLAlchemy warnings) in the same shape. The request id of the
HTTP request or Celery task being handled rides in a context variable and is stamped on every
line, so one request's lines can be found across the API and the workers.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from contextvars import ContextVar

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


class ContextFilter(logging.Filter):
    """Stamps the current request id and the process role on each record."""

    def __init__(self, process_name: str) -> None:
        super().__init__()
        self.process_name = process_name

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        record.process_name = self.process_name
        record.__dict__.pop("color_message", None)  # uvicorn's ANSI copy of the message
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


def make_formatter(fmt: str) -> logging.Formatter:
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter

        return JsonFormatter(JSON_FIELDS, rename_fields={"levelname": "level", "name": "logger",
                                                         "asctime": "time"},
                             timestamp=False)
    return logging.Formatter(TEXT_FORMAT)


def configure_logging(process_name: str, *, level: str | None = None, fmt: str | None = None,
                      environment: str | None = None) -> None:
    """Install the one stderr handler on the root logger (idempotent: replaces an earlier one)."""
    level_name = (level or os.environ.get("EXITPLANE_LOG_LEVEL") or "info").upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(make_formatter(log_format(environment, fmt)))
    handler.addFilter(ContextFilter(process_name))
    handler._exitplane = True  # type: ignore[attr-defined]  # ours, to be replaced on re-entry
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_exitplane", False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level_name)
    # Libraries that install their own handlers would print each line twice or in their shape.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "celery", "celery.task"):
        library = logging.getLogger(name)
        library.handlers.clear()
        library.propagate = True
    # Per-connection chatter stays at warning even when the service runs at debug.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))
