"""One runtime cannot steer the fleet: a runtime is a witness, not a judge.

Guards against: one runtime's forged all-matched shadow tokens certifying thresholds 0.0 for
every runtime of the deployment; a liar holding half the shadow evidence among honest runtimes
getting a set promoted that breaks δ on honest traffic; one runtime's forged disagreement firing
the quality fallback in a fleet of three or more; an outlier runtime that nobody sets aside; a
liar forging disagreement with a good canary candidate holding it back for ever; one runtime's
exit behaviour raising an exit-rate spike or collapse alone; an excluded runtime's forged
disagreement disqualifying the last good set; and honest runtimes with different traffic-segment
mixes flagged as outliers.
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
from sqlalchemy import select

from controlplane.alerts.kinds import AlertKind
from controlplane.alerts.models import Alert
from controlplane.calibration import service as calibration
from controlplane.calibration.last_good import last_good_version
from controlplane.calibration.learn_then_test import calibrate_thresholds, policy_disagreement
from controlplane.calibration.models import CalibrationJob
from controlplane.db import session_scope, utcnow
from controlplane.deployments.models import Alias
from controlplane.deployments.segments import declare_segment
from controlplane.deployments.service import (
    aliases_of,
    get_deployment,
    get_threshold_set,
    move_alias,
    publish,
)
from controlplane.drift.outliers import screen_witnesses
from controlplane.drift.service import DriftOptions, check_deployment, exit_behaviour_conditions
from controlplane.flows import recalibration
from controlplane.flows.canary import CanaryPolicy, evaluate_canary, start_canary
from controlplane.runtimes.outliers import excluded_runtime_ids, set_aside
from controlplane.stats.robust_evidence import cap_runtime_share
from controlplane.telemetry.service import shadow_evidence
from tests.support.calibration import LAYERS, make_deployment, separable_samples, write_traffic

POLICY = calibration.CalibrationPolicy(min_samples_per_layer=500, seed=0)
HONEST = ("rt-a", "rt-b", "rt-c")
TUNED = {3: 0.6, 6: 0.6, 9: 0.6}


def _deployment(engine, *, active: dict | None = None, since_minutes: int = 30) -> None:
    """Deployment 'chat' (δ 0.05, policy auto); with `active`, a tuned version 2 is active
    since `since_minutes` ago."""
    with session_scope(engine) as session:
        deployment = make_deployment(session, policy="auto")
        if active is not None:
            exits = 1.0 - float(np.prod([value for value in active.values()]))
            tuned = publish(session=session, deployment=deployment, thresholds=active,
                            reason="tuned", actor="test",
                            expected_metrics={"total_exit_rate": exits})
            move_alias(session=session, deployment=deployment, alias="active",
                       version=tuned.version, actor="test", reason="tuned")
            alias = session.scalars(select(Alias).where(Alias.deployment_id == deployment.id,
                                                        Alias.name == "active")).one()
            alias.updated_at = utcnow() - timedelta(minutes=since_minutes)


def _liar_samples(n: int, *, matched: bool, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    signals = rng.random((n, len(LAYERS))).astype(np.float32)
    return signals, np.full(signals.shape, matched)


def _calibrate(engine, since) -> CalibrationJob:
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        job, _ = calibration.request_calibration(session=session, deployment=deployment,
                                                 actor="test", since=since, policy=POLICY)
        job_id = job.id
    with session_scope(engine) as session:
        recalibration.run_calibration(session=session, job=session.get(CalibrationJob, job_id),
                                      policy=POLICY)
    with session_scope(engine) as session:
        return session.get(CalibrationJob, job_id)


def _honest_disagreement_of_active(engine) -> tuple[int, float]:
    """(active version, its true disagreement on a large fresh sample of honest traffic)."""
    signals, matched = separable_samples(200_000, seed=99, noise=0.02)
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        version = aliases_of(session=session, deployment=deployment)["active"]
        by_layer = get_threshold_set(session=session, deployment=deployment,
                                     version=version).thresholds_by_layer()
    wrong, n = policy_disagreement(signals, matched, [by_layer[k] for k in LAYERS])
    return version, wrong / n


def test_one_runtimes_forged_agreement_cannot_certify_thresholds_for_the_fleet(engine):
    """The attack as found: one runtime id, 450 requests x 8 tokens, every exit layer at
    signal 0.99 and matched. The candidate it yields may be published for an operator to look
    at, but it is not promoted to the fleet."""
    _deployment(engine)
    start = utcnow() - timedelta(minutes=20)
    signals = np.full((3600, len(LAYERS)), 0.99, dtype=np.float32)
    with session_scope(engine) as session:
        write_traffic(session, "chat", signals, np.ones(signals.shape, dtype=bool), start=start,
                      spacing_s=0.2, runtime_id="rt-liar", request_tokens=8)
    job = _calibrate(engine, start)
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        assert aliases_of(session=session, deployment=deployment)["active"] == 1
    assert job.promotion != "active"
    if job.result_version is not None:
        assert job.promotion == "awaiting_approval"
        assert "automatic promotion bounds" in job.summary["promotion_hold"]


def test_a_liar_holding_half_the_evidence_cannot_promote_a_set_that_breaks_delta(engine):
    """Three honest runtimes (a layer matches full depth when its signal is above 0.5, 2% of
    labels flipped) and one liar with as many shadow tokens as all of them, reporting every
    signal 0.25 lower than it was (pooled, its low signals look safe: the set learned on them
    disagreed on 9% of honest tokens against δ 5%): the set active afterwards disagrees with
    full depth on at most δ of honest traffic."""
    _deployment(engine, active=TUNED)
    start = utcnow() - timedelta(minutes=25)
    with session_scope(engine) as session:
        for index, runtime in enumerate(HONEST):
            signals, matched = separable_samples(1500, seed=index, noise=0.02)
            write_traffic(session, "chat", signals, matched, start=start, spacing_s=0.3,
                          runtime_id=runtime, request_tokens=16)
        signals, matched = separable_samples(4500, seed=7)
        signals = np.clip(signals - 0.25, 0.0, 1.0)
        write_traffic(session, "chat", signals, matched, start=start, spacing_s=0.1,
                      runtime_id="rt-liar", request_tokens=16)
    _calibrate(engine, start)
    _, disagreement = _honest_disagreement_of_active(engine)
    assert disagreement <= 0.05


def _drift_fleet(engine, *, liar_matched: bool) -> None:
    """Tuned version 2 active for 30 minutes; the last 9 minutes of traffic from three honest
    runtimes (within δ under version 2) and one liar, every token a shadow token."""
    _deployment(engine, active=TUNED)
    start = utcnow() - timedelta(minutes=9)
    with session_scope(engine) as session:
        for index, runtime in enumerate(HONEST):
            signals, matched = separable_samples(1800, seed=10 + index, noise=0.01)
            write_traffic(session, "chat", signals, matched, start=start, spacing_s=0.3,
                          version=2, thresholds=TUNED, runtime_id=runtime, request_tokens=8)
        signals, matched = _liar_samples(1800, matched=liar_matched, seed=17)
        write_traffic(session, "chat", signals, matched, start=start, spacing_s=0.3,
                      version=2, thresholds=TUNED, runtime_id="rt-liar", request_tokens=8)


def _check(engine) -> None:
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        check_deployment(session=session, deployment=deployment, options=DriftOptions())


def _alerts(engine, kind: str) -> list[Alert]:
    with session_scope(engine) as session:
        return list(session.scalars(select(Alert).where(Alert.kind == kind)))


def test_one_runtimes_forged_disagreement_cannot_fire_the_fallback_in_a_fleet(engine):
    _drift_fleet(engine, liar_matched=False)
    _check(engine)
    assert _alerts(engine, AlertKind.QUALITY_REGRESSION) == []
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        assert aliases_of(session=session, deployment=deployment)["active"] == 2


def test_an_outlier_runtime_is_raised_set_aside_and_cleared(engine, client, tokens):
    _drift_fleet(engine, liar_matched=True)
    _check(engine)
    raised = _alerts(engine, AlertKind.RUNTIME_OUTLIER)
    assert [alert.evidence["runtime_id"] for alert in raised] == ["rt-liar"]
    assert "rt-liar" in raised[0].summary and raised[0].status == "firing"
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        assert excluded_runtime_ids(session=session, deployment_id=deployment.id) == {"rt-liar"}
    _check(engine)  # set aside once, not again each cycle
    assert len(_alerts(engine, AlertKind.RUNTIME_OUTLIER)) == 1

    headers = tokens.headers(tokens.operator)
    listed = client.get("/v1/deployments/chat/runtime-outliers", headers=headers).json()
    assert [(o["runtime_id"], o["status"]) for o in listed] == [("rt-liar", "set_aside")]
    assert listed[0]["evidence"]["statistic"] in ("matched", "signal_above_median",
                                                  "policy_disagreement")
    path = f"/v1/deployments/chat/runtime-outliers/{listed[0]['id']}/clear"
    assert client.post(path, json={"reason": ""}, headers=headers).status_code == 422
    cleared = client.post(path, json={"reason": "checked the runtime"}, headers=headers)
    assert cleared.status_code == 200 and cleared.json()["status"] == "cleared"
    assert client.post(path, json={"reason": "again"}, headers=headers).status_code == 409
    assert client.post("/v1/deployments/chat/runtime-outliers/999/clear",
                       json={"reason": "x"}, headers=headers).status_code == 404
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        assert excluded_runtime_ids(session=session, deployment_id=deployment.id) == set()
    assert _alerts(engine, AlertKind.RUNTIME_OUTLIER)[0].status == "resolved"


def test_a_liar_forging_disagreement_cannot_hold_back_a_good_canary(engine):
    """A good candidate (within δ on honest traffic) on canary, served by three honest runtimes
    and one runtime forging disagreement on every exit layer with a fifth of the canary's
    shadow tokens: the liar is set aside and the candidate is promoted on the honest
    evidence (not left inconclusive until the canary pauses)."""
    _deployment(engine, active={3: 0.9, 6: 0.9, 9: 0.9})
    start = utcnow().replace(second=0, microsecond=0) - timedelta(minutes=6)
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        version = publish(session=session, deployment=deployment, thresholds=TUNED,
                          reason="candidate", actor="test").version
        deployment.canary_fraction = 1.0  # every runtime a member: the canary judges them
        start_canary(session=session, deployment=deployment, version=version, actor="test",
                     now=start)
    traffic = start + timedelta(minutes=1)
    with session_scope(engine) as session:
        for index, runtime in enumerate(HONEST):
            signals, matched = separable_samples(4 * 480, seed=30 + index, noise=0.01)
            write_traffic(session, "chat", signals, matched, start=traffic, spacing_s=0.125,
                          version=version, thresholds=TUNED, runtime_id=runtime,
                          request_tokens=8)
        signals, matched = _liar_samples(4 * 360, matched=False, seed=37)
        write_traffic(session, "chat", signals, matched, start=traffic, spacing_s=1 / 6,
                      version=version, thresholds=TUNED, runtime_id="rt-liar", request_tokens=8)
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        run = evaluate_canary(session=session, deployment=deployment, policy=CanaryPolicy(),
                              now=traffic + timedelta(minutes=4, seconds=1))
        assert run.status == "promoted", run.checks[-1]["reason"]
        assert excluded_runtime_ids(session=session, deployment_id=deployment.id) == {"rt-liar"}
        assert aliases_of(session=session, deployment=deployment)["active"] == version
    assert [a.evidence["runtime_id"] for a in _alerts(engine, AlertKind.RUNTIME_OUTLIER)] == [
        "rt-liar"]


def _exit_fleet(engine, liar_thresholds: dict[int, float]) -> None:
    """Version 2 (thresholds 0.6, whose conditional exit rate is 0.4 at every layer on these
    signals) active for 20 minutes with those rates as its expected metrics; three honest
    runtimes apply it, one runtime (honest shadow labels) exits by `liar_thresholds`."""
    expected = {"conditional_exit_rate": {str(k): 0.4 for k in LAYERS},
                "total_exit_rate": 1 - 0.6 ** 3}
    with session_scope(engine) as session:
        deployment = make_deployment(session, policy="auto")
        tuned = publish(session=session, deployment=deployment, thresholds=TUNED,
                        reason="tuned", actor="test", expected_metrics=expected)
        move_alias(session=session, deployment=deployment, alias="active",
                   version=tuned.version, actor="test", reason="tuned")
        session.scalars(select(Alias).where(Alias.deployment_id == deployment.id,
                                            Alias.name == "active")).one().updated_at = (
            utcnow() - timedelta(minutes=20))
    start = utcnow() - timedelta(minutes=10)
    with session_scope(engine) as session:
        for index, runtime in enumerate((*HONEST, "rt-odd")):
            signals, matched = separable_samples(4000, seed=40 + index, noise=0.01)
            write_traffic(session, "chat", signals, matched, start=start, spacing_s=0.15,
                          version=2, runtime_id=runtime, request_tokens=8, shadow_every=4,
                          thresholds=liar_thresholds if runtime == "rt-odd" else TUNED)


@pytest.mark.parametrize("liar_thresholds, kind", [
    ({3: 0.0, 6: 0.0, 9: 0.0}, AlertKind.EXIT_RATE_SPIKE),
    ({3: 1.0, 6: 1.0, 9: 1.0}, AlertKind.EXIT_RATE_COLLAPSE)])
def test_one_runtime_cannot_raise_an_exit_rate_spike_or_collapse_alone(engine, liar_thresholds,
                                                                       kind):
    """A runtime that exits every token at the first exit layer (or none at all) moves the
    fleet's pooled exit rates far enough for a spike (a collapse); the finding must also show
    without each one runtime's rollups, so in a fleet of four it does not fire, while the
    same rollups judged without that rule do."""
    _exit_fleet(engine, liar_thresholds)
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        now = utcnow()
        pooled, _ = exit_behaviour_conditions(
            session=session, deployment=deployment, now=now, want_report=False,
            options=DriftOptions(robust_min_runtimes=5))
        assert kind in {c.kind for c in pooled}  # the fleet's pooled rates do move
        robust, checked = exit_behaviour_conditions(
            session=session, deployment=deployment, now=now, want_report=False,
            options=DriftOptions())
        assert kind in checked
        assert not [c for c in robust if c.kind in (AlertKind.EXIT_RATE_SPIKE,
                                                    AlertKind.EXIT_RATE_COLLAPSE)]
        assert excluded_runtime_ids(session=session, deployment_id=deployment.id) == set()
    _check(engine)
    assert _alerts(engine, kind) == []
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        assert aliases_of(session=session, deployment=deployment)["active"] == 2


def test_the_last_good_set_is_judged_without_excluded_runtimes(engine):
    """Version 2 served three honest runtimes well within δ; a runtime set aside as an outlier
    forged disagreement on as many shadow tokens. Judged on the evidence the deployment
    takes, version 2 is the last good set (the set-aside runtime's rollups count for
    nothing)."""
    _deployment(engine, active=TUNED)
    start = utcnow() - timedelta(minutes=20)
    with session_scope(engine) as session:
        for index, runtime in enumerate(HONEST):
            signals, matched = separable_samples(600, seed=50 + index, noise=0.01)
            write_traffic(session, "chat", signals, matched, start=start, spacing_s=0.5,
                          version=2, thresholds=TUNED, runtime_id=runtime, request_tokens=8)
        signals, matched = _liar_samples(1800, matched=False, seed=57)
        write_traffic(session, "chat", signals, matched, start=start, spacing_s=0.2,
                      version=2, thresholds=TUNED, runtime_id="rt-liar", request_tokens=8)
        deployment = get_deployment(session=session, name="chat")
        newer = publish(session=session, deployment=deployment, thresholds={3: 0.7, 6: 0.7,
                                                                             9: 0.7},
                        reason="newer", actor="test")
        move_alias(session=session, deployment=deployment, alias="active",
                   version=newer.version, actor="test", reason="newer")
        set_aside(session=session, deployment=deployment, runtime_id="rt-liar", version=2,
                  segment="default", summary="forged disagreement", evidence={})
        good = last_good_version(session=session, deployment=deployment,
                                 exclude={newer.version}, min_shadow_tokens=200)
        assert good is not None and good.version == 2


def test_honest_runtimes_with_different_segment_mixes_are_not_outliers(engine):
    """Segment 'code' exits far more readily than segment 'chat' (its layers match full depth
    from signal 0.2, chat's from 0.8). Two honest runtimes serve mostly code, two mostly chat:
    compared with the rest at the same version and segment none of them is set aside, though
    their evidence pooled over the segments differs far beyond chance."""
    _deployment(engine, active=TUNED)
    start = utcnow() - timedelta(minutes=9)
    mixes = {"rt-a": 0.9, "rt-b": 0.85, "rt-c": 0.1, "rt-d": 0.15}  # share of code
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        for name in ("code", "talk"):
            declare_segment(session=session, deployment=deployment, name=name, actor="test")
        for index, (runtime, code_share) in enumerate(mixes.items()):
            for segment, below, share in (("code", 0.2, code_share),
                                          ("talk", 0.8, 1 - code_share)):
                n = int(2400 * share) // 8 * 8
                signals, matched = separable_samples(n, seed=60 + 2 * index + (segment == "code"),
                                                     mismatch_below=below, noise=0.01)
                write_traffic(session, "chat", signals, matched, start=start,
                              spacing_s=540 / n, version=2, thresholds=TUNED, runtime_id=runtime,
                              request_tokens=8, segment=segment)
        pooled = shadow_evidence(session=session, deployment=deployment, since=start,
                                 version=2, exclude=())
        assert screen_witnesses(requests=pooled.keyed_requests(), runtimes=pooled.runtimes,
                                signals=pooled.signals, matched=pooled.matched,
                                thresholds=[TUNED[k] for k in LAYERS], layers=LAYERS,
                                alpha=1e-3, min_requests=5, robust_min_runtimes=3).flagged
    _check(engine)
    assert _alerts(engine, AlertKind.RUNTIME_OUTLIER) == []
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        assert excluded_runtime_ids(session=session, deployment_id=deployment.id) == set()


def test_the_share_cap_applies_from_robust_min_runtimes_up():
    """Two runtimes, one with nine times the other's tokens: both keep every token (no majority
    to protect; capping would only discard evidence). Three: the largest is cut to its share."""
    two = np.array(["rt-a"] * 900 + ["rt-b"] * 100)
    requests = np.array([f"{runtime}/{i // 8}" for i, runtime in enumerate(two)])
    assert cap_runtime_share(two, requests, max_share=0.5, min_runtimes=3).all()
    three = np.concatenate([two, ["rt-c"] * 100])
    requests = np.array([f"{runtime}/{i // 8}" for i, runtime in enumerate(three)])
    keep = cap_runtime_share(three, requests, max_share=0.5, min_runtimes=3)
    assert (keep[three != "rt-a"]).all()
    assert keep[three == "rt-a"].sum() <= 0.5 * keep.sum() + 8


def test_in_a_fleet_of_two_a_flooding_liar_cannot_certify_a_set_alone():
    """An honest runtime (a layer matches full depth above signal 0.5) and a runtime forging
    agreement on every token with four times its tokens: every step must be certified on the
    runtime held out of the path and the test as well, so the set chosen holds δ on honest
    traffic and passes its holdout, whichever runtime is held out."""
    honest_signals, honest_matched = separable_samples(3000, seed=70, noise=0.01)
    liar_signals, liar_matched = _liar_samples(12000, matched=True, seed=71)
    signals = np.vstack([honest_signals, liar_signals])
    matched = np.vstack([honest_matched, liar_matched])
    runtimes = np.array(["rt-honest"] * 3000 + ["rt-liar"] * 12000)
    requests = np.array([f"{runtime}/{i // 8}" for i, runtime in enumerate(runtimes)])
    truth = separable_samples(100_000, seed=72, noise=0.01)
    for seed in range(4):
        result = calibrate_thresholds(signals=signals, matched=matched, exit_layers=LAYERS,
                                      num_layers=12, delta=0.05, epsilon=0.1,
                                      requests=requests, runtimes=runtimes, seed=seed,
                                      min_samples_per_layer=500)
        wrong, n = policy_disagreement(*truth, [result.thresholds[k] for k in LAYERS])
        assert wrong / n <= 0.05, (seed, result.thresholds)
        assert result.holdout is not None and result.holdout.passed
