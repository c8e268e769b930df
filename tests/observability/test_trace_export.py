"""OpenTelemetry configured by the SDK's own environment handling, seen from the outside: the
production processes (API, ingest worker, Celery worker, beat, runtime server on the tiny
model), each its own process with `OTEL_TRACES_EXPORTER=console`, print their spans on stdout
between their JSON log lines; a beat send and the worker's run of it are one trace; the
runtime's request span carries time to first token, exit layers and threshold version, and its
log lines the span's ids. The exporter, protocol, resource and sampler variables are read as
the SDK reads them."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import httpx
import pytest
import redis

from tests.support.network import free_port
from tests.support.processes import (
    EXITPLANE,
    answers,
    print_tails,
    provision_chat,
    spawn,
    stop_processes,
)
from tests.support.services import POSTGRES_URL, REDIS_URL, empty_postgres
from tests.support.waiting import wait_until

PROCESSES = ("api", "ingest", "worker", "beat", "runtime")


def _lines(path: Path) -> list[dict]:
    """Every stdout line as JSON (a line that is not fails the test)."""
    out = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pytest.fail(f"{path.name}:{number} is not JSON: {line[:300]}")
    return out


def _spans(path: Path) -> list[dict]:
    return [line for line in _lines(path) if "context" in line and "resource" in line]


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.redis
def test_every_process_prints_its_spans_with_the_console_exporter(postgres_migrated, tmp_path):
    if not (POSTGRES_URL and REDIS_URL):
        raise RuntimeError("set EXITPLANE_TEST_POSTGRES_URL and EXITPLANE_TEST_REDIS_URL")
    empty_postgres(postgres_migrated)
    redis_url = REDIS_URL.rsplit("/", 1)[0] + "/14"  # a database of this test's own
    redis.Redis.from_url(redis_url).flushdb()
    port, runtime_port = free_port(), free_port()
    api = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EXITPLANE_", "OTEL_"))}
    env.update({"EXITPLANE_ENVIRONMENT": "production", "EXITPLANE_DATABASE_URL": postgres_migrated,
                "EXITPLANE_REDIS_URL": redis_url, "EXITPLANE_SECRET_KEY": secrets.token_urlsafe(48),
                "EXITPLANE_VAR_DIR": str(tmp_path / "var"), "EXITPLANE_PUBLIC_URL": api,
                "EXITPLANE_LOG_FORMAT": "json", "EXITPLANE_DRIFT_INTERVAL_S": "2",
                "OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "200",
                "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=trace-test"})
    token_file, admin = provision_chat(env, tmp_path)
    commands = {
        "api": ["up", "--port", str(port), "--no-migrate", "--no-workers"],
        "ingest": ["ingest"], "worker": ["worker"], "beat": ["beat"],
        "runtime": ["runtime", "serve", "--model", "tiny", "--deployment", "chat",
                    "--control-plane", api, "--token-file", str(token_file), "--state-dir",
                    str(tmp_path / "runtime"), "--port", str(runtime_port)]}
    # beat names its service in OTEL_RESOURCE_ATTRIBUTES: that wins over exitplane-beat
    own = {"beat": {"OTEL_RESOURCE_ATTRIBUTES": "service.name=scheduler,"
                                                "deployment.environment=trace-test"}}
    processes = []
    try:
        for name, args in commands.items():
            processes.append(spawn([EXITPLANE, *args], env={**env, **own.get(name, {})},
                                   out=tmp_path / f"{name}.out", err=tmp_path / f"{name}.err"))
        wait_until(lambda: answers(f"{api}/readyz"), 120, "the API")
        ops = httpx.Client(base_url=api, headers={"Authorization": f"Bearer {admin}"},
                           timeout=30)
        assert ops.post("/v1/deployments/chat/threshold-sets", json={
            "thresholds": {"2": 0.0, "4": 0.0}, "reason": "exit early", "activate": True}
        ).status_code == 201
        runtime = f"http://127.0.0.1:{runtime_port}"
        wait_until(lambda: httpx.get(f"{runtime}/readyz", timeout=3).json().get(
            "threshold_version") == 2 if answers(f"{runtime}/readyz") else False, 120,
            "the runtime to apply version 2")
        answer = httpx.post(f"{runtime}/v1/completions", timeout=60,
                            headers={"X-Request-ID": "trace-me-1"},
                            json={"prompt": "hello", "max_tokens": 6, "ignore_eos": True})
        assert answer.status_code == 200 and answer.headers["x-request-id"] == "trace-me-1"
        wait_until(lambda: any(s["name"] == "telemetry.ingest"
                               for s in _spans(tmp_path / "ingest.out")), 90,
                   "the ingest worker's span of the runtime's telemetry")
        wait_until(lambda: any(s["name"] == "run/drift.detect_all"
                               for s in _spans(tmp_path / "worker.out")), 60,
                   "the worker's span of a beat-scheduled drift check")
    finally:
        stop_processes(processes)
        print_tails(sorted(tmp_path.glob("*.out")) + sorted(tmp_path.glob("*.err")), 2500)

    spans = {name: _spans(tmp_path / f"{name}.out") for name in PROCESSES}
    services = {name: {s["resource"]["attributes"]["service.name"] for s in found}
                for name, found in spans.items()}
    assert services == {"api": {"exitplane-api"}, "ingest": {"exitplane-ingest"},
                        "worker": {"exitplane-worker"}, "beat": {"scheduler"},
                        "runtime": {"exitplane-runtime"}}
    assert all(s["resource"]["attributes"]["deployment.environment"] == "trace-test"
               for found in spans.values() for s in found)

    # The API: server spans by route template, for the runtime's pulls and posts too.
    api_names = {s["name"] for s in spans["api"] if s["kind"] == "SpanKind.SERVER"}
    assert "POST /v1/deployments/{name}/threshold-sets" in api_names, api_names
    # Its access line, written after the span ended, names the span.
    [published] = [s for s in spans["api"]
                   if s["name"] == "POST /v1/deployments/{name}/threshold-sets"]
    [api_access] = [line for line in _lines(tmp_path / "api.out")
                    if line.get("logger") == "exitplane.access" and line["method"] == "POST"
                    and line["route"] == "/v1/deployments/{name}/threshold-sets"]
    assert api_access["trace_id"] == published["context"]["trace_id"].removeprefix("0x")
    assert api_access["span_id"] == published["context"]["span_id"].removeprefix("0x")

    # The runtime: one server span per request, with what the request did.
    [request] = [s for s in spans["runtime"] if s["name"] == "POST /v1/completions"]
    attributes = request["attributes"]
    assert attributes["exitplane.threshold_version"] == 2
    assert attributes["exitplane.exit_layers"] == answer.json()["exitplane"]["exit_layers"]
    assert len(attributes["exitplane.exit_layers"]) == 6
    assert 0 < attributes["exitplane.time_to_first_token_ms"] < 60_000
    access = [line for line in _lines(tmp_path / "runtime.out")
              if line.get("logger") == "exitplane.access" and line["request_id"] == "trace-me-1"]
    assert len(access) == 1 and access[0]["status"] == 200, access
    assert access[0]["trace_id"] == request["context"]["trace_id"].removeprefix("0x")
    assert access[0]["span_id"] == request["context"]["span_id"].removeprefix("0x")

    # Ingest: a span per stored read of the stream.
    ingest = [s for s in spans["ingest"] if s["name"] == "telemetry.ingest"]
    assert ingest[0]["attributes"]["exitplane.deployment"] == "chat"
    assert ingest[0]["attributes"]["exitplane.batches"] >= 1

    # Beat's scheduled send and the worker's run of it: one trace across the broker.
    sends = {s["context"]["trace_id"] for s in spans["beat"]
             if s["name"] == "apply_async/drift.detect_all"}
    runs = [s for s in spans["worker"] if s["name"] == "run/drift.detect_all"]
    assert sends and {s["context"]["trace_id"] for s in runs} & sends
    worker_lines = [line for line in _lines(tmp_path / "worker.out")
                    if line.get("task") == "drift.detect_all" and "trace_id" in line]
    assert {line["trace_id"] for line in worker_lines} & {
        s["context"]["trace_id"].removeprefix("0x") for s in runs}

    # JSON mode: stdout holds nothing else (checked by _lines), no banner on stderr either.
    for name in PROCESSES:
        assert (tmp_path / f"{name}.err").read_text().strip() == "", name
