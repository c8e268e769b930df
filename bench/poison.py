"""One runtime cannot steer the fleet: calibration, drift and fallback with a lying runtime.

    .venv/bin/python -P bench/poison.py            # SQLite store under a temporary directory
    .venv/bin/python -P bench/poison.py --quick    # fewer shares, shorter timeline

A deployment (exit layers 3, 6, 9 of 12, δ 0.05, ε 0.1, policy auto, a tuned version active)
is served by `--honest` simulated runtimes whose shadow tokens come from a known model: at each
exit layer j the signal is uniform on [0, 1] and the layer's top-1 matches full depth with
probability sigmoid(10 (s - c_j)), so the true disagreement (and exit rate) of any threshold set
on honest traffic is computed on a large fresh honest sample. One liar joins them, holding a
share of the shadow evidence (5%, 20%, 50%), of one kind:

- `all_matched`: every exit layer matched (forged agreement);
- `all_mismatched`: no exit layer matched (forged disagreement);
- `shifted`: honest labels with every signal reported 0.25 lower (low signals look safe);
- `other_heads`: a runtime serving other exit heads (its own match model, c_j - 0.3) that says
  so: its heartbeats and batches name another heads digest than the deployment's, so lineage
  sets it aside at its first report.

Every scenario runs the real code over the real store: tokens through `telemetry.service.ingest`,
a drift cycle (`drift.service.check_deployment`: outlier detection, quality tests, the fallback
they trigger) every `--drift-interval-s` of simulated time, then a recalibration job
(`calibration.service.run_calibration`, policy auto: promotion bounds included) on the window.
Every runtime sends a heartbeat each interval naming the heads it serves.

The canary (`calibration.canary.evaluate_canary`, one-minute windows) then judges two
candidates with a 20% liar that no drift cycle set aside (the canary's own outlier test on the
candidate's shadow tokens has to find it): a bad one (true disagreement above δ) with an
`all_matched` liar forging agreement, and a good one (well within δ) with an `all_mismatched`
liar forging disagreement. A wrong verdict is the bad one promoted, or the good one not
promoted (reverted, or still undecided when the canary's minutes are over).

Printed: one JSON line with `worst_promoted_true_disagreement` (worst over kinds and shares of
the active set's true disagreement on honest traffic after the recalibration), `delta`,
`false_fallbacks` (honest traffic is within δ throughout, so every fallback is false),
`outlier_detected_s_max` (the slowest detection of a liar by the outlier test, from its first
token), `lineage_excluded_s_max` (the same for the liar that names other heads),
`drift_interval_s`, `honest_exit_rate_ratio_at_5pct` (true exit rate of the set promoted with a
5% liar over the one promoted without a liar, worst kind), `canary_wrong_verdicts`, and per
scenario figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import uuid
import zlib
from datetime import timedelta
from pathlib import Path

import numpy as np
from scipy.special import expit
from sqlalchemy import select

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controlplane.alerts.kinds import AlertKind
from controlplane.alerts.models import Alert
from controlplane.calibration import service as calibration
from controlplane.calibration.canary import CanaryPolicy, evaluate_canary, start_canary
from controlplane.calibration.fallback import install
from controlplane.calibration.models import CalibrationJob
from controlplane.calibration.stats import simulate_policy
from controlplane.db import make_engine, session_scope, utcnow
from controlplane.drift.service import DriftOptions, check_deployment
from controlplane.migrate import upgrade
from controlplane.runtimes.lineage import mismatched_runtime_ids
from controlplane.runtimes.models import RuntimeOutlier
from controlplane.runtimes.service import record_heartbeat
from controlplane.telemetry.service import ingest
from controlplane.thresholds.models import Alias
from controlplane.thresholds.schemas import DeploymentCreate
from controlplane.thresholds.service import (
    aliases_of,
    create_deployment,
    get_deployment,
    get_threshold_set,
    move_alias,
    publish,
)
from exitplane.wire import Heartbeat, TelemetryBatch

LAYERS, FULL, DELTA, EPSILON = [3, 6, 9], 12, 0.05, 0.1
CENTRES = np.array([0.75, 0.65, 0.55])  # honest P(match) = 1/2 at these signals
TUNED = {3: 0.9, 6: 0.85, 9: 0.8}
KINDS = ("all_matched", "all_mismatched", "shifted", "other_heads")
TOKENS_PER_REQUEST = 8
HEADS, OTHER_HEADS = "sim-heads-a", "sim-heads-b"
GOOD, BAD = {3: 0.97, 6: 0.95, 9: 0.92}, {3: 0.6, 6: 0.55, 9: 0.5}  # canary candidates


def seed_of(*parts) -> int:
    """A seed that is the same on every run (Python's hash() of a str is salted per process)."""
    return zlib.crc32(repr(parts).encode())


def honest(n: int, rng, centres=CENTRES) -> tuple[np.ndarray, np.ndarray]:
    signals = rng.random((n, len(LAYERS)))
    return signals, rng.random(signals.shape) < expit(10.0 * (signals - centres))


def liar(kind: str, n: int, rng) -> tuple[np.ndarray, np.ndarray]:
    signals, matched = honest(n, rng, CENTRES - 0.3 if kind == "other_heads" else CENTRES)
    if kind == "all_matched":
        matched[:] = True
    elif kind == "all_mismatched":
        matched[:] = False
    elif kind == "shifted":
        signals = np.clip(signals - 0.25, 0.0, 1.0)
    return signals, matched


def truth(thresholds: dict[int, float], sample) -> tuple[float, float]:
    """(disagreement, exit rate) of `thresholds` on the honest sample."""
    first, disagree = simulate_policy(*sample, [thresholds[k] for k in LAYERS])
    return float(disagree.mean()), float((first < len(LAYERS)).mean())


def heads_of(runtime: str, kind: str | None) -> str:
    return OTHER_HEADS if runtime == "liar" and kind == "other_heads" else HEADS


def batch(name: str, runtime: str, seq: int, signals, matched, t0: float, spacing: float,
          version: int, head_digest: str = HEADS) -> TelemetryBatch:
    records = [{"threshold_version": version, "request_id": f"{seq}-{i // TOKENS_PER_REQUEST}",
                "position": i % TOKENS_PER_REQUEST, "exit_layer": FULL,
                "signal_value": float(signals[i, -1]), "latency_us": 900,
                "ts": t0 + i * spacing,
                "shadow": [{"layer": k, "signal": float(signals[i, j]),
                            "matched": bool(matched[i, j])} for j, k in enumerate(LAYERS)]}
               for i in range(len(signals))]
    return TelemetryBatch(batch_id=uuid.uuid5(uuid.NAMESPACE_URL, f"{name}/{runtime}/{seq}").hex,
                          deployment=name, runtime_id=runtime, seq=seq, num_layers=FULL,
                          records=records, head_digest=head_digest)


def send(session, name: str, kind: str | None, sources, seq: int, t0: float, interval: float,
         version: int) -> int:
    """Each source's heartbeat, then its tokens of one interval; returns the last seq."""
    deployment = get_deployment(session=session, name=name)
    for runtime, _ in sources:
        record_heartbeat(session=session, deployment=deployment, beat=Heartbeat(
            runtime_id=runtime, applied_version=version, head_digest=heads_of(runtime, kind)))
    batches = []
    for runtime, (signals, matched) in sources:
        if len(signals):
            seq += 1
            batches.append(batch(name, runtime, seq, signals, matched, t0,
                                 interval / len(signals), version, heads_of(runtime, kind)))
    ingest(session=session, deployment=deployment, batches=batches)
    return seq


def scenario(engine, name: str, kind: str | None, share: float, args, sample) -> dict:
    rng = np.random.default_rng(seed_of(kind, share))
    start = utcnow().replace(second=0, microsecond=0) - timedelta(seconds=args.duration_s + 60)
    with session_scope(engine) as session:
        deployment = create_deployment(session=session, actor="bench", spec=DeploymentCreate(
            name=name, model_ref="sim", num_layers=FULL, exit_layers=LAYERS, delta=DELTA,
            epsilon=EPSILON, policy="auto", head_digest=HEADS))
        disagreement, exits = truth(TUNED, sample)
        tuned = publish(session=session, deployment=deployment, thresholds=TUNED,
                        reason="tuned", actor="bench",
                        expected_metrics={"total_exit_rate": exits})
        move_alias(session=session, deployment=deployment, alias="active",
                   version=tuned.version, actor="bench", reason="tuned")
        session.scalars(select(Alias).where(Alias.deployment_id == deployment.id,
                                            Alias.name == "active")).one().updated_at = start
    honest_per_step = int(args.honest_tokens_per_s * args.drift_interval_s)
    liar_per_step = (round(honest_per_step * args.honest * share / (1 - share))
                     if kind else 0)
    options = DriftOptions(check_interval_s=args.drift_interval_s)
    detected, excluded, fallbacks, seq = None, None, 0, 0
    steps = int(args.duration_s // args.drift_interval_s)
    for step in range(steps):
        t0 = start + timedelta(seconds=step * args.drift_interval_s)
        sources = [(f"honest-{i}", honest(honest_per_step, rng)) for i in range(args.honest)]
        if kind:
            sources.append(("liar", liar(kind, liar_per_step, rng)))
        with session_scope(engine) as session:
            seq = send(session, name, kind, sources, seq, t0.timestamp(), args.drift_interval_s,
                       tuned.version)
        now = t0 + timedelta(seconds=args.drift_interval_s)
        with session_scope(engine) as session:
            deployment = get_deployment(session=session, name=name)
            check_deployment(session=session, deployment=deployment, options=options, now=now)
            found = session.scalars(select(RuntimeOutlier).where(
                RuntimeOutlier.deployment_id == deployment.id,
                RuntimeOutlier.runtime_id == "liar")).first()
            if found is not None and detected is None:
                detected = (now - start).total_seconds()
            if excluded is None and "liar" in mismatched_runtime_ids(
                    session=session, deployment_id=deployment.id):
                excluded = (now - start).total_seconds()
            fallbacks = len(list(session.scalars(select(Alert).where(
                Alert.deployment_id == deployment.id,
                Alert.kind.in_([AlertKind.QUALITY_REGRESSION, AlertKind.EXIT_RATE_SPIKE])))))
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name=name)
        job, _ = calibration.request_calibration(session=session, deployment=deployment,
                                                 actor="bench", since=start,
                                                 until=utcnow(), enqueue=False)
        job_id = job.id
    with session_scope(engine) as session:
        job = calibration.run_calibration(session=session, job=session.get(CalibrationJob,
                                                                           job_id))
        deployment = get_deployment(session=session, name=name)
        active = get_threshold_set(session=session, deployment=deployment,
                                   version=aliases_of(session=session,
                                                      deployment=deployment)["active"])
        disagreement, exit_rate = truth(active.thresholds_by_layer(), sample)
        return {"kind": kind, "share": share, "outlier_detected_s": detected,
                "lineage_excluded_s": excluded,
                "fallbacks": fallbacks, "job": job.status, "promotion": job.promotion,
                "active_version": active.version, "true_disagreement": round(disagreement, 5),
                "true_exit_rate": round(exit_rate, 4)}


def canary_scenario(engine, name: str, kind: str, candidate: dict[int, float], share: float,
                    args, sample, minutes: int = 8) -> dict:
    """A canary of `candidate` served by the honest runtimes and a liar of `kind` holding
    `share` of its evidence, judged minute by minute until it ends (or `minutes` pass)."""
    rng = np.random.default_rng(seed_of(name, share))
    start = utcnow().replace(second=0, microsecond=0) - timedelta(minutes=minutes + 2)
    with session_scope(engine) as session:
        deployment = create_deployment(session=session, actor="bench", spec=DeploymentCreate(
            name=name, model_ref="sim", num_layers=FULL, exit_layers=LAYERS, delta=DELTA,
            epsilon=EPSILON, policy="auto", head_digest=HEADS))
        tuned = publish(session=session, deployment=deployment, thresholds=TUNED,
                        reason="tuned", actor="bench")
        move_alias(session=session, deployment=deployment, alias="active",
                   version=tuned.version, actor="bench", reason="tuned")
        version = publish(session=session, deployment=deployment, thresholds=candidate,
                          reason="candidate", actor="bench").version
        start_canary(session=session, deployment=deployment, version=version, actor="bench",
                     now=start)
    honest_per_minute = int(args.honest_tokens_per_s * 60)
    liar_per_minute = round(honest_per_minute * args.honest * share / (1 - share))
    policy, seq, status, windows = CanaryPolicy(), 0, "running", 0
    for minute in range(1, minutes + 1):
        t0 = start + timedelta(minutes=minute)
        sources = [(f"honest-{i}", honest(honest_per_minute, rng)) for i in range(args.honest)]
        sources.append(("liar", liar(kind, liar_per_minute, rng)))
        with session_scope(engine) as session:
            seq = send(session, name, kind, sources, seq, t0.timestamp(), 60.0, version)
        with session_scope(engine) as session:
            deployment = get_deployment(session=session, name=name)
            run = evaluate_canary(session=session, deployment=deployment, policy=policy,
                                  now=t0 + timedelta(minutes=1, seconds=1))
            status, windows = run.status, len(run.checks)
        if status != "running":
            break
    disagreement, _ = truth(candidate, sample)
    good = disagreement <= DELTA
    return {"kind": kind, "share": share, "candidate": "good" if good else "bad",
            "true_disagreement": round(disagreement, 5), "status": status, "windows": windows,
            "wrong": status != "promoted" if good else status == "promoted"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--honest", type=int, default=3)
    parser.add_argument("--honest-tokens-per-s", type=float, default=8.0)
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--drift-interval-s", type=float, default=30.0)
    parser.add_argument("--shares", type=float, nargs="+", default=[0.05, 0.2, 0.5])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.duration_s = 300.0
    args.honest_tokens_per_s = int(args.honest_tokens_per_s)
    install()
    sample = honest(400_000, np.random.default_rng(12345))
    with tempfile.TemporaryDirectory() as folder:
        url = f"sqlite:///{folder}/poison.db"
        upgrade(url)
        engine = make_engine(url)
        runs = [scenario(engine, "baseline", None, 0.0, args, sample)]
        for kind in args.kinds:
            for share in args.shares:
                runs.append(scenario(engine, f"{kind}-{int(share * 100)}", kind, share, args,
                                     sample))
        canaries = [canary_scenario(engine, "canary-bad", "all_matched", BAD, 0.2, args, sample),
                    canary_scenario(engine, "canary-good", "all_mismatched", GOOD, 0.2, args,
                                    sample)]
        engine.dispose()
    base = runs[0]
    liars = runs[1:]
    at_5 = [r for r in liars if abs(r["share"] - 0.05) < 1e-9]
    detections = [r["outlier_detected_s"] for r in liars if r["kind"] != "other_heads"]
    lineage = [r["lineage_excluded_s"] for r in liars if r["kind"] == "other_heads"]
    print(json.dumps({
        "worst_promoted_true_disagreement": max(r["true_disagreement"] for r in runs),
        "delta": DELTA,
        "false_fallbacks": sum(r["fallbacks"] for r in runs),
        "outlier_detected_s_max": None if None in detections else max(detections),
        "lineage_excluded_s_max": None if None in lineage or not lineage else max(lineage),
        "drift_interval_s": args.drift_interval_s,
        "canary_wrong_verdicts": sum(c["wrong"] for c in canaries),
        "honest_exit_rate_ratio_at_5pct": round(min(r["true_exit_rate"] for r in at_5)
                                                / base["true_exit_rate"], 4) if at_5 else None,
        "honest_runtimes": args.honest, "duration_s": args.duration_s,
        "command": " ".join(["bench/poison.py", *sys.argv[1:]]),
        "runs": runs, "canaries": canaries}))


if __name__ == "__main__":
    main()
