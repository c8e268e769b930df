"""The answer watch in the drift cycle: shadow requests ingested through the real ingestion; a
deployment with an answer target whose active set changes too many whole answers raises a
critical `answer_regression`, the fallback makes the conservative set active, and the alert
resolves once the window's requests show answers within δ_answer again. Nothing is checked
without an answer target or with too few requests, and no single witness raises it."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
from sqlalchemy import select

from controlplane.alerts.models import Alert
from controlplane.db import utcnow
from controlplane.deployments.models import Alias
from controlplane.deployments.service import aliases_of
from controlplane.drift.answers import (
    ANSWER_REGRESSION,
    answer_condition,
    answer_look_alpha,
    p_value_above,
)
from controlplane.drift.service import DriftOptions, check_deployment, exit_behaviour_conditions
from controlplane.stats.robust_evidence import EvidencePolicy
from controlplane.telemetry.service import ingest
from controlplane.telemetry.shadow_requests import ShadowRequests
from exitplane.wire import TelemetryBatch
from tests.support.alerts import FULL, LAYERS, make_deployment
from tests.support.batches import telemetry_batch
from tests.support.shadow_requests import shadow_request_records

TOKENS = 6  # per request
DIVERGES_AT = 3  # the token of a differing request that exits wrongly under the active set


def _labels(differs: bool) -> tuple[np.ndarray, np.ndarray]:
    """One request's labels under the active set (4: 0.9, 8: 0.8, 12: 0.7): no token clears a
    threshold, except, in a request that differs, token DIVERGES_AT at layer 4 with a
    prediction that does not match full depth."""
    signals = np.full((TOKENS, len(LAYERS)), 0.5, dtype=np.float32)
    matched = np.ones(signals.shape, dtype=bool)
    if differs:
        signals[DIVERGES_AT, 0], matched[DIVERGES_AT, 0] = 0.95, False
    return signals, matched


def _send(session, deployment, outcomes, *, start, version=2, runtime_id="rt-1", seq=0):
    """Ingest one shadow request per outcome (True: its answer differs) from `runtime_id`."""
    records = []
    for i, differs in enumerate(outcomes):
        signals, matched = _labels(differs)
        records += shadow_request_records(
            signals, matched, request_id=f"{runtime_id}-q{seq}-{i}", version=version,
            start=start.timestamp() + i, layers=LAYERS, num_layers=FULL)
    batch = TelemetryBatch.model_validate(telemetry_batch(
        records, deployment=deployment.name, runtime_id=runtime_id, seq=seq,
        num_layers=FULL))
    ingest(session=session, deployment=deployment, batches=[batch])
    session.flush()


def _deployment(session, delta_answer=0.1):
    now = utcnow().replace(microsecond=0)
    deployment = make_deployment(session, activated_at=now - timedelta(minutes=20))
    deployment.delta_answer = delta_answer
    session.flush()
    return deployment, now


def _check(session, deployment, now):
    return check_deployment(session=session, deployment=deployment, options=DriftOptions(),
                            now=now)


def test_an_answer_regression_pages_falls_back_and_resolves(session, outbox):
    deployment, now = _deployment(session)
    # 12 of 30 answers differ: far above δ_answer = 0.1 at the per-look level
    _send(session, deployment, [i % 5 < 2 for i in range(30)], start=now - timedelta(minutes=5))
    result = _check(session, deployment, now)
    fired = [a for a in result.fired if a.kind == ANSWER_REGRESSION]
    assert len(fired) == 1
    alert = fired[0]
    assert alert.severity == "critical" and alert.segment == "default"
    assert alert.summary.startswith("answers differ from full depth in 12/30 = 40.0%")
    evidence = alert.evidence
    assert (evidence["requests"], evidence["differing"]) == (30, 12)
    assert evidence["median_divergence_position"] == DIVERGES_AT
    assert evidence["p_value"] <= evidence["alpha"] == answer_look_alpha(DriftOptions())
    assert evidence["window"]["version"] == 2
    # the fallback reacted in the same transaction, as to a quality regression
    assert alert.action_taken.startswith("rule answer_regression: answer regression falls back")
    aliases = aliases_of(session=session, deployment=deployment)
    assert aliases["active"] == aliases["conservative"] == 1
    # The conservative set's own shadow requests: every answer is the full-depth one (it never
    # exits), so the window no longer shows the regression and the alert clears.
    alias = session.scalars(select(Alias).where(Alias.deployment_id == deployment.id,
                                                Alias.name == "active")).one()
    alias.updated_at = now - timedelta(seconds=30)
    _send(session, deployment, [i % 5 < 2 for i in range(30)], start=now - timedelta(seconds=25),
          version=1, seq=1)
    later = now + timedelta(seconds=30)
    again = _check(session, deployment, later)
    assert again.resolved == [] and session.get(Alert, alert.id).clear_since == later
    cleared = _check(session, deployment, later + timedelta(seconds=300))
    assert [a.id for a in cleared.resolved] == [alert.id]
    assert session.get(Alert, alert.id).status == "resolved"


def test_answers_within_delta_answer_raise_nothing_and_are_checked(session, outbox):
    deployment, now = _deployment(session)
    _send(session, deployment, [i == 0 for i in range(40)], start=now - timedelta(minutes=5))
    conditions, checked = exit_behaviour_conditions(session=session, deployment=deployment,
                                                    now=now, options=DriftOptions())
    assert ANSWER_REGRESSION in checked
    assert [c for c in conditions if c.kind == ANSWER_REGRESSION] == []


def test_no_answer_check_without_an_answer_target(session, outbox):
    deployment, now = _deployment(session, delta_answer=None)
    _send(session, deployment, [True] * 30, start=now - timedelta(minutes=5))
    conditions, checked = exit_behaviour_conditions(session=session, deployment=deployment,
                                                    now=now, options=DriftOptions())
    assert ANSWER_REGRESSION not in checked
    assert [c for c in conditions if c.kind == ANSWER_REGRESSION] == []


def test_too_few_requests_are_not_checked(session, outbox):
    deployment, now = _deployment(session)
    _send(session, deployment, [True] * 19, start=now - timedelta(minutes=5))  # minimum: 20
    conditions, checked = exit_behaviour_conditions(session=session, deployment=deployment,
                                                    now=now, options=DriftOptions())
    assert ANSWER_REGRESSION not in checked
    assert [c for c in conditions if c.kind == ANSWER_REGRESSION] == []


def test_requests_outside_the_window_or_of_another_version_are_not_read(session, outbox):
    deployment, now = _deployment(session)
    _send(session, deployment, [True] * 30, start=now - timedelta(minutes=15))  # before recent
    _send(session, deployment, [True] * 30, start=now - timedelta(minutes=5), version=1, seq=1)
    _, checked = exit_behaviour_conditions(session=session, deployment=deployment, now=now,
                                           options=DriftOptions())
    assert ANSWER_REGRESSION not in checked


def test_one_witness_alone_raises_no_answer_regression(session, outbox):
    deployment, now = _deployment(session)
    start = now - timedelta(minutes=5)
    for seq, runtime in enumerate(["rt-a", "rt-b", "rt-c"]):
        _send(session, deployment, [False] * 30, start=start, runtime_id=runtime, seq=seq)
    # 30 of 120 answers differ, all from one runtime: significant over the window, nothing
    # without that runtime's requests
    _send(session, deployment, [True] * 30, start=start, runtime_id="rt-bad", seq=3)
    assert p_value_above(np.arange(120) < 30, 0.1) < answer_look_alpha(DriftOptions())
    conditions, checked = exit_behaviour_conditions(session=session, deployment=deployment,
                                                    now=now, options=DriftOptions())
    assert ANSWER_REGRESSION in checked
    assert [c for c in conditions if c.kind == ANSWER_REGRESSION] == []
    # the same requests from four witnesses alike do raise it
    _send(session, deployment, [True] * 10, start=start, runtime_id="rt-a", seq=4)
    _send(session, deployment, [True] * 10, start=start, runtime_id="rt-b", seq=5)
    _send(session, deployment, [True] * 10, start=start, runtime_id="rt-c", seq=6)
    conditions, _ = exit_behaviour_conditions(session=session, deployment=deployment, now=now,
                                              options=DriftOptions())
    assert [c.kind for c in conditions if c.kind == ANSWER_REGRESSION] == [ANSWER_REGRESSION]


def test_the_per_look_level_shares_the_hourly_budget():
    options = DriftOptions(quality_alpha_per_hour=0.01, check_interval_s=30.0)
    assert answer_look_alpha(options) == 0.01 / 120
    assert answer_look_alpha(options.for_segments(4)) == 0.01 / 480
    assert p_value_above(np.zeros(0, dtype=bool), 0.1) == 1.0
    assert p_value_above(np.array([True, False]), 0.5) == 0.75


def _window(rng: np.random.Generator, n: int, p_differs: float, witnesses: int):
    """n one-token shadow requests from `witnesses` runtimes, each token exiting at the one
    exit layer under threshold 0.5 with a prediction that misses full depth with probability
    `p_differs`: P(answer differs) is exactly `p_differs`."""
    return ShadowRequests(
        requests=[f"q-{i}" for i in range(n)], runtimes=[f"rt-{i % witnesses}" for i in range(n)],
        witnesses=[f"runtime:rt-{i % witnesses}" for i in range(n)], segments=["default"] * n,
        versions=np.full(n, 2, dtype=np.int64), offsets=np.arange(n + 1, dtype=np.int64),
        signals=np.full((n, 1), 0.9, dtype=np.float32),
        matched=(rng.random((n, 1)) >= p_differs))


def _alarm_rate(p_differs: float, *, looks: int, alpha: float, seed: int) -> float:
    rng = np.random.default_rng(seed)
    alarms = 0
    for _ in range(looks):
        condition, checked = answer_condition(
            _window(rng, 200, p_differs, witnesses=4), [0.5], delta_answer=0.1, alpha=alpha,
            min_requests=50, policy=EvidencePolicy(), window={})
        assert checked
        alarms += condition is not None
    return alarms / looks


def test_steady_answers_at_delta_answer_alarm_at_most_alpha_per_look():
    """The worst case the test allows, P(answer differs) = δ_answer on steady traffic: each
    look alarms with probability at most its level (exact binomial; the leave-one-witness-out
    maximum only lowers it), so the looks of an hour spend at most the hourly budget. 3,000
    looks at α = 0.05: the rate stays under α plus three standard errors. A regression to
    twice δ_answer is caught in most looks."""
    looks, alpha = 3000, 0.05
    assert _alarm_rate(0.1, looks=looks, alpha=alpha, seed=1) <= \
        alpha + 3 * np.sqrt(alpha * (1 - alpha) / looks)
    assert _alarm_rate(0.05, looks=500, alpha=alpha, seed=2) == 0.0
    assert _alarm_rate(0.2, looks=300, alpha=alpha, seed=3) >= 0.9
