"""The answer target: Learn-Then-Test on request-level answer losses beside the token test.

On synthetic requests whose answer risk under every threshold set is known in closed form
(`KnownAnswerRisk`), the certified set's true P(answer differs) exceeds δ_answer in at most
ε of the trials; the answer target makes the choice more conservative where it binds; too few
shadow requests make a job wait; the answer figures are recorded."""

from __future__ import annotations

import numpy as np
import pytest

from controlplane.calibration.answers import (
    AnswerTest,
    NotEnoughShadowRequests,
    answer_p_values,
    consistency,
    evaluate,
)
from controlplane.calibration.learn_then_test import calibrate_thresholds
from controlplane.calibration.service import CalibrationPolicy, ShadowWindow, calibrate_window
from controlplane.stats.answers import first_divergence
from controlplane.stats.robust_evidence import EvidencePolicy
from controlplane.telemetry.shadow_requests import ShadowRequests
from tests.support.calibration import FULL, LAYERS
from tests.support.shadow_requests import KnownAnswerRisk

MODEL = KnownAnswerRisk(power=(1.0, 2.0, 4.0), tokens=8)


def _requests(rng: np.random.Generator, n: int, *, witnesses: int = 1,
              segments: tuple[str, ...] = ("default",)) -> ShadowRequests:
    """n synthetic shadow requests of MODEL.tokens tokens each."""
    signals, matched = MODEL.tokens_of(rng, n * MODEL.tokens)
    return ShadowRequests(
        requests=[f"q-{i}" for i in range(n)], runtimes=[f"rt-{i % witnesses}" for i in range(n)],
        witnesses=[f"runtime:rt-{i % witnesses}" for i in range(n)],
        segments=[segments[i % len(segments)] for i in range(n)],
        versions=np.zeros(n, dtype=np.int64),
        offsets=np.arange(n + 1, dtype=np.int64) * MODEL.tokens,
        signals=signals, matched=matched)


def _tokens(rng: np.random.Generator, n_requests: int) -> tuple[np.ndarray, np.ndarray,
                                                                   np.ndarray]:
    signals, matched = MODEL.tokens_of(rng, n_requests * MODEL.tokens)
    requests = np.repeat([f"t-{i}" for i in range(n_requests)], MODEL.tokens)
    return signals, matched, requests


def _calibrate(rng, *, delta_answer: float | None, epsilon: float, token_requests: int = 400,
               shadow_requests: int = 300, strategy: str = "calibrated"):
    signals, matched, requests = _tokens(rng, token_requests)
    test = None if delta_answer is None else AnswerTest(
        evidence=_requests(rng, shadow_requests), delta_answer=delta_answer)
    return calibrate_thresholds(
        signals=signals, matched=matched, exit_layers=LAYERS, num_layers=FULL, delta=0.2,
        epsilon=epsilon, requests=requests, min_samples_per_layer=100, strategy=strategy,
        seed=int(rng.integers(1 << 30)), answer_test=None if test is None else test.p_values)


