"""The exit rule, as the control plane evaluates it on shadow evidence.

A token exits at the first exit layer whose signal is strictly greater than that layer's
threshold (docs/protocol.md, "Signals and exits"), compared as 32-bit floats: signals are
32-bit values (the runtime computes them so, and the store keeps them so) and the runtime rounds
each threshold to 32 bits before comparing (`runtime.policy`). A threshold that 32 bits cannot
hold, such as 0.8, therefore decides a signal at that boundary here exactly as in the runtime.
A NaN signal (the layer was not checked) never exits, nor does a threshold of 1.0.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def as_compared(values: np.ndarray | Sequence[float]) -> np.ndarray:
    """Signals or thresholds as the exit rule compares them: 32-bit floats."""
    return np.asarray(values, dtype=np.float32)


def passes(signals: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """Whether each signal clears its threshold (shapes broadcast), under the exit rule."""
    return as_compared(signals) > as_compared(thresholds)


def first_exit(exits: np.ndarray) -> np.ndarray:
    """The exit index of each row of `exits` (bool (..., L): layers passed), L where none."""
    width = exits.shape[-1]
    return np.where(exits.any(axis=-1), exits.argmax(axis=-1), width)


def policy_outcomes(signals: np.ndarray, matched: np.ndarray,
                    thresholds: Sequence[float] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per shadow token under a threshold vector (exit-layer order; or one row per token):
    its exit index (L: full depth) and whether that exit disagrees with full depth."""
    matched = np.asarray(matched, dtype=bool)
    exits = np.atleast_2d(passes(signals, np.atleast_1d(as_compared(thresholds))))
    first = first_exit(exits)
    width = exits.shape[1]
    rows = np.arange(len(first))
    disagree = (first < width) & ~matched[rows, np.minimum(first, width - 1)] \
        if len(first) else np.zeros(0, dtype=bool)
    return first, disagree
