"""Colluding witnesses cannot pick their part of the calibration, nor outweigh the typical one.

Guards against: a holdout an attacker can compute from the witnesses' names; a holdout that
leaves too few witnesses in the test for leave-one-out to run, or that one heavy witness fills
alone; a flooding witness holding far more than a typical one's tokens; and two colluding
witnesses of five forging agreement at ten times the volume getting a set certified that breaks
δ on honest traffic. Honest witnesses report tokens from a known model (at exit layer j the
signal is uniform on [0, 1] and the layer matches full depth with probability
sigmoid(10 (s - c_j))), so the true disagreement of any set is read on a large fresh sample.
"""

from __future__ import annotations

import numpy as np
from scipy.special import expit

from controlplane.calibration.learn_then_test import calibrate_thresholds, policy_disagreement
from controlplane.stats.robust_evidence import cap_runtime_share, holdout_runtimes

LAYERS = [3, 6, 9]
CENTRES = np.array([0.75, 0.65, 0.55])  # honest P(match) = 1/2 at these signals
DELTA, EPSILON = 0.05, 0.1
TOKENS_PER_REQUEST = 8


def _honest(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    signals = rng.random((n, len(LAYERS)))
    return signals, rng.random(signals.shape) < expit(10.0 * (signals - CENTRES))


def _forged(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Tokens forging agreement: every exit layer matched."""
    signals = rng.random((n, len(LAYERS)))
    return signals, np.ones(signals.shape, dtype=bool)


def _labels(counts: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """(witness of each token, request of each token): whole requests of 8 per witness."""
    runtimes = np.concatenate([[name] * n for name, n in counts.items()])
    requests = np.array([f"{name}/{i // TOKENS_PER_REQUEST}"
                         for i, name in enumerate(runtimes)])
    return runtimes, requests


def _held(runtimes: np.ndarray, seed: int, fraction: float = 0.2) -> frozenset[str]:
    mask = holdout_runtimes(runtimes, fraction=fraction, seed=seed, min_test_runtimes=3)
    return frozenset(np.unique(runtimes[mask]).tolist())


def _collusion(honest: int, liars: int, n: int, seed: int):
    """(signals, matched, runtimes, requests): `honest` witnesses with n honest tokens each,
    `liars` with 10 n forged ones each."""
    rng = np.random.default_rng(seed)
    parts = {f"honest-{i}": _honest(n, rng) for i in range(honest)}
    parts |= {f"liar-{i}": _forged(10 * n, rng) for i in range(liars)}
    runtimes, requests = _labels({name: len(part[0]) for name, part in parts.items()})
    signals = np.vstack([part[0] for part in parts.values()])
    matched = np.vstack([part[1] for part in parts.values()])
    return signals, matched, runtimes, requests


def _true_disagreement(thresholds: dict[int, float], truth) -> float:
    wrong, n = policy_disagreement(*truth, [thresholds[k] for k in LAYERS])
    return wrong / n


def test_the_holdout_follows_the_seed_and_every_witness_is_held_out_as_often():
    """The same seed holds out the same witnesses, other seeds others; over many seeds every
    witness is held out about as often, whatever its name sorts as (the seed is the secret)."""
    runtimes, _ = _labels({"aaa": 800, "bbb": 800, "mmm": 800, "yyy": 800, "zzz": 800})
    assert _held(runtimes, seed=11) == _held(runtimes, seed=11)
    drawn = [_held(runtimes, seed) for seed in range(400)]
    assert len(set(drawn)) > 5
    for name in np.unique(runtimes):
        share = np.mean([name in held for held in drawn])
        assert 0.3 < share < 0.5, (name, share)  # two of five held out: 0.4


def test_two_heavy_witnesses_of_five_leave_three_to_the_test_and_two_to_the_holdout():
    """Five witnesses, two with ten times the others' tokens: whatever the seed, the holdout
    is at least two witnesses and the test keeps three (so leave-one-out runs there); in larger
    fleets of mixed volume the same holds."""
    runtimes, _ = _labels({"rt-a": 800, "rt-b": 800, "rt-c": 800, "rt-d": 8000, "rt-e": 8000})
    for seed in range(50):
        held = _held(runtimes, seed)
        assert len(held) >= 2 and 5 - len(held) >= 3, (seed, held)
    rng = np.random.default_rng(3)
    for seed in range(50):
        k = int(rng.integers(5, 13))
        runtimes, _ = _labels({f"rt-{i}": int(rng.choice([80, 800, 8000])) for i in range(k)})
        held = _held(runtimes, seed, fraction=float(rng.uniform(0.05, 0.6)))
        assert len(held) >= 2 and k - len(held) >= 3, (seed, k, held)


def test_four_witnesses_keep_three_in_the_test():
    """Four witnesses: one is held out and three stay in the test, so leave-one-out runs
    there (with two colluders of four, one of the test or the holdout is then honest alone)."""
    runtimes, _ = _labels({"rt-a": 800, "rt-b": 800, "rt-c": 8000, "rt-d": 8000})
    for seed in range(20):
        assert len(_held(runtimes, seed)) == 1


def test_a_flooding_witness_keeps_about_twice_the_median():
    """A witness with ten times the tokens of four typical ones keeps whole requests up to
    about twice the median witness's count; the typical ones keep everything. Which requests
    it keeps follows the seed."""
    runtimes, requests = _labels({"rt-a": 800, "rt-b": 800, "rt-c": 800, "rt-d": 800,
                                  "rt-flood": 8000})
    keep = cap_runtime_share(runtimes, requests, max_share=0.5, seed=5, min_runtimes=3,
                             max_share_of_median=2.0)
    assert keep[runtimes != "rt-flood"].all()
    kept = int(keep[runtimes == "rt-flood"].sum())
    assert 1600 - TOKENS_PER_REQUEST <= kept <= 1600
    assert not np.any(np.isin(np.unique(requests[keep]),
                              np.unique(requests[~keep])))  # whole requests
    again = cap_runtime_share(runtimes, requests, max_share=0.5, seed=5, min_runtimes=3,
                              max_share_of_median=2.0)
    other = cap_runtime_share(runtimes, requests, max_share=0.5, seed=6, min_runtimes=3,
                              max_share_of_median=2.0)
    assert (again == keep).all() and not (other == keep).all()


def test_the_median_cap_waits_for_robust_min_runtimes():
    """Two witnesses, one with nine times the other's tokens: nothing is cut (no majority to
    protect, the holdout keeps either from certifying alone)."""
    runtimes, requests = _labels({"rt-a": 7200, "rt-b": 800})
    assert cap_runtime_share(runtimes, requests, max_share=0.5, min_runtimes=3,
                             max_share_of_median=2.0).all()


def test_two_colluding_witnesses_of_five_cannot_certify_a_set_that_breaks_delta():
    """Three honest witnesses and two forging agreement on every token at ten times their
    volume, uncapped: whichever witnesses a random seed holds out, the set certified holds δ
    on honest traffic."""
    signals, matched, runtimes, requests = _collusion(honest=3, liars=2, n=1000, seed=1)
    truth = _honest(200_000, np.random.default_rng(99))
    for seed in np.random.default_rng(7).integers(0, 2**32, size=12):
        result = calibrate_thresholds(signals=signals, matched=matched, exit_layers=LAYERS,
                                      num_layers=12, delta=DELTA, epsilon=EPSILON,
                                      requests=requests, runtimes=runtimes, seed=int(seed),
                                      min_samples_per_layer=500)
        assert result.samples["test_runtimes"] >= 3 and result.samples["holdout_runtimes"] >= 2
        assert _true_disagreement(result.thresholds, truth) <= DELTA, (seed, result.thresholds)


def test_no_single_held_out_witness_decides_the_held_out_check():
    """Four honest witnesses and three forging agreement at ten times their volume, half the
    witnesses held out: when the holdout has a liar among three honest ones, the held-out check
    must hold without it too, so the set certified holds δ on honest traffic."""
    signals, matched, runtimes, requests = _collusion(honest=4, liars=3, n=1000, seed=2)
    truth = _honest(200_000, np.random.default_rng(98))
    for seed in range(8):
        result = calibrate_thresholds(signals=signals, matched=matched, exit_layers=LAYERS,
                                      num_layers=12, delta=DELTA, epsilon=EPSILON,
                                      requests=requests, runtimes=runtimes, seed=seed,
                                      holdout_fraction=0.5, min_samples_per_layer=500)
        assert _true_disagreement(result.thresholds, truth) <= DELTA, (seed, result.thresholds)
