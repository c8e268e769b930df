"""OpenTelemetry, read back through an in-process exporter: one trace spans "alert fired ->
fallback -> recalibration job -> publish", the job crossing from the process that fired the
alert to a Celery worker through the broker (the trace context rides in the task message's
headers; the worker consumes it from the broker like any other); the API's requests and their
SQL queries are spans too. Off by default: nothing is traced without OTEL_* or an exporter."""

from __future__ import annotations

import shutil
from datetime import timedelta

import pytest
from celery.contrib.testing.worker import start_worker
from fastapi.testclient import TestClient
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from controlplane.alerts.service import Condition, fire
from controlplane.db import dispose_engines, make_engine, session_scope, utcnow
from controlplane.deployments.service import get_deployment, move_alias, publish
from controlplane.settings import Settings, get_settings
from exitplane.kit import tracing
from tests.support.calibration import make_deployment, separable_samples, write_traffic
from tests.support.waiting import wait_until


@pytest.fixture(scope="module")
def spans():
    """Tracing on for this module only, into memory."""
    exporter = InMemorySpanExporter()
    assert not tracing.enabled()  # off unless configured
    assert tracing.configure_tracing("exitplane-test", exporter=exporter)
    yield exporter
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor

    CeleryInstrumentor().uninstrument()
    HTTPXClientInstrumentor().uninstrument()
    tracing._state.update(enabled=False, celery=False, httpx=False)


@pytest.fixture
def database(tmp_path, sqlite_template, monkeypatch):
    path = tmp_path / "exitplane.db"
    shutil.copy(sqlite_template, path)
    url = f"sqlite:///{path}"
    for key, value in {"EXITPLANE_DATABASE_URL": url, "EXITPLANE_VAR_DIR": str(tmp_path / "var"),
                       "EXITPLANE_CALIBRATION_MIN_SAMPLES": "500"}.items():
        monkeypatch.setenv(key, value)
    get_settings.cache_clear()
    yield url
    get_settings.cache_clear()
    dispose_engines()


def _chain(span, by_id) -> list[str]:
    names = []
    while span is not None:
        names.append(span.name)
        span = by_id.get(span.parent.span_id) if span.parent else None
    return names


@pytest.mark.slow
def test_alert_fallback_recalibration_and_publish_are_one_trace(spans, database, monkeypatch):
    import controlplane.celery_app
    from controlplane.celery_app import make_celery

    engine = make_engine(database)
    with session_scope(engine) as session:
        deployment = make_deployment(session)
        tuned = publish(session=session, deployment=deployment, thresholds={3: .1, 6: .1, 9: .1},
                        reason="tuned", actor="ops")
        move_alias(session=session, deployment=deployment, alias="active",
                   version=tuned.version, actor="ops", reason="tuned")
    fired_at = utcnow() - timedelta(hours=2)
    signals, matched = separable_samples(3000, seed=6)
    with session_scope(engine) as session:  # shadow samples of the traffic after the alert
        write_traffic(session, "chat", signals, matched, start=utcnow() - timedelta(hours=1))

    # A broker of this test's own; the services' outbox sends through it.
    app = make_celery(Settings(database_url=database))
    app.conf.update(broker_url="memory://", result_backend="cache+memory://")
    monkeypatch.setattr(controlplane.celery_app, "app", app)
    spans.clear()
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=30):
        with trace.get_tracer("test").start_as_current_span("drift.detect") as root, \
                session_scope(engine) as session:  # what the beat-scheduled check does
            fire(session=session, deployment=get_deployment(session=session, name="chat"),
                 now=fired_at, condition=Condition(
                     kind="quality_regression", severity="critical",
                     summary="disagreement above δ", evidence={"disagreement_rate": 0.3}))
        trace_id = root.get_span_context().trace_id
        published = wait_until(lambda: [
            s for s in spans.get_finished_spans() if s.name == "thresholds.publish"
            and s.context.trace_id == trace_id and "run/calibration.run" in _chain(
                s, {x.context.span_id: x for x in spans.get_finished_spans()})], 120,
            "the worker to publish the recalibrated set in the alert's trace")
    engine.dispose()

    by_id = {s.context.span_id: s for s in spans.get_finished_spans()}
    chain = _chain(published[0], by_id)
    # publish <- (worker) run task <- (broker) send task <- fallback <- alert fired <- check
    assert chain[-1] == "drift.detect"
    ordered = [name for name in chain if name in {
        "thresholds.publish", "run/calibration.run", "apply_async/calibration.run", "fallback",
        "alert.fired", "drift.detect"}]
    assert ordered == ["thresholds.publish", "run/calibration.run",
                       "apply_async/calibration.run", "fallback", "alert.fired", "drift.detect"]
    run_span = next(s for s in by_id.values() if s.name == "run/calibration.run"
                    and s.context.trace_id == trace_id)
    send_span = by_id[run_span.parent.span_id]
    assert send_span.kind == trace.SpanKind.PRODUCER and run_span.kind == trace.SpanKind.CONSUMER
    print("trace", format(trace_id, "032x"), " <- ".join(chain))


