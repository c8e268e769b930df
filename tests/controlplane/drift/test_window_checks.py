"""The quality test's sliding windows: a shift shows in the last minute before it
dominates the ten-minute window, and the looks share one hourly false-alarm budget."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from controlplane.drift.window_checks import DriftOptions, WindowInputs, evaluate

LAYERS = [3, 6, 9]
NOW = datetime(2026, 1, 1, 12, tzinfo=UTC)


def _inputs(*, shifted_s: float, before: float, after: float, with_times: bool = True,
            seed: int = 0) -> WindowInputs:
    """Ten minutes of shadow tokens (20/s, 20-token requests) that all exit at layer 3; they
    disagree with full depth at rate `before`, then `after` in the last `shifted_s` seconds."""
    rng = np.random.default_rng(seed)
    times = NOW.timestamp() - 600 + np.arange(12_000) / 20
    rate = np.where(times >= NOW.timestamp() - shifted_s, after, before)
    matched = np.ones((len(times), len(LAYERS)), dtype=bool)
    matched[:, 0] = rng.random(len(times)) >= rate
    return WindowInputs(
        version=2, layers=LAYERS, thresholds=[0.5, 0.5, 0.5], delta=0.05, now=NOW,
        reference=None, reference_origin="expected_metrics", reference_window=None,
        since=NOW - timedelta(minutes=30), minutes=[],
        recent_since=NOW - timedelta(seconds=600),
        shadow_requests=(np.arange(len(times)) // 20).astype(str),
        shadow_signals=np.full((len(times), len(LAYERS)), 0.9, dtype=np.float32),
        shadow_matched=matched, shadow_times=times if with_times else None)


def _quality(inputs: WindowInputs, options: DriftOptions = DriftOptions()):
    conditions, checked = evaluate(inputs, options)
    assert "quality_regression" in checked
    return [c for c in conditions if c.kind == "quality_regression"]


def test_a_shift_in_the_last_minute_pages_before_it_dominates_the_recent_window():
    shifted = _inputs(shifted_s=60, before=0.02, after=0.15)
    # the whole ten minutes: 0.9 * 2% + 0.1 * 15% = 3.3%, within δ = 5%
    assert _quality(shifted, DriftOptions(quality_windows_s=(600.0,))) == []
    assert _quality(_inputs(shifted_s=60, before=0.02, after=0.15, with_times=False)) == []
    [quality] = _quality(shifted)
    evidence = quality.evidence["evidence"]
    assert evidence["window"]["seconds"] == 60.0
    assert 0.1 < evidence["disagreement_rate"] < 0.2 and evidence["requests"] == 60
    assert evidence["looks"]["alpha_per_look"] == DriftOptions().quality_look_alpha
    assert "over the last 60 s" in quality.summary


def test_stationary_disagreement_within_delta_stays_quiet_on_every_window():
    for seed in range(5):
        assert _quality(_inputs(shifted_s=0, before=0.04, after=0.04, seed=seed)) == []


def test_the_looks_of_an_hour_share_one_false_alarm_budget():
    base = DriftOptions(quality_windows_s=(60.0, 180.0, 600.0), check_interval_s=30.0,
                        quality_alpha_per_hour=0.01)
    assert base.quality_look_alpha * 120 * 3 == pytest.approx(0.01)
    # checking twice as often, or on twice as many windows, halves each look's level
    faster = DriftOptions(quality_windows_s=base.quality_windows_s, check_interval_s=15.0,
                          quality_alpha_per_hour=0.01)
    wider = DriftOptions(quality_windows_s=(30.0, 60.0, 120.0, 180.0, 300.0, 600.0),
                         check_interval_s=30.0, quality_alpha_per_hour=0.01)
    assert faster.quality_look_alpha == pytest.approx(base.quality_look_alpha / 2)
    assert wider.quality_look_alpha == pytest.approx(base.quality_look_alpha / 2)


def test_thin_traffic_gets_its_exit_rate_alert_from_a_window_closed_by_time(monkeypatch):
    # A deployment at 2 tokens/s whose calibration expected 5% exits at layer 6 while 30% exit:
    # one check of the service's code (`evaluate`) on 12 minutes of rollups pages, through a
    # window closed after `exit_rate_window_min` minutes; its 5,000 tokens would take 42.
    from controlplane.drift.detectors import LayerCounts, LayerReference
    from controlplane.settings import get_settings

    minutes = [(NOW - timedelta(minutes=12 - i),
                {3: LayerCounts(120, 0), 6: LayerCounts(120, 36), 9: LayerCounts(84, 0)})
               for i in range(12)]
    reference = {3: LayerReference(0.0, 2000), 6: LayerReference(0.05, 2000),
                 9: LayerReference(0.0, 1900)}
    inputs = _inputs(shifted_s=0, before=0.0, after=0.0)
    inputs.reference, inputs.minutes = reference, minutes
    inputs.since = minutes[0][0]

    def exit_alerts(options):
        return [(c.kind, c.layer, c.evidence["evidence"]["trigger"])
                for c in evaluate(inputs, options)[0] if c.kind.startswith("exit_rate")]

    assert exit_alerts(DriftOptions(exit_rate_window_min=10_000)) == []  # tokens alone
    assert exit_alerts(DriftOptions()) == [("exit_rate_spike", 6, "window")]
    monkeypatch.setenv("EXITPLANE_DRIFT_EXIT_RATE_WINDOW_MIN", "7")
    get_settings.cache_clear()
    try:
        assert DriftOptions.from_settings(get_settings()).exit_rate_window_min == 7
    finally:
        get_settings.cache_clear()
