"""Deployments for the calibration tests, runtime-like shadow telemetry written through the real
ingestion service, and the alerts that make a deployment fall back."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import numpy as np
from sqlalchemy.orm import Session

from controlplane.alerts.service import Condition, fire
from controlplane.calibration.models import CalibrationJob
from controlplane.db import session_scope
from controlplane.deployments.schemas import DeploymentCreate
from controlplane.deployments.service import create_deployment, get_deployment
from controlplane.telemetry.service import ingest
from exitplane.wire import DEFAULT_SEGMENT, TelemetryBatch
from tests.support.batches import telemetry_batch

LAYERS = [3, 6, 9]
FULL = 12
GOOD = {3: 0.9, 6: 0.8, 9: 0.7}  # thresholds that keep quality
BAD = {3: 0.1, 6: 0.1, 9: 0.1}  # thresholds that exit nearly every token at layer 3


def make_deployment(session: Session, name: str = "chat", **overrides):
    spec = {"name": name, "model_ref": "tiny", "num_layers": FULL, "exit_layers": LAYERS,
            "delta": 0.05, "epsilon": 0.1} | overrides
    deployment = create_deployment(session=session, spec=DeploymentCreate(**spec), actor="test")
    session.flush()
    return deployment


def fire_alert(engine, kind: str = "quality_regression", evidence: dict | None = None) -> int:
    """A critical `kind` alert fired on deployment `chat` (and committed); its id."""
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        alert, created = fire(session=session, deployment=deployment, condition=Condition(
            kind=kind, severity="critical", summary=f"{kind} on chat",
            evidence=evidence or {"disagreement_rate": 0.2}))
        assert created
        return alert.id


def separable_samples(n: int, *, seed: int, mismatch_below: float = 0.5,
                      noise: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Signals uniform on [0, 1); a layer matches full depth exactly when its signal is above
    `mismatch_below` (flipped with probability `noise`): the right thresholds are known."""
    rng = np.random.default_rng(seed)
    signals = rng.random((n, len(LAYERS))).astype(np.float32)
    matched = signals > mismatch_below
    if noise:
        matched ^= rng.random(matched.shape) < noise
    return signals, matched


def policy_exit(signals: np.ndarray, thresholds: dict[int, float]) -> np.ndarray:
    """Exit layer per token under `thresholds` (FULL when no layer exits)."""
    limits = np.array([thresholds[k] for k in LAYERS])
    exits = signals > limits[None, :]
    first = np.where(exits.any(axis=1), exits.argmax(axis=1), len(LAYERS))
    return np.array([*LAYERS, FULL])[first]


def write_traffic(session: Session, deployment_name: str, signals: np.ndarray,
                  matched: np.ndarray, *, start: datetime, spacing_s: float = 0.05,
                  version: int = 0, thresholds: dict[int, float] | None = None,
                  shadow_every: int = 1, runtime_id: str = "rt-1",
                  batch_size: int = 5000, request_tokens: int = 64,
                  segment: str = DEFAULT_SEGMENT) -> None:
    """Store tokens as a runtime applying `version` would ship them: every `shadow_every`-th
    token is a shadow token (full depth, labels at every exit layer), the others exit where
    `thresholds` let them. Consecutive runs of `request_tokens` tokens form one request; every
    record carries traffic segment `segment`."""
    deployment = get_deployment(session=session, name=deployment_name)
    exit_at = (policy_exit(signals, thresholds) if thresholds is not None
               else np.full(len(signals), FULL))
    t0 = start.timestamp()
    records = []
    for i in range(len(signals)):
        shadow = i % shadow_every == 0
        layer = FULL if shadow else int(exit_at[i])
        column = LAYERS.index(layer) if layer in LAYERS else len(LAYERS) - 1
        record = {"threshold_version": version, "request_id": f"req-{i // request_tokens}",
                  "position": i % request_tokens, "exit_layer": layer,
                  "signal_value": float(signals[i, column]), "latency_us": 900,
                  "ts": t0 + i * spacing_s}
        if segment != DEFAULT_SEGMENT:  # as a runtime sends it: 'default' is left off the wire
            record["segment"] = segment
        if shadow:
            record["shadow"] = [{"layer": k, "signal": float(signals[i, j]),
                                 "matched": bool(matched[i, j])} for j, k in enumerate(LAYERS)]
        records.append(record)
    batches = [TelemetryBatch.model_validate(telemetry_batch(
                   records[offset:offset + batch_size], deployment=deployment_name,
                   runtime_id=runtime_id, seq=index, num_layers=FULL))
               for index, offset in enumerate(range(0, len(records), batch_size))]
    ingest(session=session, deployment=deployment, batches=batches)
    session.flush()


def minute(year_month_day_hour_minute: str) -> datetime:
    return datetime.fromisoformat(year_month_day_hour_minute).replace(tzinfo=UTC)


def write_fleet_traffic(session: Session, deployment_name: str, signals: np.ndarray,
                        matched: np.ndarray, *, runtimes: tuple[str, ...] = ("rt-1", "rt-2",
                                                                             "rt-3"),
                        **options) -> None:
    """`write_traffic` shared out between `runtimes` (a witness each: a fleet the robust rules
    can check), in contiguous thirds (or whatever share each gets), whole requests apiece."""
    tokens = options.get("request_tokens", 64)
    requests = -(-len(signals) // tokens)
    bounds = [round(requests * i / len(runtimes)) * tokens for i in range(len(runtimes) + 1)]
    for runtime_id, low, high in zip(runtimes, bounds[:-1], bounds[1:], strict=True):
        if high > low:
            write_traffic(session, deployment_name, signals[low:high], matched[low:high],
                          runtime_id=runtime_id, **options)


def wait_for_job(engine, job_id: int, statuses=("succeeded", "failed"), timeout=120):
    """The calibration job once its status is one of `statuses`; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with Session(engine) as session:
            job = session.get(CalibrationJob, job_id)
            if job.status in statuses:
                return job
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} stayed {job.status}: {job.status_reason}")
