"""The cost model fit: from groups of noisy timed tokens it finds the time per layer, per exit
check and the overhead the tokens follow; it fits nothing when the data cannot tell them apart
(too few tokens, one depth, checks that move only with depth)."""

import numpy as np
import pytest

from controlplane.stats.cost_model import fit_cost_model

LAYERS = (8, 16, 24)
FULL = 32


def _groups(rng, *, overhead=900.0, layer=55.0, check=120.0, never_exit_share=0.3):
    """Per (depth, checked or not) group of tokens: their count, summed checks and summed noisy
    wall time. Tokens under a never-exit set reach full depth with no checks."""
    depths, checks, latency, tokens = [], [], [], []
    for depth in (*LAYERS, FULL):
        for checked in (True, False):
            if not checked and depth != FULL:
                continue
            count = int(rng.integers(200, 400) * (never_exit_share if not checked else 1))
            per_token = sum(k <= depth for k in LAYERS) if checked else 0
            times = overhead + layer * depth + check * per_token + rng.normal(0, 40, count)
            depths.append(depth)
            checks.append(per_token * count)
            latency.append(times.sum())
            tokens.append(count)
    return depths, checks, latency, tokens


def test_the_fit_recovers_the_model_the_tokens_follow():
    model = fit_cost_model(*_groups(np.random.default_rng(3)), num_layers=FULL)
    assert model.layer_us == pytest.approx(55.0, rel=0.02)
    assert model.check_us == pytest.approx(120.0, rel=0.05)
    assert model.overhead_us == pytest.approx(900.0, rel=0.05)
    assert model.full_depth_us == pytest.approx(900.0 + 55.0 * FULL, rel=0.01)


def test_no_fit_where_the_data_cannot_tell_the_costs_apart():
    depths, checks, latency, tokens = _groups(np.random.default_rng(4), never_exit_share=0.0)
    # Only the two deepest groups: three checks each, so checks are the overhead's twin.
    deep = [index for index, depth in enumerate(depths) if depth >= 24 and tokens[index]]
    picked = [[values[i] for i in deep] for values in (depths, checks, latency, tokens)]
    assert fit_cost_model(*picked, num_layers=FULL) is None
    one_depth = [[values[0]] for values in (depths, checks, latency, tokens)]
    assert fit_cost_model(*one_depth, num_layers=FULL) is None
    few = [depths, checks, latency, [min(count, 10) for count in tokens]]
    assert fit_cost_model(*few, num_layers=FULL) is None


def test_tokens_without_checks_fit_no_time_per_check():
    depths, latency = [8, 16, 32], [100 * (500 + 40 * d) for d in (8, 16, 32)]
    model = fit_cost_model(depths, [0, 0, 0], latency, [100, 100, 100], num_layers=FULL)
    assert model.check_us == 0.0
    assert model.layer_us == pytest.approx(40.0) and model.overhead_us == pytest.approx(500.0)
