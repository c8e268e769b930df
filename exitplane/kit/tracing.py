"""OpenTelemetry traces, optional (`pip install 'exitplane[otel]'`) and off unless configured.

The SDK's own configurator reads the standard variables, as `opentelemetry-instrument` would:
`OTEL_TRACES_EXPORTER` (`console`, `otlp`, `none`, several comma-separated),
`OTEL_EXPORTER_OTLP_PROTOCOL` (`grpc` or `http/protobuf`) with `OTEL_EXPORTER_OTLP_ENDPOINT`,
`OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES` (a `service.name` there wins over the
process's default name, `exitplane-api`, `exitplane-worker` ...), `OTEL_TRACES_SAMPLER` and
`OTEL_TRACES_SAMPLER_ARG`, `OTEL_BSP_*`. Tracing starts when `OTEL_TRACES_EXPORTER` names an
exporter, or when only an OTLP endpoint is set (then the exporter is `otlp`).

FastAPI, SQLAlchemy, httpx and Celery are instrumented; Celery carries the trace context in
the task message headers, so "alert fired -> fallback -> recalibration job -> publish" is one
trace across the process that fired the alert and the worker that recalibrates. The domain
steps open their own spans through `span()`, a flag check without tracing.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator

log = logging.getLogger("exitplane.tracing")
_state = {"enabled": False, "celery": False, "httpx": False}
OTLP_ENDPOINTS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def wanted() -> bool:
    """Whether the environment asks for traces (the standard OTEL_* variables)."""
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    return bool(exporter or any(os.environ.get(name) for name in OTLP_ENDPOINTS))


def enabled() -> bool:
    return _state["enabled"]


def configure_tracing(service_name: str, *, exporter=None) -> bool:
    """Install the tracer provider once per process through the SDK's configurator, and
    instrument httpx and Celery. `service_name` applies unless `OTEL_SERVICE_NAME` or
    `OTEL_RESOURCE_ATTRIBUTES` names the service; `exporter` (tests) receives each span as it
    ends, besides what the environment configures. Returns whether tracing is on."""
    if _state["enabled"]:
        return True
    if exporter is None and not wanted():
        return False
    try:
        from opentelemetry.sdk._configuration import _OTelSDKConfigurator
        from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
    except ImportError:
        log.warning("OTEL_* is set but OpenTelemetry is not installed: pip install "
                    "'exitplane[otel]'; tracing stays off")
        return False
    # Resource.create lets the attributes given here win over the environment's: the default
    # name is given only where the environment names no service.
    named = OTELResourceDetector().detect().attributes.get(SERVICE_NAME)
    exporter_names = []
    if not os.environ.get("OTEL_TRACES_EXPORTER", "").strip() and any(
            os.environ.get(name) for name in OTLP_ENDPOINTS):
        exporter_names = ["otlp"]  # an endpoint alone means OTLP, the specification's default
    try:
        _OTelSDKConfigurator().configure(
            trace_exporter_names=exporter_names,
            resource_attributes={} if named else {SERVICE_NAME: service_name},
            # one span a line on stdout, beside the JSON log lines, not an indented block
            exporter_args_map={ConsoleSpanExporter: {"formatter": _one_line}},
            span_processors=[SimpleSpanProcessor(exporter)] if exporter is not None else None)
    except RuntimeError as error:  # an exporter or protocol the installed packages lack
        log.error("OpenTelemetry is misconfigured (%s); tracing stays off. OTEL_TRACES_EXPORTER "
                  "takes console, otlp or none; OTEL_EXPORTER_OTLP_PROTOCOL grpc or "
                  "http/protobuf", error)
        return False
    _state["enabled"] = True
    _instrument_clients()
    return True


def _one_line(span) -> str:
    return span.to_json(indent=None) + "\n"


def _instrument_clients() -> None:
    with contextlib.suppress(ImportError):
        if not _state["httpx"]:
            from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor

            HTTPXClientInstrumentor().instrument()
            _state["httpx"] = True
    with contextlib.suppress(ImportError):
        if not _state["celery"]:
            from opentelemetry.instrumentation.celery import CeleryInstrumentor

            CeleryInstrumentor().instrument()
            _state["celery"] = True


def instrument_app(app, engine=None) -> None:
    """One server span per request of a FastAPI app (probes and scrapes left out), and
    SQLAlchemy query spans for its engine (no-op when off). The ASGI send and receive spans
    are left out: a streamed answer would add one per token."""
    if not _state["enabled"]:
        return
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    FastAPIInstrumentor.instrument_app(app, excluded_urls="healthz,readyz,metrics",
                                       exclude_spans=["send", "receive"])
    if engine is not None:
        instrument_engine(engine)


def instrument_engine(engine) -> None:
    """SQLAlchemy query spans for a worker's engine (no-op when off)."""
    if not _state["enabled"]:
        return
    from opentelemetry.instrumentation.sqlalchemy import SQLAlchemyInstrumentor

    # Its declared range stops below SQLAlchemy 2.1, whose engine events it uses unchanged
    # (tests/observability/test_tracing.py shows the query spans).
    SQLAlchemyInstrumentor().instrument(engine=engine, skip_dep_check=True)


@contextlib.contextmanager
def span(name: str, **attributes) -> Iterator[None]:
    """A span around a domain step (alert.fire, fallback, calibration.run, thresholds.publish)."""
    if not _state["enabled"]:
        yield
        return
    from opentelemetry import trace

    with trace.get_tracer("exitplane").start_as_current_span(name) as current:
        for key, value in attributes.items():
            if value is not None:
                current.set_attribute(f"exitplane.{key}", value)
        yield


def traced(name: str) -> Callable:
    """Decorate a domain function with a span of its own (only a flag check when off)."""
    def decorate(function: Callable) -> Callable:
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            if not _state["enabled"]:
                return function(*args, **kwargs)
            with span(name):
                return function(*args, **kwargs)
        return wrapper
    return decorate


def current_ids() -> tuple[str, str] | None:
    """(trace id, span id) in hex of the active span; None without one, or when its trace is
    not sampled (no exporter receives it, so a log line would point at nothing)."""
    if not _state["enabled"]:
        return None
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    if not (context.is_valid and context.trace_flags.sampled):
        return None
    return format(context.trace_id, "032x"), format(context.span_id, "016x")


def annotate(**attributes) -> None:
    """Set `exitplane.<key>` attributes on the active span (only a flag check when off)."""
    if not _state["enabled"]:
        return
    from opentelemetry import trace

    current = trace.get_current_span()
    for key, value in attributes.items():
        if value is not None:
            current.set_attribute(f"exitplane.{key}", value)


def current_context():
    """The active trace context (None when off), to resume later with `attached`."""
    if not _state["enabled"]:
        return None
    from opentelemetry import context

    return context.get_current()


@contextlib.contextmanager
def attached(saved) -> Iterator[None]:
    """Run with a context captured earlier: a task sent after commit stays a child of the step
    that asked for it (the fallback), not of whatever happens to be committing."""
    if saved is None:
        yield
        return
    from opentelemetry import context

    token = context.attach(saved)
    try:
        yield
    finally:
        context.detach(token)
