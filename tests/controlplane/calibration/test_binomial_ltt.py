"""The exact binomial test behind Learn-Then-Test and the logistic match model that draws its
path: known answers against scipy's binomial law and a hand sum, never
above the Hoeffding-Bentkus p-value, its Clopper-Pearson bound, the logistic fit against
scikit-learn's, and validity on simulated Bernoulli streams whose true risk is known: over many
seeds the calibrator certifies thresholds whose true risk is above δ in at most ε of them
(while a rule without the test, "empirical risk <= δ", does so far more often)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binom
from sklearn.linear_model import LogisticRegression

from controlplane.calibration import learn_then_test as cal
from controlplane.calibration.segments import calibrate_segments
from controlplane.stats.synthetic import DEFAULT_EXIT_LAYERS, DEFAULT_NUM_LAYERS, shadow_samples
from tests.support.calibration import LAYERS as SUPPORT_LAYERS
from tests.support.calibration import separable_samples

DELTA, EPSILON = 0.05, 0.1


def test_binomial_p_value_is_the_exact_lower_tail():
    # P(Bin(100, 0.1) <= 5), summed by hand
    by_hand = sum(math.comb(100, i) * 0.1**i * 0.9 ** (100 - i) for i in range(6))
    assert cal.binomial_p_value(5, 100, 0.1) == pytest.approx(by_hand, rel=1e-12)
    assert by_hand == pytest.approx(0.0575769, rel=1e-5)
    losses = np.arange(0, 120)
    assert np.allclose(cal.binomial_p_value(losses, 1075, DELTA), binom.cdf(losses, 1075, DELTA))
    assert cal.binomial_p_value(0, 1000, 0.01) == pytest.approx(0.99**1000, rel=1e-9)
    assert cal.binomial_p_value(1000, 1000, 0.01) == 1.0


def test_binomial_p_value_is_never_above_hoeffding_bentkus_and_drops_the_factor_e():
    for n in (50, 384, 1075, 5376):
        losses = np.arange(0, n // 5)
        exact = cal.binomial_p_value(losses, n, DELTA)
        hb = cal.hb_p_value(losses / n, n, DELTA)
        assert np.all(exact <= hb + 1e-15)
        assert np.all(np.diff(exact) >= 0)  # more losses, weaker evidence
    # where Bentkus' term decides, HB is exactly e times the binomial tail
    assert cal.hb_p_value(5 / 100, 100, 0.1) == pytest.approx(
        np.e * cal.binomial_p_value(5, 100, 0.1), rel=1e-9)


def test_clopper_pearson_bound_matches_the_test():
    n, eps = 2000, 0.05
    for losses in (0, 3, 60, 150):
        bound = cal.binomial_upper_bound(losses, n, eps)
        assert losses / n < bound < 1
        # the bound is where the test stops rejecting "risk >= R"
        assert cal.binomial_p_value(losses, n, bound) == pytest.approx(eps, rel=1e-6)
        assert cal.binomial_p_value(losses, n, bound * 1.001) < eps
    assert cal.binomial_upper_bound(0, 1000, 0.05) == pytest.approx(1 - 0.05 ** (1 / 1000))
    assert cal.binomial_upper_bound(n, n, eps) == 1.0
    assert np.allclose(cal.binomial_upper_bound(np.array([0, 3]), n, eps),
                       [cal.binomial_upper_bound(0, n, eps), cal.binomial_upper_bound(3, n, eps)])


def _stream(n: int, rng: np.random.Generator):
    """One exit layer, signal uniform on (0, 1), mismatch probability 0.3 (1 - s): the risk of
    threshold t is 0.15 (1 - t)^2, above δ = 0.05 exactly when t < 1 - sqrt(1/3)."""
    signals = rng.random((n, 1))
    matched = rng.random((n, 1)) >= 0.3 * (1.0 - signals)
    return signals, matched


def _true_risk(threshold: float) -> float:
    return 0.15 * (1.0 - threshold) ** 2


def test_logistic_match_model_is_sklearns_fit_made_monotone():
    rng = np.random.default_rng(3)
    signals = rng.random(3000) ** 3
    matched = rng.random(3000) < np.sqrt(signals)
    model = cal.LogisticMatchModel(signals, matched)
    reference = LogisticRegression(C=1.0, tol=1e-10, max_iter=10_000).fit(
        cal.LogisticMatchModel._features(signals), matched)
    grid = cal.LogisticMatchModel.GRID
    expected = np.maximum.accumulate(
        reference.predict_proba(cal.LogisticMatchModel._features(grid))[:, 1])
    assert np.allclose(model.predict(grid), expected, atol=1e-6)
    assert np.all(np.diff(model.predict(np.sort(rng.random(500)))) >= 0)
    # fitted P(match) follows the truth sqrt(s) where the data is
    assert model.predict([0.5])[0] == pytest.approx(np.sqrt(0.5), abs=0.08)
    # nothing to fit: a flat curve at the observed share (0 for a layer never observed)
    assert set(cal.LogisticMatchModel(signals, np.ones(3000, bool)).predict(grid)) == {1.0}
    assert set(cal.LogisticMatchModel(np.array([]), np.array([], bool)).predict(grid)) == {0.0}
    with pytest.raises(ValueError, match="unknown match model 'spline'"):
        cal.fit_match_models(signals[:, None], matched[:, None], "spline")


@pytest.mark.slow  # 1,800 calibrations: ~30 s on the shared 2-core box
def test_binomial_ltt_certifies_a_risk_above_delta_in_at_most_epsilon_of_seeds():
    trials, n, slack = 600, 1000, 0.03  # slack: 2.5 sd of a rate near ε over 600 trials
    grid = np.round(np.linspace(1.0, 0.0, 201), 3)
    over = {"binomial": 0, "hoeffding-bentkus": 0, "logistic path": 0, "no test": 0}
    chosen = {"binomial": [], "hoeffding-bentkus": []}
    for seed in range(trials):
        signals, matched = _stream(n, np.random.default_rng(seed))
        for test in ("binomial", "hoeffding-bentkus"):
            result = cal.calibrate_thresholds(
                signals=signals, matched=matched, exit_layers=[8], num_layers=30, delta=DELTA,
                epsilon=EPSILON, strategy="shared", grid=grid, holdout_fraction=0.0,
                min_samples_per_layer=100, seed=seed, risk_test=test)
            assert result.risk_test == test
            threshold = result.thresholds[8]
            chosen[test].append(threshold)
            over[test] += _true_risk(threshold) > DELTA
        # the default: a path drawn by the logistic match model on a learn part
        path = cal.calibrate_thresholds(
            signals=signals, matched=matched, exit_layers=[8], num_layers=30, delta=DELTA,
            epsilon=EPSILON, holdout_fraction=0.0, min_samples_per_layer=100, seed=seed)
        assert path.match_model == "logistic" and path.samples["learn"] == 300
        over["logistic path"] += _true_risk(path.thresholds[8]) > DELTA
        # the foil: the most aggressive grid step whose empirical risk is <= δ, untested
        risks = [cal.policy_disagreement(signals, matched, [t])[0] / n for t in grid]
        ok = np.flatnonzero(np.array(risks) > DELTA)
        naive = grid[ok[0] - 1] if len(ok) else grid[-1]
        over["no test"] += _true_risk(naive) > DELTA
    rates = {test: count / trials for test, count in over.items()}
    print(rates, {test: float(np.mean(values)) for test, values in chosen.items()})
    assert rates["binomial"] <= EPSILON + slack
    assert rates["logistic path"] <= EPSILON + slack
    assert rates["hoeffding-bentkus"] <= rates["binomial"]
    assert rates["no test"] > EPSILON + slack  # the check could fail
    # and the exact test is not vacuous: it exits more than Hoeffding-Bentkus, never less
    assert all(b <= h for b, h in zip(chosen["binomial"], chosen["hoeffding-bentkus"],
                                      strict=True))
    assert np.mean(chosen["binomial"]) < np.mean(chosen["hoeffding-bentkus"])


def test_an_unknown_risk_test_is_a_clear_error():
    signals, matched = _stream(500, np.random.default_rng(1))
    with pytest.raises(ValueError, match="unknown test 'student'"):
        cal.calibrate_thresholds(signals=signals, matched=matched, exit_layers=[8],
                                 num_layers=30, delta=DELTA, epsilon=EPSILON,
                                 min_samples_per_layer=100, risk_test="student")


def test_a_segment_with_enough_tokens_spends_its_whole_share_on_its_own_ltt():
    rng = np.random.default_rng(12)
    chat = shadow_samples(4000, rng=rng, domain="A")
    code = shadow_samples(4000, rng=rng, domain="B")
    layers = list(DEFAULT_EXIT_LAYERS)
    result = calibrate_segments(
        signals=np.vstack([chat[0], code[0]]), matched=np.vstack([chat[1], code[1]]),
        segments=np.array(["chat"] * 4000 + ["code"] * 4000), exit_layers=layers,
        num_layers=DEFAULT_NUM_LAYERS, delta=DELTA, epsilon=EPSILON)
    for name in ("chat", "code"):
        seg = result.segments[name]
        assert seg.source == "segment"
        # Šidák over the two own tests (calibration.segments), more than ε/k
        assert seg.result.epsilon == pytest.approx(1 - (1 - EPSILON) ** 0.5)
        assert seg.result.epsilon > EPSILON / 2
        assert seg.epsilon == seg.result.epsilon and seg.pooled_check is None
        assert seg.result.risk_test == "binomial"
        assert "(1/m) = 0.05132 (Šidák over the m = 2 own tests of k = 2" in seg.reason
    with pytest.raises(ValueError, match="pooled_check_share"):
        calibrate_segments(signals=chat[0], matched=chat[1], segments=np.array(["a"] * 4000),
                           exit_layers=layers, num_layers=DEFAULT_NUM_LAYERS, delta=DELTA,
                           epsilon=EPSILON, pooled_check_share=1.0)


def test_a_plateau_in_the_match_curve_is_crossed_in_small_steps():
    """4,000 tokens that never match at any signal, then 3,000 that match exactly above 0.5:
    P(match) is 0 below 0.5 and a flat 0.43 above. The fixed levels alone cross the flat part
    of a smooth fit in big steps (the first exiting one lets 16% of tokens exit at once, its
    risk is above δ: nothing is certified); levels read off the fit at signal quantiles keep
    each step small and certify a few percent of exits."""
    never = separable_samples(4000, seed=1, mismatch_below=1.1)
    step = separable_samples(3000, seed=7)
    options = dict(signals=np.vstack([never[0], step[0]]).astype(float),
                   matched=np.vstack([never[1], step[1]]), exit_layers=SUPPORT_LAYERS,
                   num_layers=12, delta=DELTA, epsilon=EPSILON, min_samples_per_layer=500)

    def biggest_step(result):
        rates = [point.exit_rate for point in result.curve if point.exit_rate < 0.6]
        return max(np.diff(rates))

    result = cal.calibrate_thresholds(**options)
    assert biggest_step(result) < 0.05
    assert result.exit_rate > 0.05 and result.risk <= DELTA
    coarse = cal.calibrate_thresholds(**options, grid=cal.default_levels())
    assert biggest_step(coarse) > 0.15
    assert coarse.exit_rate == 0.0  # the failure the quantile levels fixed
