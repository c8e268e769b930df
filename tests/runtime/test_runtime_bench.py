"""The benchmark's threshold picking and agreement arithmetic (pure functions)."""

from __future__ import annotations

import random

import pytest

from exitplane.wire import ShadowPoint, Signal, TokenRecord
from runtime.benchmark import calibrate, free_running, oracle_bound, simulate


def shadow_record(i: int, points: list[tuple[int, float, bool]]) -> TokenRecord:
    return TokenRecord(threshold_version=0, request_id="r", position=i, exit_layer=6,
                       signal_value=0.0, latency_us=1, ts=1.0,
                       shadow=[ShadowPoint(layer=k, signal=s, matched=m) for k, s, m in points])


def test_calibrate_respects_the_disagreement_target():
    rng = random.Random(0)
    records = []
    for i in range(400):
        # layer 2: confident tokens match; layer 4 matches more often
        s2 = rng.random()
        s4 = rng.random()
        records.append(shadow_record(i, [(2, s2, s2 > 0.7 or rng.random() < 0.2),
                                         (4, s4, s4 > 0.3 or rng.random() < 0.5)]))
    for target in (0.0, 0.01, 0.05):
        policy, info = calibrate(records, [2, 4], target, Signal.maxprob, num_layers=6)
        assert info["calibration_disagreement"] <= target
        assert policy.signal == Signal.maxprob
        assert set(policy.thresholds) == {2, 4}
    _, loose = calibrate(records, [2, 4], 0.05, Signal.maxprob, num_layers=6)
    _, tight = calibrate(records, [2, 4], 0.0, Signal.maxprob, num_layers=6)
    assert loose["calibration_mean_exit_layer"] < tight["calibration_mean_exit_layer"] < 6


def test_simulate_first_passing_exit_decides():
    import numpy as np

    signal = np.array([[0.9, 0.9], [0.1, 0.9], [0.1, 0.1]])
    matched = np.array([[False, True], [True, True], [True, True]])
    wrong, depth = simulate(signal, matched, np.array([0.5, 0.5]), np.array([2, 4]), 6)
    assert wrong == 1
    assert depth == (2 + 4 + 6) / 3


def test_free_running_counts_length_differences():
    rate, first = free_running([[1, 2, 3], [5, 6]], [[1, 2, 4], [5, 6, 7]])
    assert rate == 2 / 6
    assert first == (2 + 2) / 2


def test_oracle_bound_exits_each_token_at_its_first_matching_exit():
    records = [shadow_record(0, [(2, 0.9, True), (4, 0.9, True)]),    # leaves at 2
               shadow_record(1, [(2, 0.8, False), (4, 0.2, True)]),   # leaves at 4
               shadow_record(2, [(2, 0.1, False), (4, 0.1, False)]),  # full depth 6
               shadow_record(3, [(2, 0.7, True), (4, 0.8, False)])]   # leaves at 2
    bound = oracle_bound(records, [2, 4], num_layers=6)
    assert bound["oracle_mean_exit_layer"] == (2 + 4 + 6 + 2) / 4
    assert bound["oracle_speedup_bound"] == round(6 / 3.5, 3)
    assert bound["agreement_per_layer"] == {"2": 0.5, "4": 0.5}
    # layer 2 ranks 0.9 (match), 0.8 (miss): only the top token is at 99% precision;
    # layer 4 ranks 0.9 (match), 0.8 (miss) as well.
    assert bound["coverage_at_99_precision"] == {"2": 0.25, "4": 0.25}


def timed_record(i: int, depth: int, checks: int | None, *, shadow: bool = False) -> TokenRecord:
    """A token of a machine where a token costs 1 ms + 0.1 ms per layer + 0.05 ms per check."""
    points = [ShadowPoint(layer=k, signal=0.5, matched=True) for k in (12, 24)] if shadow else None
    return TokenRecord(threshold_version=1, request_id="r", position=i, exit_layer=depth,
                       signal_value=None, latency_us=1000 + 100 * depth + 50 * (checks or 0),
                       ts=1.0, exit_checks=checks, shadow=points)


def tally(records: list[TokenRecord]):
    from runtime.benchmark import Tally

    found = Tally()
    found.add([[0] * len(records)], records, sum(r.latency_us for r in records) / 1e6)
    return found


def test_cost_groups_sum_each_depth_and_check_count_and_skip_untimed_tokens():
    from runtime.benchmark import cost_groups

    records = [timed_record(0, 12, 1), timed_record(1, 12, 1), timed_record(2, 30, 2),
               timed_record(3, 30, None)]
    assert cost_groups(records) == {"depths": [12, 30], "checks": [2, 2],
                                    "latency_us": [2 * 2250, 4100], "tokens": [2, 1]}


def test_savings_report_the_fitted_model_and_a_loss_as_a_loss():
    from controlplane.stats.cost_model import fit_cost_model
    from runtime.benchmark import savings

    full = tally([timed_record(i, 30, 0) for i in range(60)])
    early = tally([timed_record(i, 12 if i % 2 else 30, 1 if i % 2 else 2) for i in range(60)])
    found = savings(full, early, early, fit_cost_model, num_layers=30)
    model = found["cost_model"]
    assert model["overhead_us"] == pytest.approx(1000, abs=1)
    assert model["layer_us"] == pytest.approx(100, abs=0.1)
    assert model["check_us"] == pytest.approx(50, abs=0.5)
    # half the tokens save 18 layers (1,800 us) for one check, the rest pay two checks
    expected = (1800 - 50 - 100) / 2 / 4000
    assert found["model_net_saving"] == pytest.approx(expected, abs=1e-3)
    assert found["measured_speedup"] == pytest.approx(4000 / (4000 - expected * 4000), rel=1e-3)
    # every token shadowed: full depth plus two checks each, a net loss
    watched = tally([timed_record(i, 30, 2, shadow=True) for i in range(60)])
    lost = savings(full, early, watched, fit_cost_model, num_layers=30)
    assert lost["model_net_saving"] < 0 and lost["measured_net_saving"] < 0
    assert lost["watched_shadow_tokens"] == 60
    assert lost["shadow_tokens_measured_us"] == pytest.approx(4100)
