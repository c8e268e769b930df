"""The exit rule on shadow evidence: the first exit layer whose signal is strictly greater than
its threshold, compared as 32-bit floats as the runtime compares them, so a threshold 32 bits
cannot hold decides a signal at its boundary as the runtime does (checked against the runtime
itself in tests/runtime/test_exit_rule_agrees.py); calibration, the drift checks, what-if and
the answer loss all use it."""

from __future__ import annotations

import numpy as np

from controlplane.calibration.what_if import exits_of
from controlplane.stats.answers import first_divergence
from controlplane.stats.exits import passes, policy_outcomes


def test_a_token_exits_at_its_first_layer_above_the_threshold():
    signals = np.array([[0.9, 0.1], [0.2, 0.95], [0.2, 0.3], [0.5, 0.99]])
    matched = np.array([[False, True], [True, True], [True, False], [True, False]])
    first, disagree = policy_outcomes(signals, matched, [0.8, 0.9])
    assert first.tolist() == [0, 1, 2, 1]
    assert disagree.tolist() == [True, False, False, True]
    # strict ">": a signal equal to the threshold does not exit; 1.0 never exits; NaN never
    first, _ = policy_outcomes(np.array([[0.8, 1.0], [np.nan, 0.5]]),
                               np.ones((2, 2), dtype=bool), [0.8, 1.0])
    assert first.tolist() == [2, 2]
    assert policy_outcomes(np.zeros((0, 2)), np.zeros((0, 2), dtype=bool), [0.5, 0.5])[0].size == 0


def test_signals_at_a_threshold_float32_cannot_hold_decide_as_in_the_runtime():
    """0.8 is 0.800000011920929 in 32 bits: a stored signal of that value does not clear a
    threshold of 0.8 in the runtime (both rounded alike), and the next 32-bit value does."""
    at = np.float32(0.8)
    above = np.nextafter(at, np.float32(1))
    signals = np.array([[at], [above]], dtype=np.float32)
    assert passes(signals, np.array([0.8])).ravel().tolist() == [False, True]
    assert policy_outcomes(signals, np.zeros((2, 1), dtype=bool), [0.8])[1].tolist() == \
        [False, True]
    assert exits_of(signals, np.array([0.8])).tolist() == [1, 0]
    # one request: a mismatched token at the boundary leaves the answer the full-depth one
    assert first_divergence(signals[:1], np.zeros((1, 1), dtype=bool),
                            np.array([[0.8]])).tolist() == [-1]
    assert first_divergence(signals, np.zeros((2, 1), dtype=bool),
                            np.array([[0.8]])).tolist() == [1]
