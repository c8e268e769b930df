"""The outlier screen sets aside liars, not the honest: it sees a liar that keeps every per-layer
marginal but moves its mismatches to the lowest signals, rarely flags honest witnesses, sets
aside no honest witness when liars are the majority or the fleet is split in camps, and never
sets aside more than a minority of a deployment's witnesses in total.

Pure statistics: witnesses' shadow tokens simulated from one latent-difficulty model (that of
`controlplane.stats.synthetic.shadow_samples`) with a per-request shift, 8 tokens a request.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from controlplane.drift.outliers import (
    STATISTICS,
    clustered_difference,
    runtime_outliers,
    screen_witnesses,
)
from controlplane.stats.clustered import cluster_codes

LAYERS = [8, 16, 24]
NUM_LAYERS = 30
TOKENS_PER_REQUEST = 8
CONSERVATIVE = [1.0, 1.0, 1.0]  # an active set that exits nowhere: no policy disagreement


def _shadow(requests: int, rng: np.random.Generator, *, difficulty: tuple[float, float] = (2, 3),
            signal_shift: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(signals (n, L), matched (n, L)) of an honest witness: a token of difficulty d in a
    request shifted by r matches at layer k with probability sigmoid(8 k / 30 - 6 d - 1 + r);
    its signal is a noisy view of that logit (plus `signal_shift`, a biased witness)."""
    n = requests * TOKENS_PER_REQUEST
    token = rng.beta(*difficulty, size=(n, 1))
    shift = np.repeat(rng.normal(scale=0.8, size=(requests, 1)), TOKENS_PER_REQUEST, axis=0)
    logit = 8.0 * np.asarray(LAYERS)[None, :] / NUM_LAYERS - 6.0 * token - 1.0 + shift
    matched = rng.random(logit.shape) < 1.0 / (1.0 + np.exp(-logit))
    noisy = 1.3 * logit + 0.5 + signal_shift + rng.standard_normal(logit.shape)
    return 1.0 / (1.0 + np.exp(-noisy)), matched


def _camouflaged(signals: np.ndarray, matched: np.ndarray, *, lowest: bool = True
                 ) -> np.ndarray:
    """The same number of matches per layer, moved to the highest signals (so every mismatch
    sits at the lowest; `lowest=False`: the other way round)."""
    moved = np.zeros_like(matched)
    for j in range(matched.shape[1]):
        order = np.argsort(signals[:, j] if lowest else -signals[:, j])
        moved[order[len(order) - int(matched[:, j].sum()):], j] = True
    return moved


