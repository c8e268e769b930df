"""OpenTelemetry traces, optional (`pip install 'exitplane[otel]'`) and off unless configured.

Configured by the standard variables only: tracing starts when `OTEL_EXPORTER_OTLP_ENDPOINT`,
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_TRACES_EXPORTER` (not `none`) is set;
`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER` ... are read by the SDK
itself. FastAPI, SQLAlchemy, httpx and Celery are instrumented; Celery carries the trace
context in the task message headers, so "alert fired -> fallback -> recalibration job ->
publish" is one trace across the process that fired the alert and the worker that recalibrates.
The domain steps open their own spans through `span()`, a no-op without the SDK.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator

log = logging.getLogger("exitplane.tracing")
_state = {"enabled": False, "celery": False, "httpx": False}


def wanted() -> bool:
    """Whether the environment asks for traces (the standard OTEL_* variables)."""
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    return bool(exporter or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def enabled() -> bool:
    return _state["enabled"]


def configure_tracing(service_name: str, *, exporter=None) -> bool:
    """Install the SDK's tracer provider (OTLP over HTTP, or `exporter` for tests) once per
    process, and instrument httpx and Celery. Returns whether tracing is on."""
    if _state["enabled"]:
        return True
    if exporter is None and not wanted():
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError:
        log.warning("OTEL_* is set but OpenTelemetry is not installed: pip install "
                    "'exitplane[otel]'; tracing stays off")
        return False
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME",
                                                               service_name)})
    provider = TracerProvider(resource=resource)
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    else:  # tests read spans as they end
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _state["enabled"] = True
    _instrument_clients()
    return True


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


def instrument_app(app, engine) -> None:
    """FastAPI server spans and SQLAlchemy query spans for one app (no-op when off)."""
    if not _state["enabled"]:
        return
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    FastAPIInstrumentor.instrument_app(app, excluded_urls="healthz,readyz,metrics")
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
