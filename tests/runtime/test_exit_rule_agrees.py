"""The control plane's exit rule on shadow evidence (`controlplane.stats.exits`) decides every
signal as the runtime does: its float32 signals against the thresholds as its policy holds them,
compared by torch."""

from __future__ import annotations

import numpy as np
import torch

from controlplane.stats.exits import passes
from exitplane.wire import Signal
from runtime.policy import ExitPolicy


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
