"""Request-clustered proportions: the design effect is right on the two extremes, and bounds
computed on the effective size keep their coverage on clustered data where token-counting
bounds do not."""

from __future__ import annotations

import numpy as np

from controlplane.stats.clustered import (
    clopper_pearson,
    clustered_proportion,
    clustered_rate,
    layer_design_effects,
    scale_design_effect,
)
from controlplane.stats.exits import policy_outcomes


def _requests(rng, count: int, size: int, mean: float, spread: float):
    """Per-request (tokens, events): each request has its own rate ~ Beta around `mean`."""
    a = mean * (1 / spread - 1)
    b = (1 - mean) * (1 / spread - 1)
    rates = rng.beta(a, b, count)
    events = rng.binomial(size, rates)
    return np.full(count, size), events


def test_independent_tokens_have_design_effect_one():
    rng = np.random.default_rng(0)
    events = rng.random(20_000) < 0.3
    found = clustered_rate(np.arange(20_000), events)
    assert found.clusters == 20_000
    assert 0.9 < found.design_effect < 1.1
    assert abs(found.effective_tokens - 20_000) < 2_000


def test_whole_requests_that_agree_count_once():
    # every token of a request behaves the same: the sample is worth one token per request
    tokens = np.full(200, 50)
    events = np.where(np.arange(200) % 4 == 0, 50, 0)
    found = clustered_proportion(tokens, events)
    assert abs(found.rate - 0.25) < 1e-12
    assert abs(found.design_effect - 50) < 1.0
    assert abs(found.effective_tokens - 200) < 5


def test_no_variation_falls_back_to_one_sample_per_request():
    found = clustered_proportion(np.full(40, 30), np.zeros(40))
    assert (found.events, found.tokens, found.clusters) == (0, 1200, 40)
    assert found.effective_tokens == 40.0
    # 0 events in 40 effective trials: the 95% upper bound is about 7%, not 0.25% (1200 tokens)
    assert 0.06 < found.upper_bound(0.05) < 0.08


def test_upper_bound_keeps_its_coverage_on_clustered_requests():
    rng = np.random.default_rng(7)
    true_rate, covered, covered_tokens = 0.03, 0, 0
    trials = 400
    for _ in range(trials):
        tokens, events = _requests(rng, 60, 40, true_rate, spread=0.2)
        found = clustered_proportion(tokens, events)
        covered += found.upper_bound(0.05) >= true_rate
        covered_tokens += clopper_pearson(found.rate, found.tokens, 0.05)[1] >= true_rate
    # the clustered bound holds its 95% (within simulation noise); counting tokens does not
    assert covered / trials >= 0.92
    assert covered_tokens / trials < 0.85


def test_scale_design_effect_follows_the_intra_request_correlation():
    # d = 1 + (m - 1) rho: measured on 10-token clusters (rho = 0.1), carried to 30 tokens
    assert abs(scale_design_effect(1.9, mean_cluster_size=10, target_cluster_size=30) - 3.9) \
        < 1e-9
    assert scale_design_effect(0.5, mean_cluster_size=10, target_cluster_size=30) == 1.0


def test_policy_outcomes_and_layer_design_effects():
    signals = np.array([[0.95, 0.1], [0.2, 0.9], [0.1, 0.1], [np.nan, 0.99]])
    matched = np.array([[False, True], [True, True], [True, True], [True, False]])
    slot, disagree = policy_outcomes(signals, matched, [0.9, 0.8])
    assert slot.tolist() == [0, 1, 2, 1]
    assert disagree.tolist() == [True, False, False, True]
    rng = np.random.default_rng(3)
    requests = np.repeat(np.arange(100), 20)
    exits_first = np.repeat(rng.random(100) < 0.5, 20)  # a request exits early or never
    slot = np.where(exits_first, 0, 2)
    found = layer_design_effects(requests, slot, [4, 8], min_clusters=10)
    assert found[4].design_effect > 15  # whole requests move together
    assert 8 in found and found[8].events == 0  # reached, never exited there
