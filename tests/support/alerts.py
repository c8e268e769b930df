"""Deployments, telemetry through the real ingestion, and a real HTTP receiver on loopback that
records what hooks send (`receiver`): for the alert, drift and worker tests."""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.deployments.models import Alias, Deployment
from controlplane.deployments.schemas import DeploymentCreate
from controlplane.deployments.service import create_deployment, move_alias, publish
from controlplane.telemetry.service import ingest
from exitplane.wire import DEFAULT_SEGMENT, TelemetryBatch
from tests.support.batches import telemetry_batch
from tests.support.network import serve_in_thread

LAYERS = [4, 8, 12]
FULL = 16
THRESHOLDS = {4: 0.9, 8: 0.8, 12: 0.7}


def make_deployment(session: Session, name: str = "chat", *, delta: float = 0.02,
                    activated_at: datetime | None = None,
                    expected_metrics: dict | None = None) -> Deployment:
    """A deployment whose version 2 (tuned thresholds) is active since `activated_at`."""
    deployment = create_deployment(session=session, actor="test", spec=DeploymentCreate(
        name=name, model_ref="tiny", num_layers=FULL, exit_layers=LAYERS, delta=delta))
    tuned = publish(session=session, deployment=deployment, thresholds=THRESHOLDS,
                    reason="tuned", actor="test", expected_metrics=expected_metrics)
    move_alias(session=session, deployment=deployment, alias="active", version=tuned.version,
               actor="test", reason="tuned")
    if activated_at is not None:
        alias = session.scalars(select(Alias).where(Alias.deployment_id == deployment.id,
                                                    Alias.name == "active")).one()
        alias.updated_at = activated_at
    session.flush()
    return deployment


@dataclass
class Phase:
    """`minutes` of traffic at conditional exit rates `rates` (per layer of LAYERS)."""

    minutes: int
    rates: tuple[float, float, float]
    shadow_rate: float = 0.0
    mismatch_rate: float = 0.0


def send_traffic(session: Session, deployment: Deployment, *, start: datetime,
                 phases: list[Phase], tokens_per_minute: int = 500, seed: int = 0,
                 version: int = 2, runtime_id: str = "rt-1",
                 segment: str = DEFAULT_SEGMENT) -> datetime:
    """Ingest seeded token records minute by minute through the real ingestion, each record of
    traffic segment `segment`; returns the end.

    Shadow tokens run to full depth; their signal at layer 4 clears its threshold, so the active
    policy would have exited there, and they disagree with full depth at `mismatch_rate`."""
    rng = np.random.default_rng(seed)
    moment = start
    batches = []
    seq = 0
    for phase in phases:
        for _ in range(phase.minutes):
            u = rng.random((tokens_per_minute, len(LAYERS)))
            exits = u < np.array(phase.rates)
            first = np.where(exits.any(axis=1), exits.argmax(axis=1), len(LAYERS))
            records = []
            for i, index in enumerate(first):
                exit_layer = ([*LAYERS, FULL])[index]
                record = {"threshold_version": version, "request_id": f"r{i % 7}",
                          "position": i, "exit_layer": int(exit_layer),
                          "signal_value": float(min(0.999, 0.55 + 0.1 * index
                                                    + 0.1 * rng.random())),
                          "latency_us": 1000,
                          "ts": moment.timestamp() + i * 59.0 / tokens_per_minute}
                if segment != DEFAULT_SEGMENT:  # left off the wire, as a runtime sends it
                    record["segment"] = segment
                if rng.random() < phase.shadow_rate:
                    record["exit_layer"] = FULL
                    matched_first = bool(rng.random() >= phase.mismatch_rate)
                    record["shadow"] = [
                        {"layer": 4, "signal": 0.95, "matched": matched_first},
                        {"layer": 8, "signal": 0.5, "matched": True},
                        {"layer": 12, "signal": 0.5, "matched": True}]
                records.append(record)
            batches.append(TelemetryBatch.model_validate(telemetry_batch(
                records, deployment=deployment.name, runtime_id=runtime_id, seq=seq,
                num_layers=FULL)))
            seq += 1
            moment += timedelta(minutes=1)
    ingest(session=session, deployment=deployment, batches=batches)
    session.flush()
    return moment


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


@dataclass
class Receiver:
    """A real HTTP server on loopback; answers with queued status codes (then 200)."""

    url: str = ""
    requests: list[Received] = field(default_factory=list)
    statuses: deque = field(default_factory=deque)
    server: ThreadingHTTPServer | None = None

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                receiver.requests.append(Received("POST", self.path, dict(self.headers), body))
                status = receiver.statuses.popleft() if receiver.statuses else 200
                payload = b"ok" if status < 300 else b"receiver error"
                self.send_response(status)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        serve_in_thread(self.server)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


@pytest.fixture
def receiver():
    """A real HTTP receiver on loopback, recording what hooks send; stopped after the test."""
    server = Receiver().start()
    yield server
    server.stop()
