"""How ε is split across traffic segments (seg-power2): Šidák across the segments that
run their own Learn-Then-Test, ε/k for each too small for it (its pooled check), a one-segment
recalibration at a level that keeps the joint statement by the union bound, and borrowing in
one direction only (larger to smaller), so that the own tests stay independent given what
their paths borrow. At the null's boundary the joint violation stays within ε."""

from __future__ import annotations

import numpy as np
import pytest

from controlplane.calibration.learn_then_test import NEVER_EXIT
from controlplane.calibration.segments import (
    calibrate_segments,
    own_test_level,
    recalibration_level,
)
from tests.support.simulated_requests import LAYERS, NUM_LAYERS, simulated_requests

DELTA, EPSILON = 0.05, 0.1


@pytest.mark.parametrize("k", [2, 3, 5])
def test_every_own_test_runs_at_the_sidak_level_which_is_more_than_epsilon_over_k(k):
    level = own_test_level(EPSILON, own=k, segments=k)
    assert 1 - (1 - level) ** k == pytest.approx(EPSILON)  # exactly ε jointly
    assert level > EPSILON / k
    assert level == pytest.approx({2: 0.051317, 3: 0.034511, 5: 0.020851}[k], abs=1e-6)
    # a mix: the own tests' union is their share of ε, the small ones add ε/k each
    for own in range(1, k):
        mixed = own_test_level(EPSILON, own=own, segments=k)
        assert 1 - (1 - mixed) ** own + (k - own) * EPSILON / k == pytest.approx(EPSILON)
    with pytest.raises(ValueError, match="own <= segments"):
        own_test_level(EPSILON, own=0, segments=k)


@pytest.mark.parametrize("k", [1, 2, 3, 6])
def test_a_one_segment_recalibration_keeps_the_joint_statement_whatever_set_the_others(k):
    """Any j segments still holding sets of an earlier calibration fail together with
    probability <= 1 - (1-a)^j (Šidák, or less: ε/k each by Bernoulli's inequality); the
    n = k - j replaced since, each at `recalibration_level`, add at most n b by the union bound:
    the sum stays <= ε for every j, however many one-segment recalibrations ran."""
    a = own_test_level(EPSILON, own=k, segments=k)
    b = recalibration_level(EPSILON, k)
    assert b == pytest.approx(a * (1 - a) ** (k - 1))
    for j in range(k + 1):
        assert 1 - (1 - a) ** j + (k - j) * b <= EPSILON + 1e-12
        assert j * EPSILON / k <= 1 - (1 - a) ** j + 1e-12  # a Bonferroni past is within it
    # a mixed split (m own tests by Šidák, k - m pooled checks at ε/k): any x own and y small
    # segments fail together with probability <= 1 - (1-a)^(x+y) as well
    for m in range(1, k + 1):
        own = own_test_level(EPSILON, own=m, segments=k)
        for x in range(m + 1):
            for y in range(k - m + 1):
                assert 1 - (1 - own) ** x + y * EPSILON / k <= 1 - (1 - a) ** (x + y) + 1e-12
    # ε/k (what it ran at before) would overspend beside the Šidák sets: a + ε/k > ε at k = 2
    if k == 2:
        assert 1 - (1 - a) + EPSILON / k > EPSILON
        assert b == pytest.approx(0.048683, abs=1e-6)


def _mix(parts: dict[str, tuple]) -> dict:
    return dict(signals=np.vstack([p[0] for p in parts.values()]),
                matched=np.vstack([p[1] for p in parts.values()]),
                segments=np.concatenate([[name] * len(p[0]) for name, p in parts.items()]),
                requests=np.concatenate([p[2] for p in parts.values()]))


def test_a_path_borrows_only_from_larger_segments():
    """Largest first: it borrows nothing; the middle one only the largest's tokens (not the
    smallest's, which it would under 'every other segment'); the smallest both of theirs."""
    parts = {"chat": simulated_requests(150, seed=1, first_id=0),
             "docs": simulated_requests(60, seed=2, first_id=10_000),
             "code": simulated_requests(40, seed=3, first_id=20_000)}
    result = calibrate_segments(**_mix(parts), exit_layers=LAYERS, num_layers=NUM_LAYERS,
                                delta=DELTA, epsilon=EPSILON, min_samples_per_layer=200)
    borrowed = {name: seg.result.samples.get("borrowed", 0)
                for name, seg in result.segments.items()}
    assert borrowed == {"chat": 0, "docs": 150 * 32, "code": (150 + 60) * 32}
    level = 1 - (1 - EPSILON) ** (1 / 3)
    assert all(seg.result.epsilon == pytest.approx(level) for seg in result.segments.values())


