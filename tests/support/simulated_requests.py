"""Requests of correlated tokens for request-level calibration: a token's chance of matching full
depth depends on its request's difficulty, so a request's tokens agree together."""

from __future__ import annotations

import numpy as np

LAYERS, NUM_LAYERS = [8, 16, 24], 30
TOKENS = 32  # tokens per request


def simulated_requests(count: int, *, seed: int, overconfidence: float = 0.0,
                       first_id: int = 0, spread: float = 0.15):
    """(signals (n, 3), matched (n, 3), request ids) of `count` requests of 32 tokens: a token
    of difficulty d matches full depth at layer k with probability sigmoid(8 k / 30 - 6 d - 1 -
    `overconfidence`), its difficulty a request's (Beta(3, 2)) plus N(0, `spread`) of its own
    (so a request's tokens agree together), the signal a noisy view that does not see
    `overconfidence`: the same signal means less match in a segment with a larger one."""
    rng = np.random.default_rng(seed)
    request_difficulty = np.repeat(rng.beta(3.0, 2.0, size=count), TOKENS)
    n = count * TOKENS
    difficulty = np.clip(request_difficulty + spread * rng.standard_normal(n), 0.0, 1.0)[:, None]
    depth = np.asarray(LAYERS, dtype=float)[None, :] / NUM_LAYERS
    seen = 8.0 * depth - 6.0 * difficulty - 1.0  # (n, L)
    matched = rng.random(seen.shape) < 1.0 / (1.0 + np.exp(-(seen - overconfidence)))
    signals = 1.0 / (1.0 + np.exp(-(1.3 * seen + 0.5 + rng.standard_normal(seen.shape))))
    return signals, matched, np.repeat(np.arange(first_id, first_id + count), TOKENS)
