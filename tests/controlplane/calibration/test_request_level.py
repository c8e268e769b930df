"""Learn-Then-Test at the request level: tokens of one request are correlated, so the calibrator's
p-values deflate the token count by a design effect read under the null
(calibration.learn_then_test, "the request-level test"). Known answers of the design effect,
the exact reduction to the token test when every request is one token, whole requests in each
part, and validity on simulated requests whose tokens are strongly correlated: where the token
test rejects a true null far more often than ε, the request-level one stays within ε (the p-value
at the boundary R = δ, and the whole calibrator's chosen thresholds against their true risk)."""

from __future__ import annotations

import numpy as np
import pytest

from controlplane.calibration import learn_then_test as cal
from controlplane.calibration.segments import calibrate_segments
from controlplane.stats.clustered import (
    binomial_lower_tail,
    binomial_upper_tail,
    null_design_effect,
)
from controlplane.stats.synthetic import correlated_requests
from tests.support.calibration import LAYERS, separable_samples

DELTA, EPSILON = 0.05, 0.1
SIZE = 32  # tokens per simulated request


def test_null_design_effect_known_answers():
    sizes = np.full(10, SIZE)
    # no disagreement at all: each request's score is -δ n_i, so d = δ/(1-δ) * n_i
    assert null_design_effect(sizes, np.zeros(10), DELTA)[0] == pytest.approx(
        DELTA / (1 - DELTA) * SIZE)
    # all-or-nothing requests reach the ceiling: each request is one draw
    all_or_nothing = np.array([SIZE, 0, 0, 0, 0, 0, 0, 0, 0, 0])
    assert null_design_effect(sizes, all_or_nothing, DELTA)[0] == pytest.approx(SIZE)
    # exactly the binomial spread: the floor 1 (never more confident than the token test)
    assert null_design_effect(np.ones(100), np.r_[np.ones(5), np.zeros(95)], DELTA)[0] == 1.0
    # continuous binomial tail agrees with the exact one on integers
    from scipy.stats import binom
    assert np.allclose(binomial_lower_tail(np.arange(20), 300, DELTA),
                       binom.cdf(np.arange(20), 300, DELTA))
    assert np.allclose(binomial_upper_tail(np.arange(20), 300, DELTA),
                       binom.sf(np.arange(20) - 1, 300, DELTA))


def test_one_token_per_request_is_exactly_the_token_test():
    rng = np.random.default_rng(3)
    losses = rng.binomial(1, 0.03, size=(50, 800))
    for test in cal.TESTS:
        p_values, design = cal.clustered_risk_p_values(losses, np.ones(800), DELTA,
                                                       alpha=EPSILON, test=test)
        assert np.array_equal(p_values, cal.risk_p_values(losses.sum(axis=1), 800, DELTA, test))
        assert np.all(design == 1.0)
    signals, matched = separable_samples(3000, seed=5, mismatch_below=0.6)
    options = dict(signals=signals, matched=matched, exit_layers=LAYERS, num_layers=12,
                   delta=DELTA, epsilon=EPSILON, min_samples_per_layer=500)
    plain = cal.calibrate_thresholds(**options)
    singletons = cal.calibrate_thresholds(requests=np.arange(3000), **options)
    assert singletons.thresholds == plain.thresholds and singletons.exit_rate > 0.3
    assert singletons.p_value == plain.p_value
    assert [p.p_value for p in singletons.curve] == [p.p_value for p in plain.curve]
    assert singletons.risk_unit == plain.risk_unit == "token"
    assert singletons.samples == plain.samples


