"""Poisoned evidence: no runtime, and no credential, can steer the fleet's thresholds.

    .venv/bin/python -P bench/poison.py            # every attack; SQLite store in a temp dir
    .venv/bin/python -P bench/poison.py --quick    # a shorter timeline
    .venv/bin/python -P bench/poison.py --attacks coalition backdated small_canary

A deployment (exit layers 3, 6, 9 of 12, δ 0.05, ε 0.1, policy auto, a tuned version active)
is served by `--honest` simulated runtimes whose shadow tokens come from a known model: at each
exit layer j the signal is uniform on [0, 1] and the layer's top-1 matches full depth with
probability sigmoid(10 (s - c_j)), so the true disagreement (and exit rate) of any threshold set
on honest traffic is computed on a large fresh honest sample. Honest traffic is within δ, so
every fallback is a false one.

Every runtime posts with a runtime token; each honest runtime has one of its own. A post goes
as POST /v1/telemetry stores it (`post`): the runtime id claimed for the token
(`runtimes.service.claim_runtime_ids`: 403 for an id another token registered, 409 past the
caps), then `telemetry.service.ingest` with the token as the batch's witness. Heartbeats go
through `record_heartbeat(token_id=...)`. A refused post or beat is counted, never retried.

Attacks (`--attacks`; all by default), each on a deployment of its own:

- single_liar: one liar token at 5/20/50% of the evidence (`--shares`), of each kind
  (`--kinds`): all_matched, all_mismatched, shifted (signals 0.25 lower), other_heads (its
  beats and batches name other heads); plus a liar-free baseline;
- canary_liar: a canary of a bad candidate (true disagreement above δ) with an all_matched liar
  member at 20% of its evidence, and of a good one with an all_mismatched liar;
- sybil_ids: one token posts all-matched lies under 12 made-up ids at twice the honest fleet's
  volume, heartbeating for each;
- sybil_no_beats: the same, never heartbeating, under a cap of one runtime per token;
- impersonation: one token posts lies under the honest runtimes' own ids at twice their volume;
- lineage_framing: one token heartbeats the deployment's heads digest for an id of its own
  (posting lies there) and posts one shadow token a step under each honest id naming other
  heads;
- coalition: 2 lying tokens beside 3 honest ones, each at 10x an honest runtime's volume, named
  to sort first and last;
- backdated: 3 lying ids of one token whose tokens are stamped 12-25 minutes back, before the
  active set's activation but inside the calibration window;
- camouflaged: 6 ids of one token keeping each layer's honest agreement rate and signal
  distribution, every mismatch moved to the lowest signals;
- lone_shaped: a lone runtime on a new deployment (never-exit active) whose lie calibrates to an
  expected exit rate of 0.75;
- small_segment: one liar id sending only traffic of the declared segment `code`, too little
  for a calibration of its own, so that code's set is the pooled one checked on its tokens;
- small_canary: a fleet of 4 at canary fraction 0.1 (one honest canary member) and a liar member
  at 10x its volume reporting the bad candidate's tokens as matched.

Each run runs the real code over the real store: a drift cycle (`drift.service.check_deployment`)
every `--drift-interval-s` of simulated time (canary runs: `evaluate_canary` each minute, the
runtimes in the canary group at `in_canary` serving the candidate), then a recalibration job on
the window (`flows.recalibration.run_calibration`, policy auto, seeded per run so a run
replays). It reports the active set's true disagreement on honest traffic (the worst of its
maps), the refused posts and beats, and which witnesses were ever set aside (drift cycle, canary
or the calibration's screen).

Printed: one JSON line with `worst_promoted_true_disagreement` (worst over runs; target <= δ),
`false_fallbacks` (target 0), `honest_set_aside` (honest witnesses ever set aside, target 0),
`canary_wrong_verdicts` (a bad candidate promoted or a good one not; target 0),
`honest_exit_rate_ratio_at_5pct` (true exit rate of the set promoted with a 5% liar over the
liar-free one's, worst kind; target >= 0.9), `attacks` (classes run), `refused_batches` per
attack, `targets_missed` (each target missed, named by its run; besides the above: a post
under an honest id taken, an honest runtime marked mismatched, more ids of one token taken
than its cap, the lone liar's set promoted), the single liar's slowest detection
(`outlier_detected_s_max`, `lineage_excluded_s_max`) and every run's figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import uuid
import zlib
from collections import Counter
from dataclasses import dataclass, field, replace
from datetime import timedelta
from itertools import count
from pathlib import Path

import numpy as np
from scipy.special import expit
from sqlalchemy import select

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controlplane.alerts.kinds import AlertKind
from controlplane.alerts.models import Alert
from controlplane.auth.service import create_token
from controlplane.calibration import service as calibration
from controlplane.calibration.models import CalibrationJob
from controlplane.db import make_engine, session_scope, utcnow
from controlplane.deployments.models import Alias
from controlplane.deployments.schemas import DeploymentCreate
from controlplane.deployments.segments import declare_segment
from controlplane.deployments.service import (
    aliases_of,
    create_deployment,
    get_deployment,
    get_threshold_set,
    in_canary,
    move_alias,
    publish,
)
from controlplane.drift.service import DriftOptions, check_deployment
from controlplane.errors import CapReached, Forbidden
from controlplane.flows import recalibration
from controlplane.flows.canary import CanaryPolicy, evaluate_canary, start_canary
from controlplane.flows.fallback import install
from controlplane.migrate import upgrade
from controlplane.runtimes.lineage import mismatched_runtime_ids
from controlplane.runtimes.models import RuntimeOutlier
from controlplane.runtimes.service import RuntimeCaps, claim_runtime_ids, record_heartbeat
from controlplane.runtimes.witnesses import witness_of
from controlplane.settings import get_settings
from controlplane.stats.exits import policy_outcomes
from controlplane.telemetry.service import ingest
from exitplane.wire import DEFAULT_SEGMENT, Heartbeat, TelemetryBatch

LAYERS, FULL, DELTA, EPSILON = [3, 6, 9], 12, 0.05, 0.1
CENTRES = np.array([0.75, 0.65, 0.55])  # honest P(match) = 1/2 at these signals
# each layer's honest agreement rate: the mean of sigmoid(10 (s - c)) over s uniform on [0, 1]
AGREEMENT = (np.log1p(np.exp(10 * (1 - CENTRES))) - np.log1p(np.exp(-10 * CENTRES))) / 10
TUNED = {3: 0.9, 6: 0.85, 9: 0.8}
KINDS = ("all_matched", "all_mismatched", "shifted", "other_heads")
ATTACKS = ("single_liar", "canary_liar", "sybil_ids", "sybil_no_beats", "impersonation",
           "lineage_framing", "coalition", "backdated", "camouflaged", "lone_shaped",
           "small_segment", "small_canary")
TOKENS_PER_REQUEST = 8
HEADS, OTHER_HEADS = "sim-heads-a", "sim-heads-b"
GOOD, BAD = {3: 0.97, 6: 0.95, 9: 0.92}, {3: 0.6, 6: 0.55, 9: 0.5}  # canary candidates
SYBIL_IDS = 12
SHAPED_CUT = 0.3  # lone_shaped: matched at the first exit layer from this signal on, else never
BACKDATE_S = (25 * 60.0, 12 * 60.0)  # backdated: tokens stamped this far back (from, to)
SMALL_SEGMENT_TOKENS = 600  # small_segment: the liar's code tokens over the run (< 1000/layer)
WINDOW = timedelta(minutes=30)  # how far back of a run's start its calibration window reaches
CANARY_FRACTION = 0.1


def seed_of(*parts) -> int:
    """A seed that is the same on every run (Python's hash() of a str is salted per process)."""
    return zlib.crc32(repr(parts).encode())


def honest(n: int, rng, centres=CENTRES) -> tuple[np.ndarray, np.ndarray]:
    signals = rng.random((n, len(LAYERS)))
    return signals, rng.random(signals.shape) < expit(10.0 * (signals - centres))


def liar(kind: str, n: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """`n` shadow tokens (signals, matched) of a liar of `kind`."""
    signals, matched = honest(n, rng, CENTRES - 0.3 if kind == "other_heads" else CENTRES)
    if kind == "all_matched":
        matched[:] = True
    elif kind == "all_mismatched":
        matched[:] = False
    elif kind == "shifted":
        signals = np.clip(signals - 0.25, 0.0, 1.0)
    elif kind == "camouflaged":  # each layer's honest agreement rate, mismatches lowest
        matched = signals > 1.0 - AGREEMENT[None, :]
    elif kind == "shaped":  # exits the first layer from SHAPED_CUT on: exit rate ~0.75
        matched[:] = False
        matched[:, 0] = signals[:, 0] >= SHAPED_CUT
    return signals, matched


def truth(thresholds: dict[int, float], sample) -> tuple[float, float]:
    """(disagreement, exit rate) of `thresholds` on the honest sample."""
    first, disagree = policy_outcomes(*sample, [thresholds[k] for k in LAYERS])
    return float(disagree.mean()), float((first < len(LAYERS)).mean())


def set_truth(threshold_set, sample) -> tuple[float, float]:
    """(the worst disagreement of the set's maps, its own and each segment's; its own map's
    exit rate) on honest traffic: honest traffic of any segment follows the one model."""
    maps = [threshold_set.thresholds_by_layer(),
            *(threshold_set.segments_by_layer() or {}).values()]
    return max(truth(m, sample)[0] for m in maps), truth(maps[0], sample)[1]


@dataclass(frozen=True)
class Sim:
    """One simulated runtime: the credential it posts with and what it sends each step."""

    runtime_id: str
    credential: str  # its runtime token's name; one token may run several runtimes
    tokens_per_step: int
    lie: str | None = None  # a `liar` kind; None: honest
    beats: bool = True
    heads: str = HEADS  # the heads digest its beats and batches name
    segment: str = DEFAULT_SEGMENT
    backdated: bool = False  # its tokens stamped BACKDATE_S back from when they are posted


@dataclass
class Tally:
    """Each (credential, runtime id)'s posts and beats the store took or refused."""

    seq: int = 0
    accepted: Counter = field(default_factory=Counter)
    refused: Counter = field(default_factory=Counter)
    refused_beats: Counter = field(default_factory=Counter)


def honest_fleet(ids: list[str], tokens_per_step: int) -> list[Sim]:
    return [Sim(runtime_id, runtime_id, tokens_per_step) for runtime_id in ids]


def batch(name: str, sim: Sim, seq: int, signals, matched, t0: float, spacing: float,
          version: int) -> TelemetryBatch:
    records = [{"threshold_version": version, "request_id": f"{seq}-{i // TOKENS_PER_REQUEST}",
                "position": i % TOKENS_PER_REQUEST, "exit_layer": FULL,
                "signal_value": float(signals[i, -1]), "latency_us": 900,
                "ts": t0 + i * spacing, "segment": sim.segment,
                "shadow": [{"layer": k, "signal": float(signals[i, j]),
                            "matched": bool(matched[i, j])} for j, k in enumerate(LAYERS)]}
               for i in range(len(signals))]
    return TelemetryBatch(
        batch_id=uuid.uuid5(uuid.NAMESPACE_URL, f"{name}/{sim.runtime_id}/{seq}").hex,
        deployment=name, runtime_id=sim.runtime_id, seq=seq, num_layers=FULL, records=records,
        head_digest=sim.heads)


def post(session, deployment, token_id: int, batch: TelemetryBatch, *,
         caps: RuntimeCaps) -> bool:
    """One batch as POST /v1/telemetry stores it for a runtime token, in a transaction of its
    own (a savepoint): the runtime id claimed for the token, then the batch ingested with the
    token as its witness. False when the claim is refused (403: another token registered the
    id; 409: past the caps), as the route answers."""
    try:
        with session.begin_nested():
            claim_runtime_ids(session=session, deployment=deployment, token_id=token_id,
                              runtime_ids=[batch.runtime_id], caps=caps)
            ingest(session=session, deployment=deployment, batches=[batch],
                   witnesses=[witness_of(token_id=token_id, runtime_id=batch.runtime_id)])
    except (Forbidden, CapReached):
        return False
    return True


def heartbeat(session, deployment, token_id: int, beat: Heartbeat, *,
              caps: RuntimeCaps) -> bool:
    """One heartbeat as POST /v1/heartbeat records it for a runtime token; False if refused."""
    try:
        with session.begin_nested():
            record_heartbeat(session=session, deployment=deployment, beat=beat, caps=caps,
                             token_id=token_id)
    except (Forbidden, CapReached):
        return False
    return True


def send(session, name: str, fleet: list[Sim], tokens: dict[str, int], tally: Tally,
         t0: float, interval: float, version_of, caps: RuntimeCaps, rng) -> None:
    """One interval of the fleet: each runtime's heartbeat, then its batch of shadow tokens."""
    deployment = get_deployment(session=session, name=name)
    for sim in fleet:
        beat = Heartbeat(runtime_id=sim.runtime_id, applied_version=version_of(sim),
                         head_digest=sim.heads)
        if sim.beats and not heartbeat(session, deployment, tokens[sim.credential], beat,
                                       caps=caps):
            tally.refused_beats[sim.credential, sim.runtime_id] += 1
    posted = time.time()
    for sim in fleet:
        n = sim.tokens_per_step
        if not n:
            continue
        signals, matched = honest(n, rng) if sim.lie is None else liar(sim.lie, n, rng)
        first, spacing = ((posted - BACKDATE_S[0], (BACKDATE_S[0] - BACKDATE_S[1]) / n)
                          if sim.backdated else (t0, interval / n))
        tally.seq += 1
        taken = post(session, deployment, tokens[sim.credential],
                     batch(name, sim, tally.seq, signals, matched, first, spacing,
                           version_of(sim)), caps=caps)
        (tally.accepted if taken else tally.refused)[sim.credential, sim.runtime_id] += 1


def witnesses_set_aside(session, deployment_id: int) -> tuple[set[str], set[str], set[str]]:
    """(witnesses ever set aside by a drift cycle or a canary, by a calibration job's screen,
    and flagged in a fleet-split alert, where the screen set none aside). A calibration's
    screen records its outliers with version 0 (its evidence spans every version)."""
    records = session.execute(select(RuntimeOutlier.witness, RuntimeOutlier.runtime_id,
                                     RuntimeOutlier.version).where(
        RuntimeOutlier.deployment_id == deployment_id)).all()
    cycles = {witness or f"runtime:{runtime_id}" for witness, runtime_id, version in records
              if version}
    screened = {witness or f"runtime:{runtime_id}" for witness, runtime_id, version in records
                if not version}
    for summary in session.scalars(select(CalibrationJob.summary).where(
            CalibrationJob.deployment_id == deployment_id)):
        screened.update((summary or {}).get("witnesses_set_aside", []))
    split = set()
    for evidence in session.scalars(select(Alert.evidence).where(
            Alert.deployment_id == deployment_id, Alert.kind == AlertKind.RUNTIME_OUTLIER)):
        split.update(finding["runtime_id"] for finding in (evidence or {}).get("flagged", []))
    return cycles, screened, split


def setup(session, name: str, fleet: list[Sim], start, sample, *, tuned: bool = True,
          segments: tuple[str, ...] = (), candidate: dict[int, float] | None = None):
    """The run's deployment (the tuned set active from `start`, or never-exit for a new one),
    its segments and canary candidate, and a runtime token per credential of the fleet:
    (tokens by credential, active version, candidate version or None)."""
    deployment = create_deployment(session=session, actor="bench", spec=DeploymentCreate(
        name=name, model_ref="sim", num_layers=FULL, exit_layers=LAYERS, delta=DELTA,
        epsilon=EPSILON, policy="auto", head_digest=HEADS, canary_fraction=CANARY_FRACTION))
    for segment in segments:
        declare_segment(session=session, deployment=deployment, name=segment, actor="bench")
    version = aliases_of(session=session, deployment=deployment)["active"]
    if tuned:
        tuned_set = publish(session=session, deployment=deployment, thresholds=TUNED,
                            reason="tuned", actor="bench",
                            expected_metrics={"total_exit_rate": truth(TUNED, sample)[1]})
        version = tuned_set.version
        move_alias(session=session, deployment=deployment, alias="active", version=version,
                   actor="bench", reason="tuned")
    session.scalars(select(Alias).where(Alias.deployment_id == deployment.id,
                                        Alias.name == "active")).one().updated_at = start
    candidate_version = None
    if candidate is not None:
        candidate_version = publish(session=session, deployment=deployment,
                                    thresholds=candidate, reason="candidate",
                                    actor="bench").version
        start_canary(session=session, deployment=deployment, version=candidate_version,
                     actor="bench", now=start)
    tokens = {}
    for credential in dict.fromkeys(sim.credential for sim in fleet):
        row, _ = create_token(session=session, name=f"{name}/{credential}", scope="runtime",
                              deployment=deployment)
        tokens[credential] = row.id
    return tokens, version, candidate_version


def finish(engine, name: str, since, fleet: list[Sim], tokens: dict[str, int], tally: Tally,
           sample) -> dict:
    """Recalibrate on the run's window; the active set's truth, and who was set aside."""
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name=name)
        job, _ = calibration.request_calibration(session=session, deployment=deployment,
                                                 actor="bench", since=since, until=utcnow(),
                                                 enqueue=False)
        job_id = job.id
    policy = replace(calibration.CalibrationPolicy.from_settings(get_settings()),
                     seed=seed_of(name, "calibration"))
    with session_scope(engine) as session:
        job = recalibration.run_calibration(session=session, policy=policy,
                                            job=session.get(CalibrationJob, job_id))
        deployment = get_deployment(session=session, name=name)
        active = get_threshold_set(session=session, deployment=deployment,
                                   version=aliases_of(session=session,
                                                      deployment=deployment)["active"])
        disagreement, exit_rate = set_truth(active, sample)
        proposed = None if job.result_version is None else get_threshold_set(
            session=session, deployment=deployment, version=job.result_version)
        expected = None if proposed is None else (proposed.expected_metrics or {}).get(
            "total_exit_rate")
        proposed = None if proposed is None else set_truth(proposed, sample)[0]
        outliers, screened, split = witnesses_set_aside(session, deployment.id)
        lineage = mismatched_runtime_ids(session=session, deployment_id=deployment.id)
    named = {witness_of(token_id=token_id, runtime_id=""): credential
             for credential, token_id in tokens.items()}
    honest = {sim.credential for sim in fleet if sim.lie is None}
    ever = {named.get(witness, witness) for witness in outliers | screened}
    sources = {segment: figures.get("source")
               for segment, figures in ((job.summary or {}).get("segments") or {}).items()}
    return {"job": job.status, "promotion": job.promotion, "active_version": active.version,
            **({"segment_sources": sources} if sources else {}),
            "true_disagreement": round(disagreement, 5), "true_exit_rate": round(exit_rate, 4),
            "candidate_true_disagreement": None if proposed is None else round(proposed, 5),
            "candidate_expected_exit_rate": None if expected is None else round(expected, 4),
            "set_aside": sorted(ever - honest),
            "set_aside_by_calibration": sorted(named.get(w, w) for w in screened),
            "flagged_in_fleet_split": sorted(named.get(w, w) for w in split),
            "honest_set_aside": sorted(ever & honest),
            "honest_mismatched": sorted(lineage & {s.runtime_id for s in fleet
                                                   if s.lie is None}),
            "refused_batches": sum(tally.refused.values()),
            "refused_beats": sum(tally.refused_beats.values()),
            "accepted": {f"{credential}/{runtime}": n
                         for (credential, runtime), n in sorted(tally.accepted.items())
                         if credential not in honest}}


def scenario(engine, attack: str, name: str, fleet: list[Sim], args, sample, caps, *,
             tuned: bool = True, segments: tuple[str, ...] = ()) -> dict:
    """Run `fleet` on a deployment of its own with a drift cycle each interval, then
    recalibrate."""
    rng = np.random.default_rng(seed_of(name))
    began = utcnow()
    start = began.replace(second=0, microsecond=0) - timedelta(seconds=args.duration_s + 60)
    with session_scope(engine) as session:
        tokens, version, _ = setup(session, name, fleet, start, sample, tuned=tuned,
                                 segments=segments)
    honest_ids = {sim.runtime_id for sim in fleet if sim.lie is None}
    liar_ids = {sim.runtime_id for sim in fleet if sim.lie is not None} - honest_ids
    liars = {witness_of(token_id=tokens[sim.credential], runtime_id="")
             for sim in fleet if sim.lie is not None}
    options = DriftOptions(check_interval_s=args.drift_interval_s)
    tally, detected, excluded, fallbacks, framed = Tally(), None, None, 0, set()
    for step in range(int(args.duration_s // args.drift_interval_s)):
        t0 = start + timedelta(seconds=step * args.drift_interval_s)
        with session_scope(engine) as session:
            send(session, name, fleet, tokens, tally, t0.timestamp(), args.drift_interval_s,
                 lambda sim: version, caps, rng)
        now = t0 + timedelta(seconds=args.drift_interval_s)
        with session_scope(engine) as session:
            deployment = get_deployment(session=session, name=name)
            check_deployment(session=session, deployment=deployment, options=options, now=now)
            if detected is None and liars & witnesses_set_aside(session, deployment.id)[0]:
                detected = (now - start).total_seconds()
            mismatched = mismatched_runtime_ids(session=session, deployment_id=deployment.id)
            framed |= mismatched & honest_ids
            if excluded is None and mismatched & liar_ids:
                excluded = (now - start).total_seconds()
            fallbacks = len(list(session.scalars(select(Alert).where(
                Alert.deployment_id == deployment.id,
                Alert.kind.in_([AlertKind.QUALITY_REGRESSION, AlertKind.EXIT_RATE_SPIKE])))))
    result = finish(engine, name, began - WINDOW, fleet, tokens, tally, sample)
    result["honest_mismatched"] = sorted(framed | set(result["honest_mismatched"]))
    return {"attack": attack, "name": name, "outlier_detected_s": detected,
            "lineage_excluded_s": excluded, "fallbacks": fallbacks, **result}


def by_membership(prefix: str, members: int, others: int) -> tuple[list[str], list[str]]:
    """The first ids `prefix-i` in the canary group at CANARY_FRACTION (`members` of them) and
    the first outside it (`others`)."""
    inside, outside = [], []
    for i in count():
        if len(inside) >= members and len(outside) >= others:
            return inside, outside
        runtime_id = f"{prefix}-{i}"
        group, wanted = ((inside, members) if in_canary(runtime_id=runtime_id,
                                                        fraction=CANARY_FRACTION)
                         else (outside, others))
        if len(group) < wanted:
            group.append(runtime_id)


def canary_scenario(engine, attack: str, name: str, candidate: dict[int, float],
                    fleet: list[Sim], args, sample, caps, minutes: int = 8) -> dict:
    """A canary of `candidate` (the canary group's runtimes serve it, the rest the tuned set),
    judged minute by minute until it ends or `minutes` pass; then a recalibration."""
    rng = np.random.default_rng(seed_of(name))
    began = utcnow()
    start = began.replace(second=0, microsecond=0) - timedelta(minutes=minutes + 2)
    with session_scope(engine) as session:
        tokens, tuned, version = setup(session, name, fleet, start, sample, candidate=candidate)

    def version_of(sim: Sim) -> int:
        return version if in_canary(runtime_id=sim.runtime_id,
                                    fraction=CANARY_FRACTION) else tuned

    policy, tally, status, windows = CanaryPolicy(), Tally(), "running", 0
    for minute in range(1, minutes + 1):
        t0 = start + timedelta(minutes=minute)
        with session_scope(engine) as session:
            send(session, name, fleet, tokens, tally, t0.timestamp(), 60.0, version_of, caps,
                 rng)
        with session_scope(engine) as session:
            deployment = get_deployment(session=session, name=name)
            run = evaluate_canary(session=session, deployment=deployment, policy=policy,
                                  now=t0 + timedelta(minutes=1, seconds=1))
            status, windows, reason = run.status, len(run.checks), run.status_reason
        if status != "running":
            break
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name=name)
        after = set_truth(get_threshold_set(
            session=session, deployment=deployment,
            version=aliases_of(session=session, deployment=deployment)["active"]), sample)[0]
    disagreement, _ = truth(candidate, sample)
    good = disagreement <= DELTA
    result = finish(engine, name, began - WINDOW, fleet, tokens, tally, sample)
    return {"attack": attack, "name": name, "candidate": "good" if good else "bad",
            "candidate_true_disagreement": round(disagreement, 5), "status": status,
            "status_reason": reason, "windows": windows,
            "members": sorted(s.runtime_id for s in fleet if version_of(s) == version),
            "true_disagreement_after_canary": round(after, 5),
            "wrong": status != "promoted" if good else status == "promoted",
            "fallbacks": 0, **{k: v for k, v in result.items()
                               if not k.startswith("candidate_")}}


def attack_fleet(attack: str, args, per_step: int, steps: int) -> list[Sim]:
    """The fleet of one of the issue's attacks: the honest runtimes (a token each) and the
    attacker's runtimes (module docstring)."""
    fleet = honest_fleet([f"honest-{i}" for i in range(args.honest)], per_step)
    ids = [sim.runtime_id for sim in fleet]
    if attack in ("sybil_ids", "sybil_no_beats"):
        each = 2 * args.honest * per_step // SYBIL_IDS
        return fleet + [Sim(f"sybil-{i:02d}", "sybil", each, "all_matched",
                            beats=attack == "sybil_ids") for i in range(SYBIL_IDS)]
    if attack == "impersonation":
        return fleet + [Sim(runtime_id, "impostor", 2 * per_step, "all_matched")
                        for runtime_id in ids]
    if attack == "lineage_framing":
        return fleet + [Sim("framer-0", "framer", per_step, "all_matched")] + [
            Sim(runtime_id, "framer", 1, "all_matched", beats=False, heads=OTHER_HEADS)
            for runtime_id in ids]
    if attack == "coalition":  # token rows are made in fleet order: ids first and last too
        return [Sim("aaa-colluder", "aaa-colluder", 10 * per_step, "all_matched"), *fleet,
                Sim("zzz-colluder", "zzz-colluder", 10 * per_step, "all_matched")]
    if attack == "backdated":
        return fleet + [Sim(f"backdated-{i}", "backdater", per_step, "all_matched",
                            backdated=True) for i in range(3)]
    if attack == "camouflaged":
        return fleet + [Sim(f"camouflaged-{i}", "camouflage", per_step, "camouflaged")
                        for i in range(6)]
    if attack == "lone_shaped":
        return [Sim("lone-0", "lone", per_step, "shaped")]
    if attack == "small_segment":
        return [*fleet, Sim("coder-0", "coder", max(1, SMALL_SEGMENT_TOKENS // steps),
                            "all_matched", segment="code")]
    raise ValueError(f"unknown attack {attack!r}")


def canary_fleets(args, per_minute: int) -> list[tuple[str, str, dict, list[Sim]]]:
    """(attack, run name, candidate, fleet) of each canary run asked for."""
    runs = []
    if "canary_liar" in args.attacks:
        members, others = by_membership("honest", args.honest, args.honest)
        [liar_id], _ = by_membership("liar", 1, 0)
        liar_tokens = round(per_minute * len(members) * 0.2 / 0.8)  # 20% of the canary's
        for run, kind, candidate in (("canary-bad", "all_matched", BAD),
                                     ("canary-good", "all_mismatched", GOOD)):
            runs.append(("canary_liar", run, candidate, [
                *honest_fleet(members + others, per_minute),
                Sim(liar_id, "liar", liar_tokens, kind)]))
    if "small_canary" in args.attacks:
        members, others = by_membership("honest", 1, 3)
        [liar_id], _ = by_membership("liar", 1, 0)
        runs.append(("small_canary", "small-canary", BAD, [
            *honest_fleet(members + others, per_minute),
            Sim(liar_id, "liar", 10 * per_minute, "all_matched")]))
    return runs


def targets_missed(runs: list[dict], canaries: list[dict], ratio: float | None) -> list[str]:
    """Each target missed, named by the run that missed it."""
    missed = []
    for run in [*runs, *canaries]:
        where = run["name"]
        worst = max(run["true_disagreement"], run.get("true_disagreement_after_canary", 0.0))
        if worst > DELTA:
            missed.append(f"{where}: active set's true disagreement {worst} > δ {DELTA}")
        if run["fallbacks"]:
            missed.append(f"{where}: {run['fallbacks']} false fallback(s)")
        if run["honest_set_aside"]:
            missed.append(f"{where}: honest witnesses set aside: {run['honest_set_aside']}")
        if run["honest_mismatched"]:
            missed.append(f"{where}: honest runtimes marked mismatched: "
                          f"{run['honest_mismatched']}")
        if run.get("wrong"):
            missed.append(f"{where}: {run['candidate']} candidate {run['status']}")
    for run in runs:
        taken = run["accepted"]
        if run["attack"] == "impersonation" and taken:
            missed.append(f"{run['name']}: batches under honest ids accepted: {taken}")
        if run["attack"] == "lineage_framing":
            under = {key: n for key, n in taken.items() if key != "framer/framer-0"}
            if under:
                missed.append(f"{run['name']}: batches under honest ids accepted: {under}")
        if run["attack"] == "sybil_no_beats" and len(taken) > 1:
            missed.append(f"{run['name']}: {len(taken)} ids of one token accepted past a cap "
                          "of 1")
        if run["attack"] == "lone_shaped" and run["active_version"] != 1:
            missed.append(f"{run['name']}: promoted version {run['active_version']} without an "
                          f"operator ({run['promotion']})")
    if ratio is not None and ratio < 0.9:
        missed.append(f"honest_exit_rate_ratio_at_5pct {ratio} < 0.9")
    return missed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--honest", type=int, default=3)
    parser.add_argument("--honest-tokens-per-s", type=float, default=8.0)
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--drift-interval-s", type=float, default=30.0)
    parser.add_argument("--shares", type=float, nargs="+", default=[0.05, 0.2, 0.5])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=ATTACKS)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.duration_s = 300.0
    logging.disable(logging.WARNING)  # the JSON line is the output; refusals are counted
    install()
    sample = honest(400_000, np.random.default_rng(12345))
    caps = RuntimeCaps.from_settings(get_settings())
    per_step = int(args.honest_tokens_per_s * args.drift_interval_s)
    steps = int(args.duration_s // args.drift_interval_s)
    runs, canaries = [], []
    with tempfile.TemporaryDirectory() as folder:
        url = f"sqlite:///{folder}/poison.db"
        upgrade(url)
        engine = make_engine(url)
        if "single_liar" in args.attacks:
            fleet = honest_fleet([f"honest-{i}" for i in range(args.honest)], per_step)
            runs.append(scenario(engine, "single_liar", "baseline", fleet, args, sample, caps)
                        | {"kind": None, "share": 0.0})
            for kind, share in [(k, s) for k in args.kinds for s in args.shares]:
                liar_tokens = round(per_step * args.honest * share / (1 - share))
                heads = OTHER_HEADS if kind == "other_heads" else HEADS
                runs.append(scenario(
                    engine, "single_liar", f"{kind}-{int(share * 100)}",
                    [*fleet, Sim("liar", "liar", liar_tokens, kind, heads=heads)], args,
                    sample, caps) | {"kind": kind, "share": share})
        for attack in args.attacks:
            if attack in ("single_liar", "canary_liar", "small_canary"):
                continue
            runs.append(scenario(
                engine, attack, attack.replace("_", "-"),
                attack_fleet(attack, args, per_step, steps), args, sample,
                replace(caps, per_token=1) if attack == "sybil_no_beats" else caps,
                tuned=attack != "lone_shaped",
                segments=("code",) if attack == "small_segment" else ()))
        for attack, name, candidate, fleet in canary_fleets(
                args, int(args.honest_tokens_per_s * 60)):
            canaries.append(canary_scenario(engine, attack, name, candidate, fleet, args,
                                            sample, caps))
        engine.dispose()
    single = [r for r in runs if r["attack"] == "single_liar"]
    base = next((r for r in single if r["kind"] is None), None)
    at_5 = [r for r in single if r["kind"] and abs(r["share"] - 0.05) < 1e-9]
    ratio = (round(min(r["true_exit_rate"] for r in at_5) / base["true_exit_rate"], 4)
             if at_5 and base else None)
    detections = [r["outlier_detected_s"] for r in single
                  if r["kind"] not in (None, "other_heads")]
    lineage = [r["lineage_excluded_s"] for r in single if r["kind"] == "other_heads"]
    refused = Counter()
    for run in [*runs, *canaries]:
        refused[run["attack"]] += run["refused_batches"]
    print(json.dumps({
        "worst_promoted_true_disagreement": max(
            [r["true_disagreement"] for r in [*runs, *canaries]]
            + [c["true_disagreement_after_canary"] for c in canaries]),
        "delta": DELTA,
        "false_fallbacks": sum(r["fallbacks"] for r in runs),
        "honest_set_aside": sum(len(r["honest_set_aside"]) for r in [*runs, *canaries]),
        "canary_wrong_verdicts": sum(c["wrong"] for c in canaries),
        "honest_exit_rate_ratio_at_5pct": ratio,
        "attacks": len(args.attacks),
        "refused_batches": dict(refused),
        "targets_missed": targets_missed(runs, canaries, ratio),
        "outlier_detected_s_max": None if None in detections or not detections
        else max(detections),
        "lineage_excluded_s_max": None if None in lineage or not lineage else max(lineage),
        "drift_interval_s": args.drift_interval_s,
        "honest_runtimes": args.honest, "duration_s": args.duration_s,
        "command": " ".join(["bench/poison.py", *sys.argv[1:]]),
        "runs": runs, "canaries": canaries}))


if __name__ == "__main__":
    main()
