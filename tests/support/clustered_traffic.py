"""Request-clustered telemetry for the drift tests, through the real ingestion.

Real traffic comes in requests: a request's tokens share how easy they are, so exits (and
disagreements) are correlated within a request. Each request here draws its own ease e ~ Beta;
each token's signal at exit layer k is e + noise + LIFT[k], it exits at the first layer whose
threshold it passes (the deployment of `tests.controlplane.alerts.support`, version 2), shadow
tokens run to full depth with their signal at every exit layer.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

import numpy as np
from sqlalchemy.orm import Session

from controlplane.deployments.models import Deployment
from controlplane.telemetry.service import ingest
from exitplane.wire import TelemetryBatch
from tests.support.alerts import FULL, LAYERS, THRESHOLDS
from tests.support.batches import telemetry_batch

LIFT = np.array([0.0, 0.12, 0.22])  # deeper layers are more confident


@dataclass
class Requests:
    """`minutes` of traffic: requests whose ease ~ Beta(mean `ease`, concentration `spread`)."""

    minutes: int
    ease: float = 0.6
    spread: float = 20.0  # Beta a + b: small means requests differ a lot
    mismatch_rate: float = 0.005  # of shadow tokens whose policy exit disagrees
    shadow_rate: float = 0.3
    tail_shift: float = 0.0  # moves the signal of tokens that do not exit (exits unchanged)
    unchecked: bool = False  # non-shadow tokens' exits were not checked (signal None)


def send_requests(session: Session, deployment: Deployment, *, start: datetime,
                  phases: list[Requests], requests_per_minute: int = 30,
                  tokens_per_request: int = 20, seed: int = 0, version: int = 2,
                  thresholds: dict[int, float] = THRESHOLDS) -> datetime:
    """Ingest the phases minute by minute; returns the end."""
    rng = np.random.default_rng(seed)
    limits = np.array([thresholds[k] for k in LAYERS])
    moment, seq, batches = start, 0, []
    for phase in phases:
        a = phase.ease * phase.spread
        for _ in range(phase.minutes):
            records = []
            ease = rng.beta(a, phase.spread - a, requests_per_minute)
            for r, e in enumerate(ease):
                request_id = f"{seq}-{r}-{uuid.uuid4().hex[:6]}"
                noise = rng.normal(0, 0.08, (tokens_per_request, len(LAYERS)))
                signals = np.clip(e + noise + LIFT[None, :], 0.0, 0.999)
                exits = signals > limits[None, :]
                first = np.where(exits.any(axis=1), exits.argmax(axis=1), len(LAYERS))
                stays = first == len(LAYERS)
                signals[stays] = np.clip(signals[stays] + phase.tail_shift, 0.0,
                                         limits[None, :] - 1e-3)
                for i in range(tokens_per_request):
                    ts = moment.timestamp() + 59.0 * (r * tokens_per_request + i) / (
                        requests_per_minute * tokens_per_request)
                    shadow = rng.random() < phase.shadow_rate
                    index = int(first[i])
                    column = min(index, len(LAYERS) - 1)
                    record = {"threshold_version": version, "request_id": request_id,
                              "position": i, "exit_layer": FULL if shadow else
                              [*LAYERS, FULL][index],
                              "signal_value": float(signals[i, column]),
                              "latency_us": 1000, "ts": ts}
                    if phase.unchecked and not shadow:
                        record["signal_value"] = None
                    if shadow:
                        wrong = rng.random() < phase.mismatch_rate
                        record["shadow"] = [
                            {"layer": k, "signal": float(signals[i, j]),
                             "matched": not (wrong and j == index)}
                            for j, k in enumerate(LAYERS)]
                    records.append(record)
            batches.append(TelemetryBatch.model_validate(telemetry_batch(
                records, deployment=deployment.name, seq=seq, num_layers=FULL)))
            seq += 1
            moment += timedelta(minutes=1)
    ingest(session=session, deployment=deployment, batches=batches)
    session.flush()
    return moment
