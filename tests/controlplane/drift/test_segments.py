"""Per-segment drift detection and fallback: a quality regression in one traffic
segment pages once, for that segment, and falls back that segment alone; the segments a check
covers share one false-alarm budget."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.alerts.models import Alert
from controlplane.calibration.models import CalibrationJob
from controlplane.db import utcnow
from controlplane.deployments.models import Alias
from controlplane.deployments.service import aliases_of, get_threshold_set, move_alias, publish
from controlplane.drift.service import DriftOptions, check_deployment, segments_to_check
from controlplane.drift.window_checks import WindowInputs, evaluate_segments
from tests.support.alerts import THRESHOLDS, Phase, make_deployment, send_traffic

BASE_RATES = (0.25, 0.4, 0.3)
# Shadow tokens carry signal 0.95 at layer 4 (the helper): every map here exits them there.
CHAT = {4: 0.93, 8: 0.8, 12: 0.7}
CODE = {4: 0.92, 8: 0.85, 12: 0.75}


def _segmented_deployment(session: Session, minutes: int):
    """Deployment 'assist' whose active version 3 has maps for chat and code, activated
    `minutes` ago; each segment's traffic comes from a runtime of its own."""
    now = utcnow().replace(second=30, microsecond=0)
    start = (now - timedelta(minutes=minutes)).replace(second=0)
    deployment = make_deployment(session, name="assist", delta=0.02)
    version = publish(session=session, deployment=deployment, thresholds=THRESHOLDS,
                      segments={"chat": CHAT, "code": CODE}, reason="per segment",
                      actor="test").version
    move_alias(session=session, deployment=deployment, alias="active", version=version,
               actor="test", reason="per segment")
    session.scalars(select(Alias).where(Alias.deployment_id == deployment.id,
                                        Alias.name == "active")).one().updated_at = start
    session.flush()
    return deployment, version, start, now


def _send(session, deployment, version, start, minutes, *, mismatch: dict[str, float]):
    for seed, (segment, rate) in enumerate(sorted(mismatch.items())):
        send_traffic(session, deployment, start=start, version=version,
                     runtime_id=f"rt-{segment}", segment=segment, seed=10 + seed,
                     phases=[Phase(minutes, BASE_RATES, shadow_rate=0.2, mismatch_rate=rate)])


def test_a_regression_in_code_pages_for_code_and_falls_back_code_alone(
        session: Session, tmp_path, outbox):
    deployment, version, start, now = _segmented_deployment(session, minutes=10)
    _send(session, deployment, version, start, 10,
          mismatch={"default": 0.0, "chat": 0.0, "code": 0.12})
    assert segments_to_check(session=session, deployment=deployment, version=version,
                             since=start) == ["default", "chat", "code"]

    result = check_deployment(session=session, deployment=deployment, options=DriftOptions(),
                              now=now)

    quality = [a for a in result.fired if a.kind == "quality_regression"]
    assert [(a.segment, a.dedup_key) for a in quality] == [
        ("code", "assist:code:quality_regression:all")]
    [alert] = quality
    assert alert.summary.startswith("segment code: disagreement with full depth")
    assert alert.evidence["segment"] == "code"
    assert alert.evidence["evidence"]["looks"]["segments_checked"] == 3
    assert "fallback engaged for segment code only" in alert.action_taken

    active = aliases_of(session=session, deployment=deployment)["active"]
    assert active == version + 1
    fallen = get_threshold_set(session=session, deployment=deployment, version=active)
    assert fallen.origin == "fallback" and fallen.parent_version == version
    assert fallen.segments_by_layer() == {"code": {4: 1.0, 8: 1.0, 12: 1.0}, "chat": CHAT}
    assert fallen.thresholds_by_layer() == THRESHOLDS
    assert fallen.expected_metrics["fallback"]["segment"] == "code"
    # The recalibration it queued runs on code alone.
    [job] = session.scalars(select(CalibrationJob)).all()
    assert (job.segment, job.alert_id, job.trigger) == ("code", alert.id, "alert")

    # The next cycle refreshes code's alert; chat's and default's checks resolve nothing of it.
    again = check_deployment(session=session, deployment=deployment, options=DriftOptions(),
                             now=now + timedelta(seconds=30))
    assert [a for a in again.fired if a.kind == "quality_regression"] == []
    assert session.scalars(select(Alert).where(Alert.kind == "quality_regression")).all() \
        == [alert]


def test_a_default_alert_reads_as_before_segments(session: Session, tmp_path, outbox):
    """Without segments the check covers 'default' alone, with the whole budget, and its
    alert carries no segment wording."""
    now = utcnow().replace(second=30, microsecond=0)
    start = (now - timedelta(minutes=10)).replace(second=0)
    deployment = make_deployment(session, delta=0.02, activated_at=start)
    send_traffic(session, deployment, start=start, seed=4,
                 phases=[Phase(10, BASE_RATES, shadow_rate=0.2, mismatch_rate=0.1)])
    result = check_deployment(session=session, deployment=deployment, options=DriftOptions(),
                              now=now)
    [quality] = [a for a in result.fired if a.kind == "quality_regression"]
    assert (quality.segment, quality.dedup_key) == ("default", "chat:quality_regression:all")
    assert quality.summary.startswith("disagreement with full depth")
    assert "segment" not in quality.evidence
    assert "segments_checked" not in quality.evidence["evidence"]["looks"]
    looks = quality.evidence["evidence"]["looks"]
    assert looks["alpha_per_look"] == DriftOptions().quality_look_alpha


