"""A small segment's own Learn-Then-Test draws its path with the other segments' tokens
(the per-segment calibration's power): on the same data it certifies more exits than a
path learnt on its own few tokens, while at the null (its signals mean less than the pool's, so
the borrowed path misleads) every segment stays within δ jointly in at least 1-ε of the trials,
tested per request."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest

from controlplane.calibration import service
from controlplane.calibration.learn_then_test import (
    LogisticMatchModel,
    calibrate_thresholds,
    policy_disagreement,
)
from controlplane.calibration.models import CalibrationJob
from controlplane.calibration.segments import calibrate_segments, recalibration_level
from controlplane.db import session_scope, utcnow
from controlplane.deployments.segments import declare_segment
from controlplane.deployments.service import get_deployment
from controlplane.flows import recalibration
from controlplane.stats.exits import policy_outcomes
from tests.support.calibration import make_deployment, separable_samples, write_traffic
from tests.support.simulated_requests import LAYERS, NUM_LAYERS, TOKENS, simulated_requests

DELTA, EPSILON = 0.05, 0.1


def _mix(chat, code):
    return (np.vstack([chat[0], code[0]]), np.vstack([chat[1], code[1]]),
            np.array(["chat"] * len(chat[0]) + ["code"] * len(code[0])),
            np.concatenate([chat[2], code[2]]))


def _calibrate(chat, code, *, seed: int, **options):
    signals, matched, segments, requests = _mix(chat, code)
    return calibrate_segments(signals=signals, matched=matched, segments=segments,
                              requests=requests, exit_layers=LAYERS, num_layers=NUM_LAYERS,
                              delta=DELTA, epsilon=EPSILON, min_samples_per_layer=200,
                              seed=seed, **options)


def test_a_fit_shrunk_towards_a_prior_lies_between_the_prior_and_its_own_tokens():
    rng = np.random.default_rng(0)
    signals = rng.random(4000)
    pool = LogisticMatchModel(signals, rng.random(4000) < signals)
    few = rng.random(60)
    matched = rng.random(60) < few ** 3  # this segment's tokens match far less
    own = LogisticMatchModel(few, matched)
    shrunk = LogisticMatchModel(few, matched, prior=pool, prior_weight=30.0)
    at = np.array([0.5])
    assert own.predict(at)[0] < shrunk.predict(at)[0] < pool.predict(at)[0]
    stronger = LogisticMatchModel(few, matched, prior=pool, prior_weight=3000.0)
    assert abs(stronger.predict(at)[0] - pool.predict(at)[0]) < abs(
        shrunk.predict(at)[0] - pool.predict(at)[0])
    # no prior weight: exactly its own fit; a flat own sample still moves the prior's curve
    unshrunk = LogisticMatchModel(few, matched, prior=pool, prior_weight=0.0)
    assert np.allclose(unshrunk.y_thresholds_, own.y_thresholds_)
    all_matched = LogisticMatchModel(few, np.ones(60, bool), prior=pool, prior_weight=30.0)
    assert all_matched.predict(at)[0] > pool.predict(at)[0]


def test_borrowed_tokens_draw_the_path_but_never_join_the_test():
    code = simulated_requests(60, seed=1)
    chat = simulated_requests(240, seed=2, first_id=1000)
    own = calibrate_thresholds(signals=code[0], matched=code[1], requests=code[2],
                               exit_layers=LAYERS, num_layers=NUM_LAYERS, delta=DELTA,
                               epsilon=0.045, min_samples_per_layer=200, seed=3,
                               learn_fraction=0.15)
    borrowing = calibrate_thresholds(signals=code[0], matched=code[1], requests=code[2],
                                     exit_layers=LAYERS, num_layers=NUM_LAYERS, delta=DELTA,
                                     epsilon=0.045, min_samples_per_layer=200, seed=3,
                                     learn_fraction=0.15, borrowed=(chat[0], chat[1]),
                                     prior_weight=30.0)
    assert borrowing.samples["borrowed"] == 240 * TOKENS
    # the same split of the segment's own requests: the test sees the same tokens
    for part in ("test", "learn", "holdout", "test_requests"):
        assert borrowing.samples[part] == own.samples[part]
    assert borrowing.samples["total"] == 60 * TOKENS
    assert [c.thresholds for c in borrowing.curve] != [c.thresholds for c in own.curve]


@pytest.mark.slow  # 30 seeded calibrations of a two-segment mix, each way: ~25 s
def test_a_small_segment_certifies_more_exits_with_a_borrowed_path_on_the_same_data():
    """Same mixes, same seeds: the small segment (40 requests against 240) exits more on fresh
    traffic of its kind when its path borrows the large segment's tokens than when it is drawn
    from its own dozen learn requests, and stays within δ."""
    fresh = simulated_requests(3000, seed=99_999, spread=0.3)
    exits = {"borrowed": [], "own": []}
    for trial in range(30):
        chat = simulated_requests(240, seed=2 * trial, first_id=10_000)
        code = simulated_requests(40, seed=2 * trial + 1, spread=0.3)
        for kind, options in (("borrowed", {}), ("own", {"borrow_path": False})):
            result = _calibrate(chat, code, seed=trial, **options)
            thresholds = result.segments["code"].thresholds
            first, _ = policy_outcomes(fresh[0], fresh[1], [thresholds[k] for k in LAYERS])
            exits[kind].append(float((first < len(LAYERS)).mean()))
    borrowed, own = np.mean(exits["borrowed"]), np.mean(exits["own"])
    print(f"small segment's fresh exit rate: borrowed path {borrowed:.4f}, own path {own:.4f}")
    assert borrowed > own + 0.005


def test_the_result_says_which_segment_borrowed_its_path():
    chat = simulated_requests(240, seed=5, first_id=10_000)
    code = simulated_requests(40, seed=6, spread=0.3)
    result = _calibrate(chat, code, seed=0)
    small, large = result.segments["code"], result.segments["chat"]
    assert small.source == large.source == "segment"
    assert small.result.samples["borrowed"] == 240 * TOKENS
    assert f"path drawn with {240 * TOKENS} tokens of the other segments" in small.reason
    # the largest segment keeps its own path
    assert "borrowed" not in large.result.samples and "path drawn" not in large.reason
    summary = result.summary()["segments"]
    assert summary["code"]["borrowed_tokens"] == 240 * TOKENS
    assert summary["chat"]["borrowed_tokens"] == 0
    unborrowed = _calibrate(chat, code, seed=0, borrow_path=False).segments["code"]
    assert "borrowed" not in unborrowed.result.samples


@pytest.mark.slow  # 80 seeded calibrations, each scored on fresh requests: ~30 s
def test_a_misleading_borrowed_path_keeps_every_segment_within_delta_jointly():
    """At the null: the small segment's signals overstate its match (its exits are wrong more
    often than the pool's at the same signal), so the path borrowed from the pool leads it
    towards thresholds that are too aggressive; its own test at ε/k, per request, must stop it.
    The share of trials where some segment's true risk (on fresh requests of its kind) exceeds δ
    stays <= ε (+ slack for 80 trials), and the check is not vacuous: the small segment exits,
    and the pooled set (drawn and tested mostly on the other segment) breaks δ on it."""
    trials, slack = 80, 0.05
    fresh = {"chat": simulated_requests(3000, seed=77_777),
             "code": simulated_requests(3000, seed=88_888, overconfidence=1.5)}
    joint, code_over, code_exits, pooled_over = 0, 0, 0, 0
    for trial in range(trials):
        chat = simulated_requests(240, seed=3 * trial, first_id=10_000)
        code = simulated_requests(60, seed=3 * trial + 1, overconfidence=1.5)
        result = _calibrate(chat, code, seed=trial)
        over = {}
        for name, seg in result.segments.items():
            wrong, n = policy_disagreement(*fresh[name][:2], [seg.thresholds[k] for k in LAYERS])
            over[name] = wrong / n > DELTA
        joint += any(over.values())
        code_over += over["code"]
        code_exits += result.segments["code"].exits
        wrong, n = policy_disagreement(*fresh["code"][:2],
                                       [result.pooled.thresholds[k] for k in LAYERS])
        pooled_over += wrong / n > DELTA
    print(f"joint violations {joint}/{trials}, small segment {code_over}/{trials}, "
          f"small segment exiting {code_exits}/{trials}, pooled set over δ on it "
          f"{pooled_over}/{trials}")
    assert joint / trials <= EPSILON + slack
    assert code_over / trials <= EPSILON / 2 + slack
    assert code_exits >= trials / 2
    assert pooled_over / trials > EPSILON + slack


def _window_job(engine, *, segment: str) -> int:
    with session_scope(engine) as session:
        deployment = get_deployment(session=session, name="assist")
        job, _ = service.request_calibration(session=session, deployment=deployment,
                                             actor="test", segment=segment,
                                             since=utcnow() - timedelta(hours=1))
        return job.id


def test_a_one_segment_recalibration_borrows_the_other_segments_tokens_of_its_window(
        engine, outbox):
    """The job of a segment that fell back alone reads the other segments' shadow tokens of
    the same window for its path (and only when they outnumber its own); its test, on its own
    tokens, at its share of ε, is what it was."""
    start = utcnow() - timedelta(minutes=30)
    with session_scope(engine) as session:
        deployment = make_deployment(session, name="assist")
        declare_segment(session=session, deployment=deployment, name="code", actor="test")
        write_traffic(session, "assist", *separable_samples(4000, seed=1, noise=0.02),
                      start=start, request_tokens=32)
        write_traffic(session, "assist", *separable_samples(1000, seed=2, noise=0.02),
                      start=start, request_tokens=32, segment="code", runtime_id="rt-code")
    policy = service.CalibrationPolicy(min_samples_per_layer=300, seed=0)
    outcomes = {}
    for name in ("code", "default"):
        job_id = _window_job(engine, segment=name)
        with session_scope(engine) as session:
            window = recalibration.read_window(session=session,
                                               job=session.get(CalibrationJob, job_id))
        outcomes[name] = (window, service.calibrate_window(window, policy))
    code_window, code = outcomes["code"]
    assert len(code_window.signals) == 1000 and len(code_window.borrowed[0]) == 4000
    # a (1-a) with a = 1 - sqrt(0.9): the union bound beside the other segment's map
    assert code_window.epsilon == pytest.approx(recalibration_level(0.1, 2)) == pytest.approx(
        (1 - 0.9 ** 0.5) * 0.9 ** 0.5)
    assert code.samples["borrowed"] == 4000 and code.samples["total"] == 1000
    assert any(t < 1.0 for t in code.thresholds.values())
    default_window, default = outcomes["default"]
    assert len(default_window.borrowed[0]) == 1000  # code's: fewer than its own, not used
    assert "borrowed" not in default.samples
