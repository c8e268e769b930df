"""Seeded synthetic shadow samples and exit streams for tests, benches and demos."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DEFAULT_EXIT_LAYERS = (8, 16, 24)
DEFAULT_NUM_LAYERS = 30

# Per-domain difficulty distribution (Beta parameters): domain B is harder than A.
DOMAINS = {"A": (2.0, 3.0), "B": (3.0, 2.0)}


def shadow_samples(
    n: int,
    *,
    rng: np.random.Generator,
    exit_layers: Sequence[int] = DEFAULT_EXIT_LAYERS,
    num_layers: int = DEFAULT_NUM_LAYERS,
    domain: str = "A",
    signal_noise: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """(signals (n, L), matched (n, L)) from a latent-difficulty model.

    A token of difficulty d matches full depth at layer k with probability
    sigmoid(8 k / num_layers - 6 d - 1): deeper layers and easier tokens agree more. The
    signal is a noisy, slightly over-confident view of that probability.
    """
    a, b = DOMAINS[domain]
    difficulty = rng.beta(a, b, size=(n, 1))
    depth = np.asarray(exit_layers, dtype=float)[None, :] / num_layers
    logit = 8.0 * depth - 6.0 * difficulty - 1.0  # (n, L)
    matched = rng.random(logit.shape) < 1.0 / (1.0 + np.exp(-logit))
    noisy = 1.3 * logit + 0.5 + signal_noise * rng.standard_normal(logit.shape)
    return 1.0 / (1.0 + np.exp(-noisy)), matched


def exit_stream(
    hazards: np.ndarray,
    *,
    rng: np.random.Generator,
    exit_layers: Sequence[int] = DEFAULT_EXIT_LAYERS,
    num_layers: int = DEFAULT_NUM_LAYERS,
) -> np.ndarray:
    """Exit layer per token; hazards (n, L) or (L,) are conditional exit rates per layer.

    With (L,) hazards one token is drawn; pass (n, L) (e.g. np.tile) for a stream whose rates
    change over time. Full-depth tokens get `num_layers`.
    """
    h = np.atleast_2d(np.asarray(hazards, dtype=float))
    exits = rng.random(h.shape) < h  # (n, L)
    first = np.where(exits.any(axis=1), exits.argmax(axis=1), h.shape[1])
    return np.append(np.asarray(exit_layers), num_layers)[first]


def correlated_requests(
    requests: int,
    *,
    rng: np.random.Generator,
    tokens_per_request: int = 32,
    request_effect: float = 3.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(signals (n, 1), matched (n, 1), request id per token): one exit layer whose tokens
    agree with full depth more often as the signal rises (logit 3 + 8 (s - 0.5)), shifted per
    request by `request_effect` x N(0, 1), so that a request's tokens agree or disagree together
    beyond what the signal says (the request-level Learn-Then-Test's simulations)."""
    n = requests * tokens_per_request
    shift = np.repeat(rng.normal(size=requests), tokens_per_request) * request_effect
    signals = 1.0 / (1.0 + np.exp(-rng.normal(size=n)))
    match_logit = 3.0 + 8.0 * (signals - 0.5) + shift
    matched = rng.random(n) < 1.0 / (1.0 + np.exp(-match_logit))
    return signals[:, None], matched[:, None], np.repeat(np.arange(requests), tokens_per_request)
