"""Fixtures for the admin UI: people of each role, a deployment with an hour of telemetry,
and a signed-in test client."""

from __future__ import annotations

import random
import re
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session

from controlplane.auth.users import create_user
from controlplane.deployments import service as thresholds
from controlplane.deployments.models import AuditEvent, ThresholdSet
from controlplane.deployments.schemas import DeploymentCreate
from controlplane.runtimes.service import record_heartbeat
from controlplane.telemetry.service import ingest
from exitplane.wire import Heartbeat, Origin, TelemetryBatch

PASSWORD = "correct horse battery staple"
LAYERS = [3, 6, 9]
FULL = 12
ROLES = ("viewer", "operator", "admin")


@pytest.fixture(autouse=True)
def _tasks_recorded(outbox) -> None:
    """The UI's actions enqueue tasks and no worker runs here: every test records them
    (`outbox`, tests/conftest.py)."""


@pytest.fixture(autouse=True)
def _every_ui_test_hashes_quickly(quick_hashing):
    """tests/conftest.py's quick_hashing for every UI test: they exercise the UI, not the
    hash's strength."""


@pytest.fixture
def people(engine) -> dict[str, str]:
    """One user per role, each named after the role, all with PASSWORD."""
    return create_people(engine)


def create_people(engine) -> dict[str, str]:
    """Store `people`'s users (username -> role)."""
    with Session(engine) as session:
        for role in ROLES:
            create_user(session=session, username=role, password=PASSWORD, role=role)
        session.commit()
    return {role: role for role in ROLES}


def _batch(rng: random.Random, *, name: str, version: int, start: float, n: int,
           runtime_id: str, seq: int, exit_bias: float,
           shadow_rate: float = 0.3) -> TelemetryBatch:
    records = []
    for i in range(n):
        signal = rng.random()
        deep = rng.random() > exit_bias
        record = {"threshold_version": version, "request_id": f"r{seq}-{i % 7}", "position": i,
                  "exit_layer": FULL if deep else rng.choice(LAYERS), "signal_value": signal,
                  "latency_us": rng.randint(2000, 9000), "ts": start + i * 55.0 / n}
        if rng.random() < shadow_rate:
            # Confident exits agree with the full model; unsure ones often do not.
            record["exit_layer"] = FULL
            record["shadow"] = []
            for k in LAYERS:
                shadow_signal = rng.random()
                matched = (shadow_signal > 0.4 and rng.random() < 0.985) or rng.random() < 0.3
                record["shadow"].append({"layer": k, "signal": shadow_signal,
                                         "matched": matched})
        records.append(record)
    return TelemetryBatch.model_validate({
        "batch_id": uuid.uuid4().hex, "deployment": name, "runtime_id": runtime_id, "seq": seq,
        "num_layers": FULL, "records": records})


@dataclass
class Seeded:
    name: str
    versions: list[int]


def seed_deployment(engine, name: str = "chat", minutes: int = 40) -> Seeded:
    """A deployment with v1 (conservative), v2 manual, v3 calibration (active) and v4 (a
    candidate), `minutes` of telemetry across the versions and two runtimes reporting."""
    rng = random.Random(7)
    with Session(engine) as session:
        deployment = thresholds.create_deployment(session=session, spec=DeploymentCreate(
            name=name, model_ref="HuggingFaceTB/SmolLM2-135M-Instruct", num_layers=FULL,
            exit_layers=LAYERS, delta=0.05), actor="user:seed")
        v2 = thresholds.publish(session=session, deployment=deployment,
                                thresholds={3: 0.95, 6: 0.9, 9: 0.8}, reason="first tuning",
                                actor="user:seed")
        thresholds.move_alias(session=session, deployment=deployment, alias="active",
                              version=v2.version, actor="user:seed", reason="first tuning")
        v3 = thresholds.publish(
            session=session, deployment=deployment, thresholds={3: 0.9, 6: 0.85, 9: 0.7},
            reason="recalibrated on last hour", actor="system", origin=Origin.calibration,
            expected_metrics={"exit_rate": {"3": 0.12, "6": 0.2, "9": 0.3},
                              "risk_upper_bound": 0.041, "speedup": 1.42})
        thresholds.move_alias(session=session, deployment=deployment, alias="active",
                              version=v3.version, actor="system", reason="auto-promote")
        v4 = thresholds.publish(
            session=session, deployment=deployment, thresholds={3: 0.85, 6: 0.8, 9: 0.65},
            reason="candidate awaiting approval", actor="system", origin=Origin.calibration,
            expected_metrics={"exit_rate": {"3": 0.16, "6": 0.25, "9": 0.33},
                              "risk_upper_bound": 0.048, "speedup": 1.6})
        now = time.time()
        first = now - minutes * 60
        batches = []
        for minute in range(minutes):
            version = 2 if minute < minutes // 2 else 3
            bias = 0.35 + 0.25 * (version == 3) + 0.05 * rng.random()
            for runtime in ("rt-a", "rt-b"):
                batches.append(_batch(rng, name=name, version=version,
                                      start=first + minute * 60, n=24, runtime_id=runtime,
                                      seq=minute, exit_bias=bias))
        ingest(session=session, deployment=deployment, batches=batches)
        _backdate(session, deployment, {1: first - 120, 2: first + 20,
                                        3: first + (minutes // 2) * 60,
                                        4: now - 300})
        for runtime, applied in (("rt-a", 3), ("rt-b", 2)):
            record_heartbeat(session=session, deployment=deployment, beat=Heartbeat(
                runtime_id=runtime, applied_version=applied, ready=True))
        session.commit()
        return Seeded(name=name, versions=[1, v2.version, v3.version, v4.version])


def _backdate(session: Session, deployment, when: dict[int, float]) -> None:
    """Spread the seeded history over the telemetry window, as it would have happened."""
    for version, ts in when.items():
        at = datetime.fromtimestamp(ts, UTC)
        session.execute(update(AuditEvent).where(AuditEvent.deployment_id == deployment.id,
                                                 AuditEvent.to_version == version)
                        .values(created_at=at))
        session.execute(update(ThresholdSet).where(ThresholdSet.deployment_id == deployment.id,
                                                   ThresholdSet.version == version)
                        .values(created_at=at))


@pytest.fixture
def seeded(engine, request) -> Seeded:
    """The seeded deployment: 40 minutes of telemetry for charts, 3 for everything else."""
    return seed_deployment(engine, minutes=40 if request.node.get_closest_marker("browser")
                           else 3)


CSRF_FIELD = re.compile(r'name="csrf_token" value="([^"]+)"')


def csrf_of(html: str) -> str:
    match = CSRF_FIELD.search(html)
    assert match, "the page has no CSRF field"
    return match.group(1)


def sign_in(client, username: str, password: str = PASSWORD):
    """Sign `client` in through the login form; returns the response after the redirect."""
    page = client.get("/ui/login")
    response = client.post("/ui/login", data={"username": username, "password": password,
                                              "csrf_token": csrf_of(page.text)})
    return response


@pytest.fixture
def ui(app):
    """A test client on https://testserver so Secure cookies round-trip."""
    from fastapi.testclient import TestClient

    with TestClient(app, base_url="https://testserver") as client:
        yield client


@pytest.fixture
def as_role(ui, people):
    """Sign the UI client in as the given role; returns the client."""

    def signed(role: str):
        response = sign_in(ui, people[role])
        assert response.status_code == 200, response.text
        return ui

    return signed


@pytest.fixture
def firing_alert(engine, settings, seeded) -> int:
    """A distribution-drift alert on layer 6 that fired ten minutes ago, with a report."""
    return fire_drift_alert(engine, name=seeded.name)


def fire_drift_alert(engine, *, name: str) -> int:
    """Store `firing_alert`'s alert on deployment `name`, with its report."""
    from datetime import timedelta

    from controlplane.alerts.service import Condition, fire
    from controlplane.db import utcnow

    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name=name)
        alert, _ = fire(session=session, deployment=deployment, condition=Condition(
            kind="distribution_drift", severity="warning", layer=6, subject="6",
            summary="signal distribution at layer 6 drifted (PSI 0.31 > 0.2)",
            evidence={"test": "psi", "statistic": 0.31, "threshold": 0.2,
                      "reference": {"minutes": 30}, "current": {"minutes": 10}},
            report_html="<html><body><h1>Evidently report</h1><script>1</script></body></html>"),
            now=utcnow() - timedelta(minutes=10), keep_report=True)
        session.commit()
        return alert.id


