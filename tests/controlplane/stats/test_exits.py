"""The exit rule on shadow evidence: the first exit layer whose signal is strictly greater than
its threshold, compared as 32-bit floats as the runtime compares them, so a threshold 32 bits
cannot hold decides a signal at its boundary as the runtime does; calibration, the drift
checks, what-if and the answer loss all use it."""

from __future__ import annotations

import numpy as np
import torch

from controlplane.calibration.what_if import exits_of
from controlplane.stats.answers import first_divergence
from controlplane.stats.exits import passes, policy_outcomes
from exitplane.wire import Signal
from runtime.policy import ExitPolicy


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


def test_the_rule_is_the_runtimes_on_random_boundaries():
    """Thresholds drawn at, just below and just above 32-bit signals, and in between: the
    control plane's verdict equals the runtime's comparison (its float32 signals against the
    thresholds as its policy holds them, `runtime.policy.SegmentRows.limits`) on every pair."""
    rng = np.random.default_rng(0)
    drawn = rng.random(4000).astype(np.float32)
    wide = drawn.astype(np.float64)
    thresholds = np.concatenate([wide, np.nextafter(wide, 2.0), np.nextafter(wide, -1.0),
                                 rng.random(4000)])
    signals = np.tile(drawn, 4)
    policy = ExitPolicy(version=1, signal=Signal.maxprob, thresholds={
        layer: float(t) for layer, t in enumerate(thresholds, start=1)})
    limits = policy.segment_rows.limits[0]  # layer order 1..n: the thresholds' order
    runtime = (torch.from_numpy(signals) > torch.from_numpy(limits)).numpy()
    assert runtime.sum() not in (0, len(runtime))  # both verdicts occur
    assert (passes(signals, thresholds) == runtime).all()
    assert (passes(signals.astype(np.float64), thresholds) == runtime).all()