# -- the shared false-alarm budget: a seeded simulation ---------------------------------------

NOW = datetime(2026, 1, 1, 12, tzinfo=UTC)
LAYERS = [3, 6, 9]
DELTA = 0.05


def _stationary(rng: np.random.Generator) -> WindowInputs:
    """Ten minutes of one segment's shadow tokens (100 requests of 20) that all exit at layer
    3 and disagree with full depth at exactly δ: the boundary where a page is a false alarm."""
    n = 2000
    matched = np.ones((n, len(LAYERS)), dtype=bool)
    matched[:, 0] = rng.random(n) >= DELTA
    return WindowInputs(
        version=2, layers=LAYERS, thresholds=[0.5, 0.5, 0.5], delta=DELTA, now=NOW,
        reference=None, reference_origin="expected_metrics", reference_window=None,
        since=NOW - timedelta(minutes=30), minutes=[],
        recent_since=NOW - timedelta(seconds=600),
        shadow_requests=(np.arange(n) // 20).astype(str),
        shadow_signals=np.full((n, len(LAYERS)), 0.9, dtype=np.float32),
        shadow_matched=matched, shadow_times=None)


def _paged(observed: dict) -> bool:
    return any(c.kind == "quality_regression" for conditions, _ in observed.values()
               for c in conditions)


def test_stationary_traffic_on_three_segments_pages_no_more_than_on_one():
    # One look an hour at a large budget, so that false pages are frequent enough to count.
    options = DriftOptions(quality_windows_s=(600.0,), check_interval_s=3600.0,
                           quality_alpha_per_hour=0.3)
    trials = 400
    rng = np.random.default_rng(18)
    one = three = unsplit = 0
    for _ in range(trials):
        one += _paged(evaluate_segments({"default": _stationary(rng)}, options))
        segments = {name: _stationary(rng) for name in ("default", "chat", "code")}
        three += _paged(evaluate_segments(segments, options))
        # what testing each segment with the whole budget would page (the bug this prevents)
        unsplit += _paged({name: evaluate_segments({name: inputs}, options)[name]
                           for name, inputs in segments.items()})
    one_rate, three_rate, unsplit_rate = one / trials, three / trials, unsplit / trials
    assert one_rate > 0.03, one_rate  # the simulation does produce false pages
    # Three segments within the one-segment rate (binomial noise: 3 standard errors) and the
    # hourly budget; without the split they page far more often.
    se = np.sqrt(one_rate * (1 - one_rate) / trials)
    assert three_rate <= one_rate + 3 * se, (three_rate, one_rate)
    assert three_rate <= options.quality_alpha_per_hour
    assert unsplit_rate > one_rate + 4 * se, (unsplit_rate, one_rate)


def test_every_level_is_split_by_the_segments_checked():
    base = DriftOptions()
    split = base.for_segments(4)
    assert split.quality_look_alpha == pytest.approx(base.quality_look_alpha / 4)
    assert split.exit_rate_level == pytest.approx(base.exit_rate_alpha / 4)
    assert split.distribution_level == pytest.approx(base.distribution_p_value / 4)
    assert base.for_segments(1) == base


@pytest.mark.slow  # 30 minutes of two segments' traffic through the ingestion
def test_an_exit_rate_collapse_in_code_alerts_for_code_and_recalibrates_code(
        session: Session, outbox):
    deployment, version, start, now = _segmented_deployment(session, minutes=30)
    for seed, (segment, late) in enumerate((("chat", BASE_RATES), ("code", (0.25, 0.1, 0.3)))):
        send_traffic(session, deployment, start=start, version=version, seed=20 + seed,
                     runtime_id=f"rt-{segment}", segment=segment,
                     phases=[Phase(15, BASE_RATES), Phase(15, late)])

    result = check_deployment(session=session, deployment=deployment, options=DriftOptions(),
                              now=now)

    exits = [a for a in result.fired if a.kind.startswith("exit_rate")]
    assert [(a.kind, a.segment, a.layer) for a in exits] == [("exit_rate_collapse", "code", 8)]
    [collapse] = exits
    assert collapse.dedup_key == "assist:code:exit_rate_collapse:8"
    assert collapse.summary.startswith("segment code: exit rate at layer 8 fell from")
    assert collapse.evidence["window"]["reference"] == "first_window_after_activation"
    # speed lost, quality safe: no fallback, code's recalibration is queued
    assert aliases_of(session=session, deployment=deployment)["active"] == version
    [job] = session.scalars(select(CalibrationJob)).all()
    assert job.segment == "code" and "recalibration job" in collapse.action_taken