@pytest.fixture
def hook_receiver():
    """A local HTTP endpoint that accepts hook deliveries and remembers them."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tests.conftest import serve_in_thread

    received: list[dict] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            received.append({"path": self.path, "headers": dict(self.headers), "body": body})
            self.send_response(202)
            self.end_headers()

        def log_message(self, *_args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    serve_in_thread(server)
    server.received = received
    server.url = f"http://127.0.0.1:{server.server_address[1]}/hook"
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def dead_hook(engine) -> int:
    """A webhook pointing at a closed local port: deliveries fail fast."""
    return create_dead_hook(engine)


def create_dead_hook(engine) -> int:
    """Store `dead_hook`'s webhook."""
    from controlplane.alerts.hook_service import create_hook
    from tests.conftest import free_port

    with Session(engine) as session:
        hook = create_hook(session=session, name="dead end", kind="webhook",
                           url=f"http://127.0.0.1:{free_port()}/nothing", actor="user:seed")
        session.commit()
        return hook.id


@pytest.fixture
def calibrated(engine, seeded) -> int:
    """A finished recalibration on the seeded shadow samples whose candidate (v5) awaits
    approval (the deployment's policy is set to approval first)."""
    from controlplane.calibration import service as calibration
    from controlplane.deployments.schemas import DeploymentUpdate

    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name=seeded.name)
        thresholds.update_deployment(session=session, deployment=deployment,
                                     spec=DeploymentUpdate(policy="approval"), actor="user:seed")
        rng = random.Random(11)
        ingest(session=session, deployment=deployment, batches=[
            _batch(rng, name=seeded.name, version=3, start=time.time() - 120 + i, n=500,
                   runtime_id=("rt-a", "rt-b")[i % 2], seq=1000 + i, exit_bias=0.5,
                   shadow_rate=1.0)
            for i in range(4)])  # shared by both runtimes: no one runtime's share is capped
        job, _ = calibration.request_calibration(
            session=session, deployment=deployment, actor="user:seed", enqueue=False,
            since=datetime.fromtimestamp(time.time() - 3600, UTC), reason="nightly")
        calibration.start_job(session=session, job=job)
        calibration.run_calibration(session=session, job=job, policy=calibration.CalibrationPolicy(
            min_samples_per_layer=50, seed=0))
        session.commit()
        assert (job.status, job.promotion) == ("succeeded", "awaiting_approval"), \
            job.status_reason
        return job.id


@pytest.fixture
def queued_job(engine, seeded) -> int:
    """A recalibration job that no worker picked up yet (id 1)."""
    return queue_calibration(engine, name=seeded.name)


def queue_calibration(engine, *, name: str) -> int:
    """Store `queued_job`'s job on deployment `name`."""
    from controlplane.calibration import service as calibration

    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name=name)
        job, _ = calibration.request_calibration(session=session, deployment=deployment,
                                                 actor="user:seed", enqueue=False)
        session.commit()
        return job.id
