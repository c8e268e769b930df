"""One request followed through the logs of a real API process and a real Celery worker process
(PostgreSQL store, Redis broker), both started with the commands operators run: the request id
comes back in the response, stamps the API's access line, rides the calibration task it
enqueues and stamps the worker's lines; both processes log JSON by default in production.
The same processes export HTTP request durations by route template and task durations."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import httpx
import pytest
import redis

from controlplane.db import make_engine
from tests.support.network import free_port
from tests.support.processes import EXITPLANE, answers, cli, print_tails, spawn, stop_processes
from tests.support.services import POSTGRES_URL, REDIS_URL, empty_postgres
from tests.support.waiting import wait_until

# slow: service processes
pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]


def _json_lines(path: Path) -> list[dict]:
    lines = []
    for line in path.read_text().splitlines():
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return lines


@pytest.fixture(scope="module")
def stack(postgres_migrated, tmp_path_factory):
    """`exitplane up` (API only) and `exitplane worker`, production environment, JSON by default."""
    if not (POSTGRES_URL and REDIS_URL):
        raise RuntimeError("set EXITPLANE_TEST_POSTGRES_URL and EXITPLANE_TEST_REDIS_URL")
    empty_postgres(postgres_migrated)
    redis_url = REDIS_URL.rsplit("/", 1)[0] + "/12"  # a database of this module's own
    redis.Redis.from_url(redis_url).flushdb()  # no task left over from another test
    tmp = tmp_path_factory.mktemp("observability")
    port, metrics_port = free_port(), free_port()
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("EXITPLANE_LOG", "EXITPLANE_ACCESS"))}
    env.update({"EXITPLANE_ENVIRONMENT": "production", "EXITPLANE_DATABASE_URL": postgres_migrated,
                "EXITPLANE_REDIS_URL": redis_url,
                "EXITPLANE_SECRET_KEY": secrets.token_urlsafe(48),
                "EXITPLANE_VAR_DIR": str(tmp / "var"),
                "EXITPLANE_PUBLIC_URL": f"http://127.0.0.1:{port}",
                "EXITPLANE_WORKER_METRICS_PORT": str(metrics_port)})
    token = cli(env, "token", "create", "--name", "ops", "--scope", "admin")
    processes = [spawn([EXITPLANE, *command], out=tmp / f"{name}.log", env=env)
                 for name, command in (
                     ("api", ["up", "--port", str(port), "--no-migrate", "--no-workers"]),
                     ("worker", ["worker"]))]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: answers(f"{url}/readyz"), 90, "the API to be ready")
        wait_until(lambda: answers(f"http://127.0.0.1:{metrics_port}/metrics"), 90,
                   "the worker's metrics port")
        http = httpx.Client(base_url=url, timeout=30,
                            headers={"Authorization": f"Bearer {token}"})
        assert http.post("/v1/deployments", json={
            "name": "chat", "model_ref": "tiny-llama", "num_layers": 6, "exit_layers": [2, 4],
            "signal": "maxprob", "delta": 0.1, "epsilon": 0.1}).status_code == 201
        yield {"http": http, "logs": tmp, "metrics": f"http://127.0.0.1:{metrics_port}/metrics"}
    finally:
        stop_processes(processes)
        print_tails(tmp.glob("*.log"), 4000)


def test_a_request_id_follows_the_request_into_the_worker(stack):
    rid = f"req-{secrets.token_hex(6)}"
    response = stack["http"].post("/v1/deployments/chat/calibrations",
                                  json={"reason": "log test"}, headers={"X-Request-ID": rid})
    assert response.status_code in (200, 202), response.text
    assert response.headers["x-request-id"] == rid

    worker_log = stack["logs"] / "worker.log"
    task_lines = wait_until(lambda: [line for line in _json_lines(worker_log)
                                     if line.get("request_id") == rid], 90,
                            "the worker to log the calibration task under the request id")
    assert any(line.get("task") == "calibration.run" for line in task_lines), task_lines
    assert all(line["process_name"] == "worker" and line["level"] for line in task_lines)

    api_lines = [line for line in _json_lines(stack["logs"] / "api.log")
                 if line.get("request_id") == rid]
    access = [line for line in api_lines if line["logger"] == "exitplane.access"]
    assert len(access) == 1, api_lines  # access log on by default in production
    assert access[0]["route"] == "/v1/deployments/{name}/calibrations"
    assert access[0]["status"] == response.status_code
    print("API:", json.dumps(access[0]), "\nworker:", "\n".join(map(json.dumps, task_lines)))


def test_the_hook_deliveries_a_request_enqueues_carry_its_id(stack, postgres_migrated):
    from sqlalchemy.orm import Session

    from controlplane.alerts.service import Condition, fire
    from controlplane.deployments.service import get_deployment

    engine = make_engine(postgres_migrated)
    with Session(engine) as session:  # an open alert, fired before any hook exists
        alert, _ = fire(session=session, deployment=get_deployment(session=session, name="chat"),
                        condition=Condition(kind="distribution_drift", severity="warning",
                                            summary="moved", subject="2", layer=2))
        session.commit()
        alert_id = alert.id
    engine.dispose()
    assert stack["http"].post("/v1/hooks", json={
        "name": "pager", "kind": "webhook", "url": "http://127.0.0.1:9/hook",
        "min_severity": "info"}).status_code == 201
    rid = f"ack-{secrets.token_hex(6)}"
    acked = stack["http"].post(f"/v1/alerts/{alert_id}/ack", json={"note": "looking"},
                               headers={"X-Request-ID": rid})
    assert acked.status_code == 200, acked.text
    lines = wait_until(lambda: [line for line in _json_lines(stack["logs"] / "worker.log")
                                if line.get("request_id") == rid
                                and line.get("task") == "alerts.deliver"], 90,
                       "the worker to log the delivery under the request id")
    assert lines[0]["message"].startswith("task alerts.deliver[")


def test_a_request_without_an_id_gets_one_and_a_bad_one_is_replaced(stack):
    made = stack["http"].get("/v1/deployments/chat")
    assert len(made.headers["x-request-id"]) == 32
    replaced = stack["http"].get("/v1/deployments/chat",
                                 headers={"X-Request-ID": "bad id\twith spaces"})
    assert replaced.headers["x-request-id"] not in ("bad id\twith spaces", made.headers[
        "x-request-id"])


def test_http_durations_by_route_template_and_task_durations(stack):
    stack["http"].get("/v1/deployments/chat")
    stack["http"].get("/v1/deployments/no-such-deployment")
    exposition = stack["http"].get("/metrics").text
    assert ('exitplane_http_request_duration_seconds_count{method="GET",'
            'route="/v1/deployments/{name}",status="200"}') in exposition
    assert 'route="/v1/deployments/{name}",status="404"' in exposition
    assert "no-such-deployment" not in exposition  # templates, never raw paths

    def task_count() -> float:
        for line in httpx.get(stack["metrics"], timeout=5).text.splitlines():
            if line.startswith("exitplane_worker_task_duration_seconds_count{") and \
                    'task="calibration.run"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    stack["http"].post("/v1/deployments/chat/calibrations", json={"reason": "metrics"})
    assert wait_until(task_count, 90, "a calibration.run duration sample") >= 1


def test_the_api_reports_its_event_loop_lag(stack):
    def lag_samples() -> float:
        for line in stack["http"].get("/metrics").text.splitlines():
            if line.startswith("exitplane_event_loop_lag_seconds_count "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    wait_until(lambda: lag_samples() >= 2, 30, "two event-loop lag samples")
    assert lag_samples() >= 2