def test_api_requests_and_their_queries_are_spans(spans, database):
    from exitplane.app import create_app

    engine = make_engine(database)
    with session_scope(engine) as session:
        make_deployment(session, name="traced")
    app = create_app(Settings(database_url=database), engine=engine)
    spans.clear()
    with TestClient(app) as client:
        from controlplane.auth.service import create_token

        with session_scope(engine) as session:
            _, secret = create_token(session=session, name="t", scope="operator")
        assert client.get("/v1/deployments/traced", headers={
            "Authorization": f"Bearer {secret}"}).status_code == 200
    app.state.config_delivery.close()
    engine.dispose()
    finished = spans.get_finished_spans()
    [server] = [s for s in finished if s.kind == trace.SpanKind.SERVER]
    assert server.name == "GET /v1/deployments/{name}"
    queries = [s for s in finished if s.attributes.get("db.system") == "sqlite"
               and s.context.trace_id == server.context.trace_id]
    assert queries, [s.name for s in finished]


def test_the_api_access_line_carries_its_request_span_ids(spans, database, caplog):
    """The access line is written outside the request's span (after it ended) and still names
    it, as the runtime server's lines do."""
    from exitplane.app import create_app

    engine = make_engine(database)
    with session_scope(engine) as session:
        make_deployment(session, name="traced")
    app = create_app(Settings(database_url=database, access_log=True), engine=engine)
    spans.clear()
    with TestClient(app) as client, caplog.at_level("INFO", logger="exitplane.access"):
        answer = client.get("/v1/deployments/traced", headers={"X-Request-ID": "traced-1"})
    app.state.config_delivery.close()
    engine.dispose()
    assert answer.status_code == 401  # no token: the span and the line exist all the same
    [server] = [s for s in spans.get_finished_spans() if s.kind == trace.SpanKind.SERVER]
    [line] = [r for r in caplog.records if r.name == "exitplane.access"]
    assert (line.request_id, line.status, line.route) == ("traced-1", 401,
                                                           "/v1/deployments/{name}")
    assert line.trace_id == format(server.context.trace_id, "032x")
    assert line.span_id == format(server.context.span_id, "016x")


def test_fast_path_requests_are_spans_named_by_their_route(spans, database):
    """Telemetry POSTs and heartbeats, served below the router, are server spans
    named as the routes were, with the heartbeat's queries in their trace."""
    from controlplane.auth.service import create_token
    from exitplane.app import create_app

    engine = make_engine(database)
    with session_scope(engine) as session:
        deployment = make_deployment(session, name="traced")
        _, secret = create_token(session=session, name="rt", scope="runtime",
                                 deployment=deployment)
    app = create_app(Settings(database_url=database), engine=engine)
    spans.clear()
    runtime = {"Authorization": f"Bearer {secret}"}
    with TestClient(app) as client:
        assert client.post("/v1/deployments/traced/heartbeats", headers=runtime,
                           json={"runtime_id": "rt-1"}).status_code == 200
        assert client.post("/v1/telemetry", headers=runtime,
                           json={"records": "nope"}).status_code == 422
    app.state.config_delivery.close()
    engine.dispose()
    finished = spans.get_finished_spans()
    servers = {s.name: s for s in finished if s.kind == trace.SpanKind.SERVER}
    assert set(servers) == {"POST /v1/deployments/{name}/heartbeats", "POST /v1/telemetry"}
    beat = servers["POST /v1/deployments/{name}/heartbeats"]
    assert beat.attributes.get("http.status_code", beat.attributes.get(
        "http.response.status_code")) == 200
    assert [s for s in finished if s.attributes.get("db.system") == "sqlite"
            and s.context.trace_id == beat.context.trace_id]