def test_which_segments_run_their_own_test_is_decided_by_size_before_any_test():
    """A segment with many tokens but a layer seen too rarely is small (the LTT's own size
    rule): it keeps a pooled check at ε/k, while the two large ones share the rest by Šidák
    and hold no pooled-check reserve."""
    chat = simulated_requests(150, seed=4, first_id=0)
    code = simulated_requests(100, seed=5, first_id=10_000)
    rare = simulated_requests(100, seed=6, first_id=20_000)
    rare[0][32:, 2] = np.nan  # layer 24 observed on one request only
    result = calibrate_segments(**_mix({"chat": chat, "code": code, "rare": rare}),
                                exit_layers=LAYERS, num_layers=NUM_LAYERS, delta=DELTA,
                                epsilon=EPSILON, min_samples_per_layer=200)
    assert result.segments["rare"].result is None
    assert "too few shadow tokens" in result.segments["rare"].reason
    assert result.segments["rare"].pooled_check.level == pytest.approx(EPSILON / 3)
    assert result.segments["rare"].epsilon == pytest.approx(EPSILON / 3)
    own = own_test_level(EPSILON, own=2, segments=3)
    for name in ("chat", "code"):
        seg = result.segments[name]
        assert seg.result.epsilon == pytest.approx(own) and seg.pooled_check is None
    assert result.epsilon_per_segment == pytest.approx(own)
    assert result.summary()["split"] == "sidak"


def _at_the_boundary(n: int, rng: np.random.Generator):
    """One layer: a fifth of the tokens have signal exactly 0.5 and disagree with probability
    5 δ, the rest are uniform and always agree. Every threshold >= 0.5 has risk 0, every one
    below exactly δ (the null's boundary), and the disagreements are Binomial(n, δ) there: the
    fixed sequence certifies its first step below 0.5 with probability about its level."""
    signals = rng.random((n, 1))
    band = rng.random((n, 1)) < 0.2
    signals[band] = 0.5
    matched = ~(band & (rng.random((n, 1)) < 5 * DELTA))
    return signals, matched


@pytest.mark.slow  # 400 seeded trials of k + 1 calibrations of one layer: ~25-30 s each k
@pytest.mark.parametrize("k", [2, 3])
def test_at_the_null_the_joint_violation_stays_within_epsilon(k):
    """Every segment at the boundary R = δ past threshold 0.5: a segment violates when its
    chosen threshold has risk >= δ. The share of trials where some segment does stays <= ε (+
    3 standard errors), and sits near ε: the split spends the level it has (Bonferroni's
    0.9 ε/k would sit near 0.09 at k 2), so an overspend would show."""
    trials = 400
    joint, single = 0, np.zeros(k)
    for trial in range(trials):
        rng = np.random.default_rng(trial)
        parts = [_at_the_boundary(2500, rng) for _ in range(k)]
        result = calibrate_segments(
            signals=np.vstack([p[0] for p in parts]), matched=np.vstack([p[1] for p in parts]),
            segments=np.repeat([f"s{i}" for i in range(k)], 2500), exit_layers=[8],
            num_layers=12, delta=DELTA, epsilon=EPSILON, strategy="shared",
            min_samples_per_layer=1000, seed=trial)
        over = np.array([result.segments[f"s{i}"].thresholds[8] < 0.5 for i in range(k)])
        joint += over.any()
        single += over
        assert all(result.segments[f"s{i}"].thresholds[8] < NEVER_EXIT for i in range(k))
    rate = joint / trials
    print(f"k {k}: joint violation {rate:.3f}, per segment {single / trials}")
    assert rate <= EPSILON + 3 * np.sqrt(EPSILON * (1 - EPSILON) / trials)
    assert rate >= EPSILON / 2


def test_the_former_scheme_stays_available_for_comparison():
    parts = {"chat": simulated_requests(150, seed=7, first_id=0),
             "code": simulated_requests(60, seed=8, first_id=10_000)}
    result = calibrate_segments(**_mix(parts), exit_layers=LAYERS, num_layers=NUM_LAYERS,
                                delta=DELTA, epsilon=EPSILON, min_samples_per_layer=200,
                                pooled_check_share=0.1)
    assert result.split == "bonferroni"
    for seg in result.segments.values():
        assert seg.result.epsilon == pytest.approx(0.9 * EPSILON / 2)
        assert "0.9 ε/k = 0.045" in seg.reason
    with pytest.raises(ValueError, match="pooled_check_share"):
        calibrate_segments(**_mix(parts), exit_layers=LAYERS, num_layers=NUM_LAYERS,
                           delta=DELTA, epsilon=EPSILON, pooled_check_share=-0.1)
