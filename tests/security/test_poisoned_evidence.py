"""One runtime cannot steer the fleet: a runtime is a witness, not a judge.

Guards against: one runtime's forged all-matched shadow tokens certifying thresholds 0.0 for
every runtime of the deployment; a liar holding half the shadow evidence among honest runtimes
getting a set promoted that breaks δ on honest traffic; one runtime's forged disagreement firing
the quality fallback in a fleet of three or more; and an outlier runtime that nobody sets aside.
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
from sqlalchemy import select

from controlplane.alerts.kinds import AlertKind
from controlplane.alerts.models import Alert
from controlplane.calibration import service as calibration
from controlplane.calibration.models import CalibrationJob
from controlplane.calibration.stats import policy_disagreement
from controlplane.db import session_scope, utcnow
from controlplane.drift.service import DriftOptions, check_deployment
from controlplane.runtimes.outliers import excluded_runtime_ids
from controlplane.thresholds.models import Alias
from controlplane.thresholds.service import (
    aliases_of,
    get_deployment,
    get_threshold_set,
    move_alias,
    publish,
)
from tests.controlplane.calibration.support import (
    LAYERS,
    make_deployment,
    separable_samples,
    write_traffic,
)

POLICY = calibration.CalibrationPolicy(min_samples_per_layer=500)
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
        calibration.run_calibration(session=session, job=session.get(CalibrationJob, job_id),
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
        check_deployment(session=session, deployment=deployment, options=DriftOptions(),
                         reports_dir=None)


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
