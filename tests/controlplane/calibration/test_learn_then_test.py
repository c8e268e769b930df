"""Learn-Then-Test threshold selection: p-values, known answers, monotonicity, the guarantee."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from controlplane.calibration import learn_then_test as cal
from controlplane.drift.detectors import conditional_exit_rates
from controlplane.stats.synthetic import DEFAULT_EXIT_LAYERS, DEFAULT_NUM_LAYERS, shadow_samples

LAYERS = list(DEFAULT_EXIT_LAYERS)


def _synthetic(n: int, seed: int, domain: str = "A"):
    return shadow_samples(n, rng=np.random.default_rng(seed), domain=domain)


def _calibrate(signals, matched, **options):
    defaults = dict(exit_layers=LAYERS, num_layers=DEFAULT_NUM_LAYERS, delta=0.05, epsilon=0.1)
    return cal.calibrate_thresholds(signals=signals, matched=matched, **(defaults | options))


def test_hb_p_value_known_answers():
    # Bentkus term: e * P(Bin(100, 0.1) <= 5) = e * 0.0575762 = 0.156510
    # (Hoeffding term exp(-100 * h1(0.05, 0.1)) = 0.18812 is larger).
    assert cal.hb_p_value(0.05, 100, 0.1) == pytest.approx(0.156510, rel=1e-4)
    # No losses: Hoeffding term (1 - δ)^n = 0.99^1000 = 4.3171e-5 beats e * 0.99^1000.
    assert cal.hb_p_value(0.0, 1000, 0.01) == pytest.approx(4.3171e-5, rel=1e-4)
    assert cal.hb_p_value(0.02, 1000, 0.01) == 1.0
    assert np.all(np.diff(cal.hb_p_value(np.linspace(0, 0.05, 20), 500, 0.05)) >= 0)


def test_hb_upper_bound_known_answer():
    # r̂ = 0: solve (1 - R)^1000 = 0.05.
    assert cal.hb_upper_bound(0.0, 1000, 0.05) == pytest.approx(1 - 0.05 ** (1 / 1000), rel=1e-4)
    bound = cal.hb_upper_bound(0.03, 2000, 0.05)
    assert 0.03 < bound < 0.05
    assert cal.hb_p_value(0.03, 2000, bound) == pytest.approx(0.05, rel=1e-3)


def test_policy_disagreement_counts_exits_that_miss_full_depth():
    signals = np.array([[0.9, 0.1], [0.2, 0.95], [0.2, 0.3], [0.5, 0.99]])
    matched = np.array([[False, True], [True, True], [True, False], [True, False]])
    assert cal.policy_disagreement(signals, matched, [0.8, 0.9]) == (2, 4)


def test_known_answer_single_layer_shared_threshold():
    # 2000 signals evenly spaced in (0, 1); a token matches iff its signal >= 0.5.
    signals = ((np.arange(2000) + 0.5) / 2000)[:, None]
    matched = signals >= 0.5
    result = cal.calibrate_thresholds(
        signals=signals,
        matched=matched,
        exit_layers=[8],
        num_layers=30,
        delta=0.01,
        epsilon=0.05,
        strategy="shared",
        grid=np.round(np.linspace(1.0, 0.0, 101), 2),
        holdout_fraction=0.0,
    )
    # threshold 0.50 exits only matched tokens; 0.49 adds 20 mismatches = 1% = δ -> p = 1.
    assert result.thresholds == {8: 0.5}
    assert result.risk == 0.0 and result.exit_rate == 0.5
    assert result.p_value == pytest.approx(0.99**2000, rel=1e-3)
    assert result.mean_depth == pytest.approx(0.5 * 8 + 0.5 * 30)
    assert result.speedup == pytest.approx(30 / 19)
    assert result.layers[0].conditional_disagreement == 0.0
    assert result.holdout is None


def test_no_certified_step_falls_back_to_never_exit():
    # every token disagrees; the first grid step below 1.0 already exits 1% of them
    signals = np.linspace(0.5, 0.9999, 1500)[:, None]
    matched = np.zeros((1500, 1), dtype=bool)
    result = cal.calibrate_thresholds(
        signals=signals, matched=matched, exit_layers=[8], num_layers=30, delta=0.01,
        epsilon=0.05, strategy="shared", holdout_fraction=0.0,
    )  # fmt: skip
    assert result.thresholds == {8: cal.NEVER_EXIT}
    assert result.exit_rate == 0.0 and result.speedup == 1.0
    assert result.notes


def test_larger_delta_is_never_less_aggressive():
    signals, matched = _synthetic(8000, seed=1)
    results = [_calibrate(signals, matched, delta=d) for d in (0.005, 0.01, 0.02, 0.05, 0.1)]
    exit_rates = [r.exit_rate for r in results]
    assert exit_rates == sorted(exit_rates)
    assert exit_rates[-1] > exit_rates[0]
    for tighter, looser in itertools.pairwise(results):
        assert all(looser.thresholds[k] <= tighter.thresholds[k] for k in LAYERS)


def test_not_enough_data_is_a_clear_error():
    signals, matched = _synthetic(800, seed=2)
    with pytest.raises(cal.NotEnoughShadowData, match="at least 1000 per exit layer") as err:
        _calibrate(signals, matched)
    assert err.value.counts == {8: 800, 16: 800, 24: 800}
    # a layer observed on too few samples (NaN elsewhere) is enough to refuse
    signals, matched = _synthetic(3000, seed=2)
    signals[200:, 2] = np.nan
    with pytest.raises(cal.NotEnoughShadowData) as err:
        _calibrate(signals, matched)
    assert err.value.counts[24] == 200


def test_bad_inputs_are_rejected():
    signals, matched = _synthetic(2000, seed=3)
    with pytest.raises(ValueError, match="must both be"):
        _calibrate(signals[:, :2], matched)
    with pytest.raises(ValueError, match="strictly increasing"):
        _calibrate(signals, matched, exit_layers=[16, 8, 24])
    with pytest.raises(ValueError, match="unknown strategy"):
        _calibrate(signals, matched, strategy="greedy")


@pytest.mark.slow
def test_guarantee_holds_on_seeded_synthetic_data():
    """Realised disagreement on fresh data exceeds δ in at most ε of resamples.

    Choosing the most aggressive path step with *empirical* risk <= δ (no bound) violates far
    more often on the same draws, so the assertion can fail for a broken selection.
    """
    delta, epsilon, trials = 0.05, 0.1, 40
    fresh_signals, fresh_matched = _synthetic(200_000, seed=999)
    violations, naive_violations = 0, 0
    for trial in range(trials):
        signals, matched = _synthetic(3000, seed=trial)
        result = _calibrate(signals, matched, delta=delta, epsilon=epsilon, seed=trial)
        thresholds = [result.thresholds[k] for k in LAYERS]
        wrong, n = cal.policy_disagreement(fresh_signals, fresh_matched, thresholds)
        violations += wrong / n > delta
        naive = [p for p in result.curve if p.risk <= delta][-1]
        wrong, n = cal.policy_disagreement(
            fresh_signals, fresh_matched, [naive.thresholds[k] for k in LAYERS]
        )
        naive_violations += wrong / n > delta
    assert violations / trials <= epsilon
    assert naive_violations / trials > epsilon


def test_result_report_fields_and_curve():
    signals, matched = _synthetic(10_000, seed=4)
    result = _calibrate(signals, matched, delta=0.05, epsilon=0.05)
    assert result.risk_bound <= 0.05
    assert result.p_value <= 0.05
    chosen = [p for p in result.curve if p.chosen]
    assert len(chosen) == 1 and chosen[0].thresholds == result.thresholds
    certified = [p.certified for p in result.curve]
    assert certified == sorted(certified, reverse=True)  # a prefix of the path
    exit_rates = [p.exit_rate for p in result.curve]
    assert exit_rates == sorted(exit_rates)
    assert sum(lc.exit_rate for lc in result.layers) == pytest.approx(result.exit_rate)
    assert sum(lc.risk for lc in result.layers) == pytest.approx(result.risk)
    expected = conditional_exit_rates(result.exit_rates)
    for lc in result.layers:
        assert lc.conditional_exit_rate == pytest.approx(expected[lc.layer])
        probs = [p for _, p in lc.match_curve]
        assert probs == sorted(probs)  # the match model: P(match) non-decreasing in the signal
    assert result.samples == {"total": 10_000, "learn": 2400, "test": 5600, "holdout": 2000}
    assert result.holdout is not None and result.holdout.passed
    assert result.holdout.disagreement < 0.08
    json.dumps(result.to_dict())


def test_holdout_check_fails_on_unsafe_thresholds():
    signals, matched = _synthetic(4000, seed=5)
    check = cal.check_holdout(
        {8: 0.0, 16: 0.0, 24: 0.0}, signals=signals, matched=matched, exit_layers=LAYERS,
        num_layers=DEFAULT_NUM_LAYERS, delta=0.05,
    )  # fmt: skip
    assert not check.passed and check.disagreement > 0.5 and check.exit_rate == 1.0
    cal_idx, hold_idx = cal.split_shadow_samples(4000, holdout_fraction=0.25, seed=1)
    assert len(hold_idx) == 1000 and not set(cal_idx) & set(hold_idx)