def test_with_request_ids_the_parts_are_whole_requests_and_the_result_says_so():
    signals, matched = separable_samples(4000, seed=6, mismatch_below=0.6)
    requests = np.repeat(np.arange(4000 // 40), 40)
    result = cal.calibrate_thresholds(signals=signals, matched=matched, exit_layers=LAYERS,
                                      num_layers=12, delta=DELTA, epsilon=EPSILON,
                                      min_samples_per_layer=500, requests=requests)
    samples = result.samples
    assert result.risk_unit == "request" and result.design_effect >= 1.0
    assert samples["requests"] == 100
    # no request is split across learn, test and holdout
    assert samples["learn_requests"] + samples["test_requests"] + samples[
        "holdout_requests"] == 100
    assert samples["learn"] + samples["test"] + samples["holdout"] == 4000
    assert samples["test"] == 40 * samples["test_requests"]
    assert result.exit_rate > 0.3  # independent tokens in requests: little is lost
    with pytest.raises(ValueError, match="one id per sample"):
        cal.calibrate_thresholds(signals=signals, matched=matched, exit_layers=LAYERS,
                                 num_layers=12, delta=DELTA, epsilon=EPSILON,
                                 min_samples_per_layer=500, requests=requests[:10])


def test_request_level_bound_is_where_the_test_starts_rejecting():
    rng = np.random.default_rng(4)
    sizes = rng.integers(5, 80, size=60)
    losses = rng.binomial(sizes, rng.beta(0.3, 10, size=60))
    bound = cal.clustered_risk_upper_bound(losses, sizes, EPSILON)[0]
    assert losses.sum() / sizes.sum() < bound < 1
    p_at, _ = cal.clustered_risk_p_values(losses, sizes, bound, alpha=EPSILON)
    p_below, _ = cal.clustered_risk_p_values(losses, sizes, bound * 0.995, alpha=EPSILON)
    assert p_at[0] <= EPSILON < p_below[0]
    # clustering widens it beyond the token bound
    assert bound > cal.binomial_upper_bound(int(losses.sum()), int(sizes.sum()), EPSILON)
    # Hoeffding-Bentkus on the same effective count is never below the binomial test
    many = rng.binomial(sizes, rng.beta(0.3, 10, size=(200, 60)))
    exact, _ = cal.clustered_risk_p_values(many, sizes, DELTA, alpha=EPSILON)
    hb, _ = cal.clustered_risk_p_values(many, sizes, DELTA, alpha=EPSILON,
                                        test="hoeffding-bentkus")
    assert np.all(hb >= exact - 1e-12) and np.any(hb > exact)


def _beta_binomial(rng, draws: int, requests: int, concentration: float) -> np.ndarray:
    """(draws, requests) disagreements of SIZE-token requests whose rates are Beta with mean δ
    (the null's boundary): intra-request correlation 1 / (concentration + 1)."""
    rates = rng.beta(DELTA * concentration, (1 - DELTA) * concentration,
                     size=(draws, requests))
    return rng.binomial(SIZE, rates)


def test_request_level_p_value_stays_within_epsilon_where_the_token_test_does_not():
    """At R = δ exactly a valid p-value rejects at most ε of the time. Requests with
    intra-request correlation 0.25 (34 tested, 26 others for the design effect, the sizes of a
    60-request segment's LTT): the token test rejects in about a third of draws."""
    rng = np.random.default_rng(11)
    draws, tested, others = 3000, 34, 26
    tested_losses = _beta_binomial(rng, draws, tested, concentration=3.0)
    other_losses = _beta_binomial(rng, draws, others, concentration=3.0)
    token_p = cal.binomial_p_value(tested_losses.sum(axis=1), tested * SIZE, DELTA)
    request_p, design = cal.clustered_risk_p_values(
        tested_losses, np.full(tested, SIZE), DELTA, alpha=EPSILON,
        reference=(other_losses, np.full(others, SIZE)))
    token_rate, request_rate = np.mean(token_p <= EPSILON), np.mean(request_p <= EPSILON)
    assert token_rate > 3 * EPSILON
    assert request_rate <= EPSILON, request_rate
    assert np.median(design) > 3  # the clustering it pays for
    # the test sample's own reading alone is not enough (why the reference is there)
    alone_p, _ = cal.clustered_risk_p_values(tested_losses, np.full(tested, SIZE), DELTA,
                                             alpha=EPSILON)
    assert np.mean(alone_p <= EPSILON) > EPSILON


def test_learn_then_test_on_correlated_requests_keeps_the_chosen_risk_within_delta():
    """The whole calibrator, repeated on fresh samples of 120 requests: the share of trials
    whose chosen threshold has a true risk (on 20,000 requests) above δ."""
    rng = np.random.default_rng(0)
    grid = np.linspace(1.0, 0.0, 101)
    population_s, population_m, _ = correlated_requests(20_000, rng=rng, request_effect=3.0)
    true_risk = np.array([((population_s[:, 0] > t) & ~population_m[:, 0]).mean()
                          for t in grid])
    violations = {"token": 0, "request": 0}
    trials = 60
    for trial in range(trials):
        signals, matched, requests = correlated_requests(120, rng=rng, request_effect=3.0)
        for unit, ids in (("token", None), ("request", requests)):
            result = cal.calibrate_thresholds(
                signals=signals, matched=matched, exit_layers=[4], num_layers=8, delta=DELTA,
                epsilon=EPSILON, strategy="shared", grid=grid, holdout_fraction=0.4,
                min_samples_per_layer=10, requests=ids, seed=trial)
            threshold = result.thresholds[4]
            risk = 0.0 if threshold >= 1.0 else true_risk[np.argmin(np.abs(grid - threshold))]
            violations[unit] += risk > DELTA
            assert result.risk_bound <= DELTA  # a certified step's bound (never-exit: 0)
    assert violations["token"] / trials > 1.5 * EPSILON, violations
    assert violations["request"] / trials <= EPSILON, violations


def test_segments_calibrate_at_the_request_level_when_ids_are_given():
    signals, matched = separable_samples(6000, seed=8, mismatch_below=0.6)
    labels = np.where(np.arange(6000) < 3000, "chat", "code")
    requests = np.repeat(np.arange(6000 // 30), 30)
    result = calibrate_segments(signals=signals, matched=matched, segments=labels,
                                requests=requests, exit_layers=LAYERS, num_layers=12,
                                delta=DELTA, epsilon=EPSILON, min_samples_per_layer=500)
    assert result.pooled is not None and result.pooled.risk_unit == "request"
    for name in ("chat", "code"):
        own = result.segments[name]
        assert own.source == "segment" and own.result.risk_unit == "request"
        assert own.result.samples["requests"] == own.requests == 100
    without = calibrate_segments(signals=signals, matched=matched, segments=labels,
                                 exit_layers=LAYERS, num_layers=12, delta=DELTA,
                                 epsilon=EPSILON, min_samples_per_layer=500)
    assert without.segments["chat"].result.risk_unit == "token"


def test_a_small_segments_pooled_check_tests_its_check_requests():
    """A segment too small for its own LTT keeps the pooled set only if the check, at the
    request level, certifies it: its p-value is the request-level one on its check requests,
    never below the token-level one."""
    signals, matched = separable_samples(4000, seed=9, mismatch_below=0.6)
    labels = np.where(np.arange(4000) < 3600, "chat", "tiny")
    requests = np.repeat(np.arange(4000 // 40), 40)
    options = dict(signals=signals, matched=matched, segments=labels, exit_layers=LAYERS,
                   num_layers=12, delta=DELTA, epsilon=EPSILON, min_samples_per_layer=500)
    clustered = calibrate_segments(requests=requests, **options).segments["tiny"]
    tokens = calibrate_segments(**options).segments["tiny"]
    assert clustered.pooled_check is not None and tokens.pooled_check is not None
    check = clustered.pooled_check
    assert clustered.requests == 10 and check.tokens == 3 * 40  # 30% of its requests, whole
    token_level = float(cal.binomial_p_value(check.disagreements, check.tokens, DELTA))
    assert check.p_value > token_level  # 3 requests weigh less than 120 independent tokens
    assert tokens.pooled_check.tokens == 120 and tokens.source in ("pooled", "conservative")


def test_holdout_check_counts_requests_not_tokens():
    # Two held-out requests, one of which disagrees on 4 of its 14 tokens: as 28 independent
    # tokens that is "significantly above δ" (p 0.049) and failed a demo recalibration; two
    # requests are almost no evidence. Many requests that disagree are still caught, and one
    # token per request is exactly the token test.
    from controlplane.calibration.learn_then_test import check_holdout

    thresholds = {3: 0.5, 6: 0.5, 9: 0.5}
    shape = dict(exit_layers=[3, 6, 9], num_layers=12, delta=0.05, thresholds=thresholds)
    signals, matched = np.full((28, 3), 0.99), np.ones((28, 3), dtype=bool)
    matched[:4, 0] = False
    tokens = check_holdout(signals=signals, matched=matched, **shape)
    two = check_holdout(signals=signals, matched=matched, codes=np.repeat([0, 1], 14), **shape)
    single = check_holdout(signals=signals, matched=matched, codes=np.arange(28), **shape)
    assert not tokens.passed and tokens.p_value < 0.05
    assert two.passed and two.p_value > 0.5
    assert single.p_value == tokens.p_value
    rng = np.random.default_rng(0)
    signals, matched = np.full((400, 3), 0.99), np.ones((400, 3), dtype=bool)
    matched[rng.random(400) < 0.3, 0] = False
    many = check_holdout(signals=signals, matched=matched,
                         codes=np.repeat(np.arange(40), 10), **shape)
    assert not many.passed and many.p_value < 1e-3
