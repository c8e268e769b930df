"""A deployment seeded for the admin UI (versions of each origin, telemetry from two runtimes), and
the alerts, hooks and calibration jobs the UI tests show."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import update
from sqlalchemy.orm import Session

from controlplane.db import utcnow
from controlplane.deployments import service as thresholds
from controlplane.deployments.models import AuditEvent, ThresholdSet
from controlplane.deployments.schemas import DeploymentCreate
from controlplane.deployments.segments import admit_segments
from controlplane.runtimes.service import record_heartbeat
from controlplane.telemetry.models import Rollup
from controlplane.telemetry.service import ingest
from exitplane.wire import Heartbeat, Origin, TelemetryBatch
from tests.support.batches import telemetry_batch
from tests.support.network import free_port

LAYERS = [3, 6, 9]
FULL = 12


def seeded_batch(rng: random.Random, *, name: str, version: int, start: float, n: int,
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
    return TelemetryBatch.model_validate(telemetry_batch(records, deployment=name,
                                                         runtime_id=runtime_id, seq=seq))


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
                batches.append(seeded_batch(rng, name=name, version=version,
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


def create_dead_hook(engine) -> int:
    """Store `dead_hook`'s webhook."""
    from controlplane.alerts.hook_service import create_hook

    with Session(engine) as session:
        hook = create_hook(session=session, name="dead end", kind="webhook",
                           url=f"http://127.0.0.1:{free_port()}/nothing", actor="user:seed")
        session.commit()
        return hook.id


def queue_calibration(engine, *, name: str) -> int:
    """Store `queued_job`'s job on deployment `name`."""
    from controlplane.calibration import service as calibration

    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name=name)
        job, _ = calibration.request_calibration(session=session, deployment=deployment,
                                                 actor="user:seed", enqueue=False)
        session.commit()
        return job.id


# layer -> (tokens, exits, shadow_total, policy_exits, policy_mismatches)
CODE_ROLLUPS = {3: (100, 5, 40, 4, 4), 6: (95, 5, 40, 2, 2), 9: (90, 0, 40, 0, 0),
                FULL: (90, 90, 40, 0, 0)}  # 10% early exits, 6/40 = 15% disagreement (δ is 5%)
CHAT_ROLLUPS = {3: (200, 80, 50, 10, 1), 6: (120, 40, 50, 5, 0), 9: (80, 0, 50, 0, 0),
                FULL: (80, 80, 50, 0, 0)}  # 60% early exits, 1/50 = 2% disagreement


def write_rollups(session: Session, deployment_id: int, segment: str, minute,
                  layers: dict, version: int = 3) -> None:
    """Rollups of runtime rt-a for one minute of `segment`, one per layer of `layers`."""
    for layer, (tokens, exits, shadow, policy_exits, mismatches) in layers.items():
        session.add(Rollup(deployment_id=deployment_id, version=version, runtime_id="rt-a",
                           minute=minute, segment=segment, layer=layer, tokens=tokens,
                           exits=exits, shadow_total=shadow, shadow_matches=shadow - mismatches,
                           policy_exits=policy_exits, policy_mismatches=mismatches))


def add_segment_traffic(engine, *, minutes: int = 2) -> datetime:
    """`chat` (the deployment) learns segments chat and code, with `minutes` of rollups each
    before the current minute (returned), and v5 (active) gives code a map of its own (chat
    applies the default one)."""
    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name="chat")
        admit_segments(session=session, deployment_id=deployment.id, names=["chat", "code"],
                       auto=True)
        now = utcnow().replace(second=0, microsecond=0)
        for back in range(1, minutes + 1):
            write_rollups(session, deployment.id, "code", now - timedelta(minutes=back),
                          CODE_ROLLUPS)
            write_rollups(session, deployment.id, "chat", now - timedelta(minutes=back),
                          CHAT_ROLLUPS)
        v5 = thresholds.publish(session=session, deployment=deployment,
                                thresholds={3: 0.9, 6: 0.85, 9: 0.7},
                                segments={"code": {3: 1.0, 6: 0.97, 9: 0.95}},
                                reason="code exits less", actor="user:seed")
        thresholds.move_alias(session=session, deployment=deployment, alias="active",
                              version=v5.version, actor="user:seed", reason="segments")
        session.commit()
    return now
