"""The shadow rate the workers decide from a deployment's stored state: its recent traffic
(ingested through the real telemetry path), firing drift alerts, a fallback set active, an
open canary; stored with its reason, announced only when it changed, within the bounds."""

from __future__ import annotations

from datetime import timedelta

import pytest

from controlplane.alerts.models import Alert
from controlplane.calibration.service import CalibrationPolicy
from controlplane.db import utcnow
from controlplane.deployments.service import move_alias, publish
from controlplane.drift.window_checks import DriftOptions
from controlplane.flows.shadow_rate import decide_for, quality_tokens, screen, tokens_per_s
from controlplane.settings import Settings
from tests.support.alerts import THRESHOLDS, Phase, make_deployment, send_traffic

SETTINGS = Settings()
OPTIONS = DriftOptions.from_settings(SETTINGS)
CALIBRATION = CalibrationPolicy.from_settings(SETTINGS)


def _decide(session, deployment):
    return decide_for(session=session, deployment=deployment, options=OPTIONS,
                      calibration=CALIBRATION, settings=SETTINGS)


@pytest.fixture
def chat(session):
    """'chat' with ten minutes of 600 tokens a minute behind it, its bounds wide open."""
    deployment = make_deployment(session, delta=0.05)
    deployment.shadow_rate_min, deployment.shadow_rate_max = 0.0001, 1.0
    send_traffic(session, deployment, start=utcnow() - timedelta(minutes=10),
                 phases=[Phase(minutes=10, rates=(0.3, 0.3, 0.3), shadow_rate=0.05)],
                 tokens_per_minute=600)
    session.flush()
    return deployment


def test_the_power_sizing_grows_as_the_target_tightens():
    assert quality_tokens(delta=0.01, alpha=1e-4) > quality_tokens(delta=0.05, alpha=1e-4)
    assert quality_tokens(delta=0.05, alpha=1e-6) > quality_tokens(delta=0.05, alpha=1e-3)
    assert quality_tokens(delta=0.5, alpha=0.5, minimum=100) == 100


def test_stable_traffic_gets_the_quality_tests_tokens_over_its_window(session, chat):
    rate = tokens_per_s(session=session, deployment=chat, window_s=OPTIONS.recent_s)
    assert 8.0 <= rate <= 10.5  # 600 a minute, the minute now partly in or out
    decision = _decide(session, chat)
    assert decision.reason.startswith("the quality drift test needs")
    assert (chat.shadow_rate, chat.shadow_rate_reason) == (decision.rate, decision.reason)
    assert chat.shadow_rate_decided_at is not None
    needed = quality_tokens(delta=0.05, alpha=OPTIONS.quality_look_alpha,
                            minimum=OPTIONS.min_shadow_tokens)
    assert decision.rate >= 1.5 * needed / (rate * max(OPTIONS.quality_windows_s))


def test_a_firing_drift_alert_raises_the_rate(session, chat):
    stable = _decide(session, chat).rate
    session.add(Alert(deployment_id=chat.id, kind="quality_regression", severity="critical",
                      dedup_key="q", open_key="q", summary="worse", status="firing"))
    session.flush()
    drifting = _decide(session, chat)
    assert drifting.rate > 5 * stable
    assert drifting.reason.startswith("a quality_regression alert is firing")


def test_a_fallback_set_active_raises_the_rate(session, chat):
    stable = _decide(session, chat).rate
    move_alias(session=session, deployment=chat, alias="active", version=1, actor="test",
               reason="fall back")
    fallback = _decide(session, chat)
    assert fallback.rate > 5 * stable
    assert fallback.reason.startswith("a fallback set (v1) is active")


def test_an_open_canary_raises_the_rate_for_its_fraction(session, chat):
    stable = _decide(session, chat).rate
    candidate = publish(session=session, deployment=chat, actor="test", reason="try",
                        thresholds={layer: value - 0.1 for layer, value in THRESHOLDS.items()})
    move_alias(session=session, deployment=chat, alias="canary", version=candidate.version,
               actor="test", reason="canary")
    canary = _decide(session, chat)
    assert canary.rate > stable and "the open canary" in canary.reason


def test_the_bounds_hold_and_an_unchanged_rate_is_not_announced(session, chat):
    chat.shadow_rate_min, chat.shadow_rate_max = 0.5, 0.9
    assert _decide(session, chat).rate == 0.5
    session.info.pop("notify_after_commit", None)
    _decide(session, chat)
    assert not session.info.get("notify_after_commit")  # the same rate: nobody is woken
    chat.shadow_rate_min = chat.shadow_rate_max = 0.3
    assert _decide(session, chat).rate == 0.3
    assert ("config", "chat") in session.info["notify_after_commit"]


def test_the_screen_raises_the_rate_on_recent_disagreement_before_any_alert():
    assert screen(shadow_tokens=600, disagreements=3, delta=0.01) is None  # below δ
    assert screen(shadow_tokens=600, disagreements=8, delta=0.01) is None  # within chance
    assert screen(shadow_tokens=0, disagreements=0, delta=0.01) is None
    found = screen(shadow_tokens=600, disagreements=18, delta=0.01)
    assert found is not None and found.startswith("the last shadow tokens disagree 18/600")


def test_recent_shadow_disagreement_raises_the_rate_before_any_alert(session, chat):
    stable = _decide(session, chat).rate
    send_traffic(session, chat, start=utcnow() - timedelta(seconds=50), seed=1,
                 phases=[Phase(minutes=1, rates=(0.3, 0.3, 0.3), shadow_rate=0.2,
                               mismatch_rate=0.5)], tokens_per_minute=600)
    session.flush()
    screened = _decide(session, chat)
    assert screened.rate > 5 * stable
    assert screened.reason.startswith("the last shadow tokens disagree")
