"""The operating curve, measured: what-if against the truth, opportunity re-tunes on easier
traffic, none on stationary traffic.

    .venv/bin/python -P bench/operating_curve.py            # SQLite store in a temp dir
    .venv/bin/python -P bench/operating_curve.py --quick    # fewer trials, 6 stationary hours

Three simulated runtimes (a runtime token each: three witnesses) post shadow tokens through the
real store (`telemetry.service.ingest`, the token as each batch's witness) for a deployment
with exit layers 3, 6, 9 of 12, δ 0.05, ε 0.1, policy auto. Their shadow tokens come from a
known model: at exit layer j the signal is uniform on [0, 1] and the layer's top-1 matches full
depth with probability sigmoid(10 (s - c_j)), so the true exit rate and disagreement of any
threshold set are computed on a large fresh sample. Time is simulated (tokens are stamped
from 26 hours back, the backdating guard widened to match); the flows run with that clock.

- What-if (`flows.what_if.what_if`): `--trials` windows of fresh traffic, on each
  `--sets-per-window` hand-edited sets (one P(match) level on every layer, drawn at random);
  `whatif_exit_rate_abs_err_max` is the largest |what-if exit rate - true exit rate| (target
  <= 0.02), `whatif_bound_coverage` the share of (window, set) trials whose true disagreement
  is within the reported bound (target >= 1 - ε; a bound at exactly 1 - ε covers that share on
  average, so the 95% interval of the share is printed beside it).
- Opportunity (`flows.operating_curve.refresh_deployment`, every `--interval-s`, the drift
  check's interval, over the last `--window-s`): the active set is certified on hard traffic
  (centres `HARD`); the traffic turns easier (centres `EASY`) with quality held (the active
  set's true disagreement stays within δ). `opportunity_retune_s` is the simulated time from
  the shift to the queued recalibration (target <= 3 x `drift_interval_s`); the job then runs
  (`flows.recalibration.run_calibration`, the deployment's policy and bounds), and
  `opportunity_exit_rate_ratio` is the true exit rate of the set then active over the oracle's
  best at δ on the easy traffic (the largest true exit rate, at true disagreement <= δ, of the
  sets whose every layer sits at one P(match) level; target >= 0.9).
- Stationary (`--stationary-hours` of traffic from one model, the active set certified on an
  earlier sample of it): a curve every `--stationary-interval-s` over that interval's tokens;
  `stationary_opportunity_retunes` counts the recalibrations queued (target 0) and
  `stationary_opportunity_findings` the checks that found one.

- Savings (`telemetry.savings`): three runtimes serve `--savings-tokens` tokens each under a
  certified set, a tenth of them shadow tokens, each reporting its exit checks and its wall
  time under a known cost model (`COST`) with lognormal noise; `savings_rel_err` is
  |reported net time saved - the true one| / |the true one| (target <= 0.05), the truth
  counting each token's own full-depth time (noise included), checks and shadow tokens.
- The adaptive shadow rate (`bench/shadow_rate.py`, `--shadow-rate-trials` drift onsets):
  `shadow_rate_reduction` (target >= 0.5) and `drift_delay_ratio` (target <= 1.5).
Printed: one JSON line with the figures, the settings used and the command line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
from scipy.special import expit, logit
from sqlalchemy import select

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controlplane.auth.service import create_token
from controlplane.calibration.learn_then_test import calibrate_thresholds
from controlplane.calibration.models import CalibrationJob, OperatingCurve
from controlplane.calibration.service import CalibrationPolicy
from controlplane.db import make_engine, session_scope
from controlplane.deployments.schemas import DeploymentCreate
from controlplane.deployments.service import (
    aliases_of,
    create_deployment,
    get_deployment,
    get_threshold_set,
    move_alias,
    publish,
)
from controlplane.flows import recalibration
from controlplane.flows.fallback import install
from controlplane.flows.operating_curve import refresh_deployment
from controlplane.flows.what_if import what_if
from controlplane.migrate import upgrade
from controlplane.runtimes.service import RuntimeCaps, record_heartbeat
from controlplane.runtimes.witnesses import witness_of
from controlplane.settings import Settings, get_settings
from controlplane.stats.exits import policy_outcomes
from controlplane.telemetry.savings import savings
from controlplane.telemetry.service import ingest
from exitplane.wire import Heartbeat, TelemetryBatch

LAYERS, FULL, DELTA, EPSILON = [3, 6, 9], 12, 0.05, 0.1
BASE = np.array([0.75, 0.65, 0.55])  # what-if and stationary traffic
HARD = np.array([0.85, 0.8, 0.75])  # before the shift
EASY = np.array([0.5, 0.4, 0.3])  # after it
RUNTIMES = ("rt-a", "rt-b", "rt-c")
TOKENS_PER_REQUEST = 8
START = datetime.now(UTC) - timedelta(hours=26)  # simulated time 0
# what a token costs the simulated runtimes (microseconds), before noise
COST = {"overhead_us": 300.0, "layer_us": 1100.0, "check_us": 40.0}


def traffic(n: int, rng, centres) -> tuple[np.ndarray, np.ndarray]:
    """`n` shadow tokens (signals, matched) of the known model with these centres."""
    signals = rng.random((n, len(LAYERS)))
    return signals, rng.random(signals.shape) < expit(10.0 * (signals - centres))


def truth(thresholds: dict[int, float], sample) -> tuple[float, float]:
    """(disagreement, exit rate) of `thresholds` on a large sample."""
    first, disagree = policy_outcomes(*sample, [thresholds[k] for k in LAYERS])
    return float(disagree.mean()), float((first < len(LAYERS)).mean())


def level_set(level: float, centres) -> dict[int, float]:
    """Every layer exits from the signal where P(match) reaches `level`."""
    return {k: float(np.clip(c + logit(level) / 10.0, 0.0, 1.0))
            for k, c in zip(LAYERS, centres, strict=True)}


def oracle_exit_rate(sample, centres) -> float:
    """The largest true exit rate at true disagreement <= δ over one-level sets."""
    best = 0.0
    for level in np.linspace(0.5, 0.999, 400):
        disagreement, exit_rate = truth(level_set(level, centres), sample)
        if disagreement <= DELTA:
            best = max(best, exit_rate)
    return best


def wilson(hits: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a share."""
    share = hits / trials
    centre = (share + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * np.sqrt(share * (1 - share) / trials + z * z / (4 * trials * trials)) / (
        1 + z * z / trials)
    return centre - half, centre + half


def at(seconds: float) -> datetime:
    return START + timedelta(seconds=seconds)


class Fleet:
    """Three runtimes, a runtime token each, heartbeating the version they apply and posting
    shadow tokens as POST /v1/telemetry stores them (the token as each batch's witness)."""

    def __init__(self, engine, name: str) -> None:
        self.engine, self.name, self.seq = engine, name, 0
        self.tokens = {}
        with session_scope(engine) as session:
            deployment = get_deployment(session=session, name=name)
            for runtime_id in RUNTIMES:
                row, _ = create_token(session=session, name=f"{name}/{runtime_id}",
                                      scope="runtime", deployment=deployment)
                self.tokens[runtime_id] = row.id

    def post(self, since_s: float, until_s: float, per_runtime: int, rng, centres,
             version: int, served: tuple[dict, float] | None = None) -> float:
        """Each runtime's `per_runtime` shadow tokens spread over [since_s, until_s). With
        `served` (thresholds, shadow share), tokens are served under the thresholds and that
        share of them shadowed, each reporting its wall time under COST (with noise) and its
        exit checks: the true net time saved (microseconds) is returned."""
        saved = 0.0
        caps = RuntimeCaps.from_settings(get_settings())
        with session_scope(self.engine) as session:
            deployment = get_deployment(session=session, name=self.name)
            for runtime_id in RUNTIMES:
                signals, matched = traffic(per_runtime, rng, centres)
                t0 = at(since_s).timestamp()
                spacing = (until_s - since_s) / per_runtime
                self.seq += 1
                records = [{"threshold_version": version,
                            "request_id": f"{self.seq}-{i // TOKENS_PER_REQUEST}",
                            "position": i % TOKENS_PER_REQUEST, "exit_layer": FULL,
                            "signal_value": float(signals[i, -1]), "latency_us": 900,
                            "ts": t0 + i * spacing,
                            "shadow": [{"layer": k, "signal": float(signals[i, j]),
                                        "matched": bool(matched[i, j])}
                                       for j, k in enumerate(LAYERS)]}
                           for i in range(per_runtime)]
                if served is not None:
                    saved += timed(records, signals, rng, *served)
                batch = TelemetryBatch(
                    batch_id=uuid.uuid5(uuid.NAMESPACE_URL,
                                        f"{self.name}/{runtime_id}/{self.seq}").hex,
                    deployment=self.name, runtime_id=runtime_id, seq=self.seq,
                    num_layers=FULL, records=records)
                token_id = self.tokens[runtime_id]
                record_heartbeat(session=session, deployment=deployment, caps=caps,
                                 token_id=token_id,
                                 beat=Heartbeat(runtime_id=runtime_id, applied_version=version))
                ingest(session=session, deployment=deployment, batches=[batch],
                       witnesses=[witness_of(token_id=token_id, runtime_id=runtime_id)])
        return saved


def timed(records: list[dict], signals: np.ndarray, rng, thresholds: dict[int, float],
          shadow_share: float) -> float:
    """Turn `records` into served tokens: each exits where `thresholds` let it (a
    `shadow_share` of them stay shadow tokens at full depth, every check), with its exit checks
    and its wall time under COST times lognormal noise; the true net time saved (us)."""
    first, _ = policy_outcomes(signals, np.ones(signals.shape, dtype=bool),
                               [thresholds[k] for k in LAYERS])
    saved = 0.0
    for i, record in enumerate(records):
        shadow = rng.random() < shadow_share
        if shadow or first[i] == len(LAYERS):
            depth, checks = FULL, len(LAYERS)
        else:
            depth, checks = LAYERS[first[i]], int(first[i]) + 1
        if not shadow:
            del record["shadow"]
        wall = COST["overhead_us"] + COST["layer_us"] * depth + COST["check_us"] * checks
        wall *= float(rng.lognormal(0.0, 0.1))
        record |= {"exit_layer": depth, "exit_checks": checks, "latency_us": round(wall)}
        full = (COST["overhead_us"] + COST["layer_us"] * FULL) * float(rng.lognormal(0.0, 0.1))
        saved += full - wall
    return saved


def savings_run(engine, args, rng) -> dict:
    """Served tokens with known costs through the store: the savings' net time saved against
    the simulated truth (checks and shadow tokens included)."""
    thresholds = certified(rng, BASE, 30_000)
    version = new_deployment(engine, "savings", thresholds)
    fleet = Fleet(engine, "savings")
    truth_us = fleet.post(0.0, 600.0, args.savings_tokens, rng, BASE, version,
                          served=(thresholds, 0.1))
    with session_scope(engine) as session:
        (report,) = savings(session=session, since=at(-60.0), until=at(660.0),
                            deployments=[get_deployment(session=session, name="savings")])
    reported_s = (report.get("time") or {}).get("net_saved_s")
    if reported_s is None:
        return {"savings_rel_err": None, "savings_note": report.get("cost_model_reason")}
    true_s = truth_us / 1e6
    return {"savings_rel_err": round(abs(reported_s - true_s) / abs(true_s), 4),
            "savings_net_saved_s": {"reported": round(reported_s, 3), "true": round(true_s, 3)},
            "savings_tokens": args.savings_tokens * len(RUNTIMES)}


def new_deployment(engine, name: str, active: dict[int, float] | None = None) -> int:
    """A deployment (policy auto) with `active` published and active; the active version."""
    with session_scope(engine) as session:
        deployment = create_deployment(session=session, actor="bench", spec=DeploymentCreate(
            name=name, model_ref="sim", num_layers=FULL, exit_layers=LAYERS, delta=DELTA,
            epsilon=EPSILON, policy="auto"))
        if active is None:
            return aliases_of(session=session, deployment=deployment)["active"]
        made = publish(session=session, deployment=deployment, thresholds=active,
                       reason="certified earlier", actor="bench")
        move_alias(session=session, deployment=deployment, alias="active",
                   version=made.version, actor="bench", reason="certified earlier")
        return made.version


def certified(rng, centres, n: int) -> dict[int, float]:
    """The set a calibration certifies on an earlier sample of this traffic."""
    signals, matched = traffic(n, rng, centres)
    requests = np.arange(n) // TOKENS_PER_REQUEST
    return calibrate_thresholds(signals=signals, matched=matched, exit_layers=LAYERS,
                                num_layers=FULL, delta=DELTA, epsilon=EPSILON,
                                requests=requests, seed=int(rng.integers(1 << 30))).thresholds


def whatif_trials(engine, args, rng, sample) -> dict:
    """What-if on `--trials` windows of fresh traffic, a few sets each, against the truth."""
    new_deployment(engine, "whatif")
    fleet = Fleet(engine, "whatif")
    policy = CalibrationPolicy(min_samples_per_layer=300, seed=0)
    errors, covered, trials = [], 0, 0
    for trial in range(args.trials):
        since_s = trial * 600.0
        fleet.post(since_s, since_s + 600.0, args.whatif_tokens, rng, BASE, version=1)
        for level in rng.uniform(0.6, 0.97, size=args.sets_per_window):
            thresholds = level_set(level, BASE)
            with session_scope(engine) as session:
                found = what_if(session=session,
                                deployment=get_deployment(session=session, name="whatif"),
                                thresholds={str(k): v for k, v in thresholds.items()},
                                since=at(since_s), until=at(since_s + 600.0), policy=policy)
            disagreement, exit_rate = truth(thresholds, sample)
            errors.append(abs(found.exit_rate - exit_rate))
            covered += disagreement <= found.disagreement_bound
            trials += 1
    return {"whatif_exit_rate_abs_err_max": round(max(errors), 4),
            "whatif_exit_rate_abs_err_mean": round(float(np.mean(errors)), 4),
            "whatif_bound_coverage": round(covered / trials, 4),
            "whatif_bound_coverage_ci95": [round(bound, 4) for bound in wilson(covered, trials)],
            "whatif_trials": trials,
            "whatif_tokens_per_window": args.whatif_tokens * len(RUNTIMES)}


def opportunity_run(engine, args, rng, settings) -> dict:
    """Hard traffic, then easier traffic with quality held: when is a re-tune queued, and
    how close to the oracle does the set it promotes come."""
    easy_sample = traffic(400_000, np.random.default_rng(7), EASY)
    active = certified(rng, HARD, 30_000)
    version = new_deployment(engine, "shift", active)
    fleet = Fleet(engine, "shift")
    step, per_step = args.interval_s, int(args.tokens_per_s * args.interval_s)
    shift_s = args.window_s + step
    t, queued_s, job_id, false_before = 0.0, None, None, 0
    while t < shift_s + 20 * step:
        centres = HARD if t < shift_s else EASY
        fleet.post(t, t + step, per_step, rng, centres, version)
        t += step
        with session_scope(engine) as session:
            done = refresh_deployment(session=session, settings=settings, now=at(t),
                                      deployment=get_deployment(session=session, name="shift"))
        found = done["segments"]["default"]["opportunity"]
        if found is not None and t <= shift_s:
            false_before += 1
        elif found is not None:
            queued_s, job_id = t - shift_s, found
            break
    result = {"opportunity_retune_s": queued_s, "opportunity_false_before_shift": false_before,
              "active_true_disagreement_on_easy": round(truth(active, easy_sample)[0], 4)}
    if job_id is None:
        return result
    policy = CalibrationPolicy.from_settings(settings)
    with session_scope(engine) as session:
        job = recalibration.run_calibration(session=session,
                                            job=session.get(CalibrationJob, job_id),
                                            policy=policy, now=at(t))
        status, promotion = job.status, job.promotion
        deployment = get_deployment(session=session, name="shift")
        now_active = get_threshold_set(session=session, deployment=deployment,
                                       version=aliases_of(session=session,
                                                          deployment=deployment)["active"])
        thresholds = now_active.thresholds_by_layer()
    disagreement, exit_rate = truth(thresholds, easy_sample)
    oracle = oracle_exit_rate(easy_sample, EASY)
    return result | {"opportunity_job": {"status": status, "promotion": promotion},
                     "opportunity_exit_rate_ratio": round(exit_rate / oracle, 4),
                     "opportunity_active_true_disagreement": round(disagreement, 4),
                     "opportunity_oracle_exit_rate": round(oracle, 4)}


def stationary_run(engine, args, rng, settings) -> dict:
    """Stationary traffic for `--stationary-hours`: opportunity checks and re-tunes."""
    version = new_deployment(engine, "steady", certified(rng, BASE, 30_000))
    fleet = Fleet(engine, "steady")
    interval = args.stationary_interval_s
    checks = int(args.stationary_hours * 3600 // interval)
    steady = settings.model_copy(update={"operating_curve_window_s": interval})
    per_check = int(args.stationary_tokens_per_s * interval)
    findings = 0
    for check in range(checks):
        fleet.post(check * interval, (check + 1) * interval, per_check, rng, BASE, version)
        with session_scope(engine) as session:
            deployment = get_deployment(session=session, name="steady")
            refresh_deployment(session=session, deployment=deployment, settings=steady,
                               now=at((check + 1) * interval))
            row = session.scalars(select(OperatingCurve).where(
                OperatingCurve.deployment_id == deployment.id)).one()
            findings += bool(row.opportunity and row.opportunity["qualifies"])
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="steady")
        retunes = len(session.scalars(select(CalibrationJob.id).where(
            CalibrationJob.deployment_id == deployment.id,
            CalibrationJob.trigger == "opportunity")).all())
    return {"stationary_opportunity_retunes": retunes,
            "stationary_opportunity_findings": findings, "stationary_checks": checks,
            "stationary_hours": args.stationary_hours,
            "stationary_tokens_per_check": per_check * len(RUNTIMES)}


def others(args) -> dict:
    """Figures other modules measure: the adaptive shadow rate's (`bench/shadow_rate.py`)."""
    from bench.shadow_rate import run as shadow_rate_run

    found = shadow_rate_run(seed=args.seed % 1000, trials=args.shadow_rate_trials)
    return {key: found[key] for key in ("shadow_rate_reduction", "drift_delay_ratio")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--trials", type=int, default=60, help="what-if windows")
    parser.add_argument("--sets-per-window", type=int, default=1,
                        help="hand-edited sets evaluated on each what-if window")
    parser.add_argument("--whatif-tokens", type=int, default=3000,
                        help="shadow tokens per runtime and what-if window")
    parser.add_argument("--interval-s", type=float, default=30.0,
                        help="the drift check's interval; the curve is redrawn as often")
    parser.add_argument("--window-s", type=float, default=120.0,
                        help="the curve's window during the shift")
    parser.add_argument("--tokens-per-s", type=float, default=50.0,
                        help="shadow tokens per runtime and second during the shift")
    parser.add_argument("--stationary-hours", type=float, default=24.0)
    parser.add_argument("--stationary-interval-s", type=float, default=1800.0)
    parser.add_argument("--stationary-tokens-per-s", type=float, default=1.0)
    parser.add_argument("--savings-tokens", type=int, default=4000,
                        help="served tokens per runtime whose savings are measured")
    parser.add_argument("--shadow-rate-trials", type=int, default=3,
                        help="drift onsets bench/shadow_rate.py simulates")
    parser.add_argument("--seed", type=int, default=20261205)
    args = parser.parse_args()
    if args.quick:
        args.trials, args.stationary_hours = 15, 6.0
    logging.disable(logging.WARNING)
    started = time.monotonic()
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory() as folder:
        url = f"sqlite:///{folder}/curve.db"
        os.environ["EXITPLANE_DATABASE_URL"] = url
        os.environ["EXITPLANE_VAR_DIR"] = folder
        # the clock is simulated from 26 hours back: evidence is not refused as backdated
        os.environ["EXITPLANE_EVIDENCE_MAX_DELAY_S"] = str(30 * 3600)
        get_settings.cache_clear()
        install()
        upgrade(url)
        engine = make_engine(url)
        settings = Settings(database_url=url, var_dir=Path(folder),
                            operating_curve_interval_s=args.interval_s,
                            operating_curve_window_s=args.window_s,
                            calibration_min_samples=1000)
        sample = traffic(400_000, np.random.default_rng(5), BASE)
        figures = whatif_trials(engine, args, rng, sample)
        figures |= opportunity_run(engine, args, rng, settings)
        figures |= stationary_run(engine, args, rng, settings)
        figures |= savings_run(engine, args, rng)
        engine.dispose()
    figures |= others(args)
    print(json.dumps(figures | {
        "drift_interval_s": args.interval_s, "curve_window_s": args.window_s,
        "opportunity_min_gain": settings.opportunity_min_gain, "delta": DELTA,
        "epsilon": EPSILON, "runtimes": len(RUNTIMES),
        "seconds": round(time.monotonic() - started, 1),
        "command": " ".join([".venv/bin/python -P bench/operating_curve.py", *sys.argv[1:]])}))


if __name__ == "__main__":
    main()