def test_divergence_over_many_requests_is_first_divergence_request_by_request():
    """The all-at-once computation equals `first_divergence` on each request (lengths 1 to
    40, unchecked layers as NaN, never-exit and exit-everything among the sets)."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, size=300)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    signals = rng.random((offsets[-1], len(LAYERS))).astype(np.float32)
    signals[rng.random(signals.shape) < 0.05] = np.nan
    matched = rng.random(signals.shape) < 0.8
    evidence = ShadowRequests(
        requests=[f"q-{i}" for i in range(300)], runtimes=["rt"] * 300,
        witnesses=["runtime:rt"] * 300, segments=["default"] * 300,
        versions=np.zeros(300, dtype=np.int64), offsets=offsets.astype(np.int64),
        signals=signals, matched=matched)
    thresholds = rng.random((60, len(LAYERS)))
    thresholds[0], thresholds[1] = 1.0, 0.0
    expected = np.stack([first_divergence(signals[offsets[i]:offsets[i + 1]],
                                          matched[offsets[i]:offsets[i + 1]], thresholds)
                         for i in range(300)])
    found = evidence.divergence(thresholds)
    np.testing.assert_array_equal(found, expected)
    assert (found[:, 0] == -1).all() and (found[:, 1] >= 0).any()


def test_the_exact_answer_risk_of_the_synthetic_model_matches_simulation():
    """The closed form the coverage test trusts agrees with simulated requests."""
    rng = np.random.default_rng(7)
    evidence = _requests(rng, 20_000)
    for thresholds in ([0.9, 0.8, 0.7], [0.5, 0.5, 0.5], [1.0, 1.0, 0.2]):
        share = (evidence.divergence(np.array([thresholds]))[:, 0] >= 0).mean()
        assert share == pytest.approx(MODEL.answer_risk(thresholds), abs=0.012)


@pytest.mark.slow
def test_the_certified_sets_answer_risk_exceeds_its_target_in_at_most_epsilon_of_trials():
    """Coverage: over many trials the chosen set's true P(answer differs) > δ_answer at most
    ε of the time (plus Monte Carlo slack), while the token target (δ 0.2) never binds."""
    rng = np.random.default_rng(2026)
    delta_answer, epsilon, trials = 0.15, 0.2, 120
    violations, exits = 0, []
    for _ in range(trials):
        result = _calibrate(rng, delta_answer=delta_answer, epsilon=epsilon)
        chosen = [result.thresholds[layer] for layer in LAYERS]
        assert MODEL.token_risk(chosen) < 0.2
        violations += MODEL.answer_risk(chosen) > delta_answer
        exits.append(result.exit_rate)
    # binomial(120, 0.2): mean 24, sd 4.4; a valid procedure stays well under 24 + 3 sd
    assert violations <= epsilon * trials + 3 * np.sqrt(trials * epsilon * (1 - epsilon))
    assert np.mean(exits) > 0.05  # and it certifies sets that exit, not only never-exit


def test_the_answer_target_makes_the_choice_more_conservative_where_it_binds():
    rng = np.random.default_rng(11)
    tokens_only = _calibrate(np.random.default_rng(11), delta_answer=None, epsilon=0.1)
    both = _calibrate(rng, delta_answer=0.1, epsilon=0.1)
    assert MODEL.answer_risk([tokens_only.thresholds[k] for k in LAYERS]) > 0.1
    assert both.exit_rate < tokens_only.exit_rate
    chosen = next(point for point in both.curve if point.chosen)
    assert chosen.answer_p_value is not None and chosen.answer_p_value <= 0.1
    assert all(point.answer_p_value is None for point in tokens_only.curve)


def test_answer_p_values_are_the_binomial_tail_and_no_witness_decides_alone():
    differs = np.array([[0, -1]] * 5 + [[-1, -1]] * 95)  # set 0: 5 of 100 differ, set 1: none
    p = answer_p_values(differs, delta_answer=0.1)
    assert p[0] == pytest.approx(0.0576, abs=1e-3)  # P(Binomial(100, 0.1) <= 5)
    assert p[1] == pytest.approx(0.9 ** 100)
    # every differing request from one of three witnesses: without the others' requests the
    # test has fewer, so the robust p-value can only be larger
    witnesses = np.array(["a"] * 5 + ["b"] * 45 + ["c"] * 50)
    robust = answer_p_values(differs, delta_answer=0.1, witnesses=witnesses, min_runtimes=3)
    assert robust[0] > p[0]
    assert answer_p_values(np.zeros((0, 2), dtype=int), delta_answer=0.1).tolist() == [1.0, 1.0]


def test_the_answers_must_hold_on_the_witnesses_held_out_of_the_path():
    """With the cross-runtime holdout, a step's answer p-value is also the one on the held-out
    witnesses' requests: a set those witnesses' answers refute is not certified, however well
    it does on the rest."""
    rng = np.random.default_rng(4)
    evidence = _requests(rng, 600, witnesses=6)
    test = AnswerTest(evidence=evidence, delta_answer=0.3)
    sets = np.array([[1.0, 1.0, 1.0], [0.95, 0.95, 0.95]])  # answer risk 0, 0.061
    everyone = test.p_values(sets)
    assert everyone[1] < 0.05
    # the held-out witness's requests alone are fewer: never smaller a p-value than all's
    held = test.p_values(sets, np.array(["runtime:rt-0"]))
    assert (held >= everyone).all()
    mine = np.asarray(evidence.witnesses) == "runtime:rt-0"
    alone = answer_p_values(evidence.take(mine).divergence(sets), delta_answer=0.3)
    np.testing.assert_allclose(held, np.maximum(everyone, alone))


def test_consistency_reports_shares_bound_and_divergence_positions():
    figures = consistency(np.array([-1] * 90 + [0, 1, 1, 3, 5, 9, 20, 40, 100, 700]),
                          epsilon=0.05)
    assert (figures.requests, figures.differing) == (100, 10)
    assert figures.identical_share == 0.9 and figures.differing_share == 0.1
    assert 0.1 < figures.differing_bound < 0.2
    assert figures.divergence_quantiles["p50"] == 7.0
    assert sum(row["requests"] for row in figures.divergence_histogram) == 10
    assert figures.divergence_histogram[-1] == {"from": 512, "to": 1024, "requests": 1}
    empty = consistency(np.zeros(0, dtype=int), epsilon=0.05)
    assert empty.identical_share is None and empty.differing_bound == 1.0


def test_one_witness_keeps_no_more_than_its_share_of_the_requests():
    rng = np.random.default_rng(3)
    evidence = _requests(rng, 600, witnesses=6)
    # witness rt-0 floods: 600 more requests of its own
    flood = _requests(rng, 600)
    joined = ShadowRequests(
        requests=evidence.requests + [f"f-{i}" for i in range(600)],
        runtimes=evidence.runtimes + flood.runtimes, witnesses=evidence.witnesses +
        flood.witnesses, segments=evidence.segments + flood.segments,
        versions=np.concatenate([evidence.versions, flood.versions]),
        offsets=np.concatenate([evidence.offsets, evidence.offsets[-1] + flood.offsets[1:]]),
        signals=np.vstack([evidence.signals, flood.signals]),
        matched=np.vstack([evidence.matched, flood.matched]))
    [figures] = evaluate(joined, np.array([[0.9, 0.8, 0.7]]), epsilon=0.1,
                         policy=EvidencePolicy(max_runtime_share=0.5, max_share_of_median=2.0))
    assert figures.requests == 500 + 200  # five witnesses of 100, rt-0 cut to twice the median
    assert figures.witnesses == 6


def _window(rng, *, answers: ShadowRequests | None, segments=None) -> ShadowWindow:
    signals, matched, requests = _tokens(rng, 400)
    return ShadowWindow(job_id=1, signals=signals, matched=matched, exit_layers=LAYERS,
                        num_layers=FULL, delta=0.2, epsilon=0.1, requests=requests,
                        segments=segments, delta_answer=0.1, answers=answers)


def test_a_job_without_enough_shadow_requests_waits_for_them():
    policy = CalibrationPolicy(min_samples_per_layer=100, seed=0, min_shadow_requests=200)
    rng = np.random.default_rng(5)
    outcome = calibrate_window(_window(rng, answers=_requests(rng, 150)), policy)
    assert isinstance(outcome, NotEnoughShadowRequests)
    assert outcome.counts == {"shadow_requests": 150} and outcome.required == 200
    assert "not enough shadow requests" in str(outcome)
    assert isinstance(calibrate_window(_window(rng, answers=None), policy),
                      NotEnoughShadowRequests)


def test_a_job_records_the_chosen_sets_answer_figures():
    policy = CalibrationPolicy(min_samples_per_layer=100, seed=0, min_shadow_requests=200)
    rng = np.random.default_rng(6)
    evidence = _requests(rng, 400)
    result = calibrate_window(_window(rng, answers=evidence), policy)
    answers = result.answers
    assert answers["requests"] == 400 and answers["delta_answer"] == 0.1
    assert result.exit_rate > 0 and answers["p_value"] <= 0.1
    chosen = np.array([[result.thresholds[k] for k in LAYERS]])
    differs = evidence.divergence(chosen)[:, 0] >= 0
    assert answers["differing"] == int(differs.sum())
    assert answers["differing_bound"] >= answers["differing_share"]


def test_each_segment_certifies_its_answers_on_its_own_requests():
    policy = CalibrationPolicy(min_samples_per_layer=100, seed=0, min_shadow_requests=200)
    rng = np.random.default_rng(8)
    signals, matched, requests = _tokens(rng, 800)
    labels = np.where(np.arange(len(signals)) // MODEL.tokens % 2 == 0, "default", "code")
    window = ShadowWindow(job_id=1, signals=signals, matched=matched, exit_layers=LAYERS,
                          num_layers=FULL, delta=0.2, epsilon=0.1, requests=requests,
                          segments=labels, delta_answer=0.1,
                          answers=_requests(rng, 600, segments=("default", "code")))
    outcome = calibrate_window(window, policy)
    for name in ("default", "code"):
        figures = outcome.answers[name]
        assert figures["requests"] == 300
        seg = outcome.segments[name]
        assert figures["p_value"] <= seg.epsilon or not seg.exits
        assert outcome.summary()["segments"][name]["answers"] == figures
