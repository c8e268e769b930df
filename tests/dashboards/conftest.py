"""Fixtures for the admin UI: people of each role, a deployment with an hour of telemetry,
and a signed-in test client."""

from __future__ import annotations

import random
import time
from datetime import UTC, datetime

import pytest
from sqlalchemy.orm import Session

from controlplane.deployments import service as thresholds
from controlplane.flows import recalibration
from controlplane.telemetry.service import ingest
from tests.support.dashboards import (
    Seeded,
    create_dead_hook,
    fire_drift_alert,
    queue_calibration,
    seed_deployment,
    seeded_batch,
)
from tests.support.network import serve_in_thread
from tests.support.people import create_people, sign_in


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


@pytest.fixture
def seeded(engine, request) -> Seeded:
    """The seeded deployment: 40 minutes of telemetry for charts, 3 for everything else."""
    return seed_deployment(engine, minutes=40 if request.node.get_closest_marker("browser")
                           else 3)


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


@pytest.fixture
def hook_receiver():
    """A local HTTP endpoint that accepts hook deliveries and remembers them."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


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
            seeded_batch(rng, name=seeded.name, version=3, start=time.time() - 120 + i, n=500,
                         runtime_id=("rt-a", "rt-b")[i % 2], seq=1000 + i, exit_bias=0.5,
                         shadow_rate=1.0)
            for i in range(4)])  # shared by both runtimes: no one runtime's share is capped
        job, _ = calibration.request_calibration(
            session=session, deployment=deployment, actor="user:seed", enqueue=False,
            since=datetime.fromtimestamp(time.time() - 3600, UTC), reason="nightly")
        calibration.start_job(session=session, job=job)
        recalibration.run_calibration(session=session, job=job,
                                      policy=calibration.CalibrationPolicy(
                                          min_samples_per_layer=50, seed=0))
        session.commit()
        assert (job.status, job.promotion) == ("succeeded", "awaiting_approval"), \
            job.status_reason
        return job.id


@pytest.fixture
def queued_job(engine, seeded) -> int:
    """A recalibration job that no worker picked up yet (id 1)."""
    return queue_calibration(engine, name=seeded.name)