def _fleet(witnesses: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict:
    labels = np.concatenate([[name] * len(s) for name, (s, _) in witnesses.items()])
    return {"requests": np.concatenate([np.arange(len(s)) // TOKENS_PER_REQUEST
                                        for s, _ in witnesses.values()]),
            "runtimes": labels,
            "signals": np.vstack([s for s, _ in witnesses.values()]),
            "matched": np.vstack([m for _, m in witnesses.values()])}


def _screen(witnesses, *, thresholds=CONSERVATIVE, alpha=0.01, **options):
    return screen_witnesses(**_fleet(witnesses), thresholds=thresholds, layers=LAYERS,
                            alpha=alpha, min_requests=20, robust_min_runtimes=3, **options)


def _honest(rng, sizes=(200, 200, 200)) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return {f"honest-{i}": _shadow(size, rng) for i, size in enumerate(sizes)}


def _p_against(witnesses, name: str, events_of) -> float:
    """p of `name` against the others pooled on the columns `events_of(signals, matched,
    rest)` gives."""
    fleet = _fleet(witnesses)
    labels = fleet["runtimes"]
    codes = cluster_codes(np.char.add(np.char.add(labels, "/"), fleet["requests"].astype(str)))
    inside = labels == name
    events = events_of(fleet["signals"], fleet["matched"], ~inside)
    return clustered_difference(codes, events, inside)[3]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_camouflaged_liar_is_set_aside_on_agreement_by_signal(seed):
    """A liar with the honest agreement rate and signal distribution at every layer, its
    mismatches moved to the lowest signals, among three honest witnesses: per layer it looks
    honest (neither its agreement nor its share above the median differs beyond chance), yet
    it is set aside on agreement by signal band, and nobody else is."""
    rng = np.random.default_rng(seed)
    witnesses = _honest(rng)
    signals, matched = _shadow(200, rng)
    witnesses["liar"] = (signals, _camouflaged(signals, matched))
    assert (witnesses["liar"][1].sum(axis=0) == matched.sum(axis=0)).all()

    screen = _screen(witnesses)

    assert not screen.refused
    assert [f.runtime_id for f in screen.findings] == ["liar"]
    finding = screen.findings[0]
    assert finding.statistic == "matched_by_signal"
    assert finding.band is not None and "quarter" in finding.summary()
    per_layer = {
        "matched": lambda s, m, rest: m,
        "signal_above_median": lambda s, m, rest: s > np.median(s[rest], axis=0)[None, :]}
    for events_of in per_layer.values():
        assert _p_against(witnesses, "liar", events_of) > finding.level


def test_honest_witnesses_of_one_model_are_rarely_flagged():
    """Four honest witnesses of one model (unequal sizes, requests clustered) at level 0.01,
    over 40 seeds, with and without an active set: at most 2 screens flag anybody (expected
    at most 0.4)."""
    flagged = 0
    for seed in range(40):
        rng = np.random.default_rng(1000 + seed)
        witnesses = _honest(rng, sizes=(120, 200, 300, 160))
        screen = _screen(witnesses, thresholds=None if seed % 2 else [0.6, 0.6, 0.6])
        flagged += bool(screen.flagged)
        assert not screen.findings or not screen.refused
    assert flagged <= 2


def _liars(rng) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Six witnesses, each lying its own way."""
    liars = {}
    signals, matched = _shadow(200, rng)
    liars["liar-agrees"] = (signals, np.ones_like(matched))
    signals, matched = _shadow(200, rng)
    liars["liar-disagrees"] = (signals, np.zeros_like(matched))
    signals, matched = _shadow(200, rng)
    liars["liar-low-mismatches"] = (signals, _camouflaged(signals, matched))
    signals, matched = _shadow(200, rng)
    liars["liar-high-mismatches"] = (signals, _camouflaged(signals, matched, lowest=False))
    liars["liar-confident"] = _shadow(200, rng, signal_shift=2.0)
    liars["liar-timid"] = _shadow(200, rng, signal_shift=-2.0)
    return liars


@pytest.mark.parametrize("seed", [0, 1])
def test_a_lying_majority_gets_no_honest_witness_set_aside(seed):
    """Six witnesses lying each its own way against three honest ones: more than a minority
    differ from the rest, so the screen refuses and sets nobody aside (the honest least of
    all), and says why."""
    rng = np.random.default_rng(seed)
    witnesses = _honest(rng) | _liars(rng)

    screen = _screen(witnesses, thresholds=[0.6, 0.6, 0.6])

    assert not [f for f in screen.findings if f.runtime_id.startswith("honest")]
    assert screen.findings == [] and screen.refused
    assert "of the 9 witnesses tested" in screen.refused
    assert len(screen.flagged) > (9 - 1) // 2


def test_a_fleet_split_in_two_camps_is_refused():
    """Two witnesses serving easy traffic and two serving hard traffic, all honest: each
    differs from the rest, no camp is a clear majority, so none is set aside and the screen
    says so; `runtime_outliers` returns nothing."""
    rng = np.random.default_rng(5)
    witnesses = {"easy-1": _shadow(200, rng, difficulty=(2, 5)),
                 "easy-2": _shadow(200, rng, difficulty=(2, 5)),
                 "hard-1": _shadow(200, rng, difficulty=(5, 2)),
                 "hard-2": _shadow(200, rng, difficulty=(5, 2))}

    screen = _screen(witnesses)

    assert screen.findings == [] and "no clear majority" in screen.refused
    assert runtime_outliers(**_fleet(witnesses), thresholds=CONSERVATIVE, layers=LAYERS,
                            alpha=0.01, min_requests=20, robust_min_runtimes=3) == []


def test_a_blatant_liar_among_honest_is_set_aside_not_refused():
    """A witness forging agreement on every token among three honest ones, with enough tokens
    that the honest too differ from a rest that includes it: the liar is peeled off first,
    the honest then agree with each other, and only the liar is set aside."""
    rng = np.random.default_rng(7)
    witnesses = _honest(rng, sizes=(400, 400, 400))
    signals, matched = _shadow(400, rng)
    witnesses["liar"] = (signals, np.ones_like(matched))

    screen = _screen(witnesses)

    assert not screen.refused
    assert [f.runtime_id for f in screen.findings] == ["liar"]
    assert _p_against(witnesses, "honest-0", lambda s, m, rest: m) < screen.findings[0].level


def _two_liars(rng) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    witnesses = _honest(rng)
    signals, matched = _shadow(200, rng)
    witnesses["liar-agrees"] = (signals, np.ones_like(matched))
    signals, matched = _shadow(200, rng)
    witnesses["liar-low-mismatches"] = (signals, _camouflaged(signals, matched))
    return witnesses


@pytest.mark.parametrize("already, expected", [(0, 2), (1, 1), (2, 1), (3, 0), (6, 0)])
def test_witnesses_already_set_aside_count_toward_the_minority(already, expected):
    """Five witnesses tested, two of them liars: with `already` of the deployment's witnesses
    set aside before (not in the input), at most (5 + already - 1) // 2 may be set aside in
    all, so `expected` new ones (the most significant first); the screen does not refuse, and
    still lists both liars as flagged."""
    screen = _screen(_two_liars(np.random.default_rng(11)), already_set_aside=already)

    assert not screen.refused
    assert {f.runtime_id for f in screen.flagged} == {"liar-agrees", "liar-low-mismatches"}
    assert screen.findings == list(screen.flagged[:expected])


def test_already_set_aside_cannot_be_negative():
    """A negative count of witnesses set aside is a caller's error, said as such."""
    with pytest.raises(ValueError, match="already_set_aside"):
        _screen(_honest(np.random.default_rng(0)), already_set_aside=-1)


def test_without_thresholds_the_policy_family_is_skipped():
    """Evidence mixing versions has no one active set: with `thresholds=None` the screen still
    sets aside a camouflaged liar, on three families, each at alpha / (witnesses x 3)."""
    rng = np.random.default_rng(3)
    witnesses = _honest(rng)
    signals, matched = _shadow(200, rng)
    witnesses["liar"] = (signals, _camouflaged(signals, matched))

    screen = _screen(witnesses, thresholds=None, alpha=0.01)
    with_set = _screen(witnesses, thresholds=[0.6, 0.6, 0.6], alpha=0.01)

    assert [f.runtime_id for f in screen.findings] == ["liar"]
    assert screen.findings[0].level == pytest.approx(0.01 / (4 * (len(STATISTICS) - 1)))
    assert with_set.findings[0].level == pytest.approx(0.01 / (4 * len(STATISTICS)))


def test_unobserved_layers_are_in_no_band():
    """NaN signals (a layer not observed: a fifth of the tokens at each layer, and one layer
    nobody observed) raise no warning, flag no honest witness and still show a camouflaged
    liar."""
    rng = np.random.default_rng(9)
    witnesses = _honest(rng)
    signals, matched = _shadow(200, rng)
    witnesses["liar"] = (signals, _camouflaged(signals, matched))
    for name, (signals, matched) in witnesses.items():
        unseen = rng.random(signals.shape) < 0.2
        unseen[:, 2] = True
        witnesses[name] = (np.where(unseen, np.nan, signals), matched & ~unseen)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        screen = _screen(witnesses)
        honest_only = _screen({k: v for k, v in witnesses.items() if k != "liar"})

    assert [f.runtime_id for f in screen.findings] == ["liar"]
    assert screen.findings[0].layer != LAYERS[2]
    assert honest_only.flagged == ()
