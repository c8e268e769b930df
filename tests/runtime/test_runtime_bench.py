"""The benchmark's threshold picking and agreement arithmetic (pure functions)."""

from __future__ import annotations

import random

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