# -- the SDK's environment handling, in fresh processes (the tracer provider is set once) ----

PROBE = """
import json, logging
from opentelemetry import trace
from exitplane.kit import tracing
from exitplane.kit.logs import configure_logging
configure_logging("probe", fmt="json")
on = tracing.configure_tracing("exitplane-probe")
provider = trace.get_tracer_provider()
processors = getattr(getattr(provider, "_active_span_processor", None), "_span_processors", ())
with tracing.span("probe.step"):
    logging.getLogger("probe").info("inside")
print(json.dumps({"on": on, "exporters": [type(p.span_exporter).__module__ + "."
                  + type(p.span_exporter).__name__ for p in processors],
                  "service": getattr(provider, "resource", None) and
                  provider.resource.attributes.get("service.name"),
                  "sampler": getattr(provider, "sampler", None) and
                  provider.sampler.get_description()}))
"""


def _probe(**otel) -> tuple[dict, list[dict]]:
    """Run PROBE with these OTEL_* variables; (its summary, every other stdout line)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "EXITPLANE_LOG"))}
    done = subprocess.run([sys.executable, "-c", PROBE], env={**env, **otel}, text=True,
                          capture_output=True, timeout=60, check=True)
    lines = [json.loads(line) for line in done.stdout.splitlines()]  # every line is JSON
    [summary] = [line for line in lines if "exporters" in line]
    return summary, [line for line in lines if line is not summary]


@pytest.mark.slow
def test_the_console_exporter_prints_spans_and_log_lines_carry_their_ids():
    summary, lines = _probe(OTEL_TRACES_EXPORTER="console")
    assert summary["on"] and summary["service"] == "exitplane-probe"
    assert summary["exporters"] == ["opentelemetry.sdk.trace.export.ConsoleSpanExporter"]
    [log_line] = [line for line in lines if line.get("message") == "inside"]
    [span] = [line for line in lines if line.get("name") == "probe.step"]
    assert log_line["trace_id"] == span["context"]["trace_id"].removeprefix("0x")
    assert log_line["span_id"] == span["context"]["span_id"].removeprefix("0x")


@pytest.mark.slow
@pytest.mark.parametrize("protocol, module", [
    ("grpc", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter.OTLPSpanExporter"),
    ("http/protobuf", "opentelemetry.exporter.otlp.proto.http.trace_exporter.OTLPSpanExporter")])
def test_otlp_takes_the_protocol_from_the_environment(protocol, module):
    summary, _ = _probe(OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_PROTOCOL=protocol,
                        OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9",
                        OTEL_BSP_EXPORT_TIMEOUT="1", OTEL_EXPORTER_OTLP_TIMEOUT="1")
    assert summary["exporters"] == [module]


@pytest.mark.slow
def test_resource_attributes_and_sampler_come_from_the_environment():
    summary, lines = _probe(OTEL_TRACES_EXPORTER="console",
                            OTEL_RESOURCE_ATTRIBUTES="service.name=from-env,team=ops",
                            OTEL_TRACES_SAMPLER="always_off")
    assert summary["service"] == "from-env"
    assert summary["sampler"] == "AlwaysOffSampler"
    assert not [line for line in lines if "context" in line]  # nothing sampled, nothing printed
    assert "trace_id" not in next(line for line in lines if line.get("message") == "inside")
    named, _ = _probe(OTEL_TRACES_EXPORTER="console", OTEL_SERVICE_NAME="by-name")
    assert named["service"] == "by-name"


@pytest.mark.slow
def test_none_or_nothing_leaves_tracing_off_and_a_bad_exporter_says_why():
    assert _probe(OTEL_TRACES_EXPORTER="none")[0]["on"] is False
    assert _probe()[0]["on"] is False
    summary, lines = _probe(OTEL_TRACES_EXPORTER="zipkin-but-not-installed")
    assert summary["on"] is False
    assert any("OTEL_TRACES_EXPORTER takes console, otlp or none" in line["message"]
               for line in lines if "message" in line)
