"""Per-segment calibration on synthetic shadow tokens whose truth is known: a segment
whose exits are all wrong never gets exiting thresholds, a small segment keeps the pooled set
only when its own tokens certify it, and over many seeded trials every segment is within δ at
once in at least 1-ε of them (while one pooled set, the foil, is not)."""

from __future__ import annotations

import numpy as np
import pytest

from controlplane.calibration.learn_then_test import NEVER_EXIT, policy_disagreement
from controlplane.calibration.segments import calibrate_segments
from controlplane.deployments.service import publish, to_wire
from controlplane.stats.synthetic import DEFAULT_EXIT_LAYERS, DEFAULT_NUM_LAYERS, shadow_samples
from tests.support.calibration import LAYERS, make_deployment

DELTA, EPSILON = 0.05, 0.1
SYN_LAYERS = list(DEFAULT_EXIT_LAYERS)


def _mix(parts: dict[str, tuple[np.ndarray, np.ndarray]]):
    signals = np.vstack([s for s, _ in parts.values()])
    matched = np.vstack([m for _, m in parts.values()])
    labels = np.concatenate([[name] * len(s) for name, (s, _) in parts.items()])
    return signals, matched, labels


def _calibrate(parts, **options):
    signals, matched, labels = _mix(parts)
    return calibrate_segments(signals=signals, matched=matched, segments=labels,
                              exit_layers=options.pop("exit_layers", SYN_LAYERS),
                              num_layers=options.pop("num_layers", DEFAULT_NUM_LAYERS),
                              delta=DELTA, epsilon=EPSILON, **options)


def _synthetic(n, seed, domain="A"):
    return shadow_samples(n, rng=np.random.default_rng(seed), domain=domain)


def _overconfident(n, seed):
    """Hard tokens whose signal overstates the match probability (heads trained on other text):
    the same signal means less here than in the other segments."""
    signals, matched = shadow_samples(n, rng=np.random.default_rng(seed), domain="B")
    return signals ** 0.25, matched


def test_a_segment_whose_exits_are_all_wrong_never_exits_while_the_others_do():
    chat, code = _synthetic(4000, 1, "A"), _synthetic(4000, 2, "B")
    # Confident and always wrong: high signals, no layer ever matches full depth.
    rng = np.random.default_rng(3)
    wrong = (0.9 + 0.1 * rng.random((1500, 3)), np.zeros((1500, 3), dtype=bool))
    result = _calibrate({"chat": chat, "code": code, "tools": wrong})
    # all three are large enough for their own LTT: Šidák over the three
    assert result.epsilon_per_segment == pytest.approx(1 - (1 - EPSILON) ** (1 / 3))
    tools = result.segments["tools"]
    assert tools.source == "conservative" and not tools.exits
    assert set(tools.thresholds.values()) == {NEVER_EXIT}
    assert "certified no exiting step" in tools.reason and "never exit" in tools.reason
    # large enough for its own test, it has no pooled-check reserve: no pooled check ran
    assert tools.pooled_check is None and "no pooled-check reserve" in tools.reason
    # the pooled set does exit (the wrong segment is a small share of the pool), and would be
    # wrong on every token of `tools` it lets exit
    assert result.pooled is not None and result.pooled.exit_rate > 0
    wrong_exits, _ = policy_disagreement(*wrong, [result.pooled.thresholds[k] for k in SYN_LAYERS])
    assert wrong_exits > 0
    for name in ("chat", "code"):
        assert result.segments[name].source == "segment" and result.segments[name].exits
    assert result.segment_thresholds()["tools"] == dict.fromkeys(SYN_LAYERS, NEVER_EXIT)
    # the Bonferroni split (a reserve of each share for the pooled check) tests it, and it fails
    reserved = _calibrate({"chat": chat, "code": code, "tools": wrong},
                          pooled_check_share=0.1).segments["tools"]
    assert reserved.pooled_check.disagreements > 0 and not reserved.pooled_check.certified
    assert reserved.pooled_check.level == pytest.approx(0.1 * EPSILON / 3)


def test_a_small_segment_keeps_the_pooled_set_only_if_its_tokens_certify_it():
    chat, code = _synthetic(4000, 4, "A"), _synthetic(4000, 5, "B")
    rng = np.random.default_rng(6)
    easy = (rng.random((600, 3)), np.ones((600, 3), dtype=bool))  # every exit matches
    hard = (rng.random((600, 3)), np.zeros((600, 3), dtype=bool))  # every exit is wrong
    result = _calibrate({"chat": chat, "code": code, "easy": easy, "hard": hard})
    # two own tests share 2ε/4 by Šidák, the two small ones' checks ε/4 each
    assert result.epsilon_per_segment == pytest.approx(1 - (1 - EPSILON / 2) ** (1 / 2))
    assert result.split == "sidak"
    small_easy, small_hard = result.segments["easy"], result.segments["hard"]
    assert small_easy.result is None and small_hard.result is None  # too few for their own LTT
    assert small_easy.source == "pooled"
    assert small_easy.thresholds == result.pooled.thresholds
    assert small_easy.pooled_check.level == pytest.approx(EPSILON / 4)  # all of its share
    assert small_easy.pooled_check.disagreements == 0 and small_easy.pooled_check.certified
    assert "too few shadow tokens" in small_easy.reason and "keeps the pooled set" in \
        small_easy.reason
    assert small_hard.source == "conservative" and not small_hard.exits
    assert "not certified" in small_hard.reason
    assert small_easy.tokens == small_hard.tokens == 600


def test_the_default_label_sets_the_default_map_and_is_not_a_named_segment():
    result = _calibrate({"default": _synthetic(4000, 7, "A"), "code": _synthetic(4000, 8, "B")})
    assert result.thresholds == result.segments["default"].thresholds
    assert set(result.segment_thresholds()) == {"code"}
    unlabelled = _calibrate({"chat": _synthetic(4000, 7, "A"), "code": _synthetic(4000, 8, "B")})
    assert unlabelled.thresholds == unlabelled.pooled.thresholds  # unknown segments: pooled


def test_nothing_certifiable_anywhere_is_never_exit_everywhere_and_says_why():
    rng = np.random.default_rng(9)
    tiny = {"a": (rng.random((50, 3)), np.ones((50, 3), bool)),
            "b": (rng.random((50, 3)), np.ones((50, 3), bool))}
    result = _calibrate(tiny)
    assert result.pooled is None and "pooled set not calibrated" in result.notes[0]
    assert all(seg.source == "conservative" for seg in result.segments.values())
    assert set(result.thresholds.values()) == {NEVER_EXIT}
    assert "no exiting pooled set" in result.segments["a"].reason


def test_bad_input_is_a_clear_error():
    signals, matched = _synthetic(100, 1)
    with pytest.raises(ValueError, match="one name per token"):
        calibrate_segments(signals=signals, matched=matched, segments=np.array(["a"] * 99),
                           exit_layers=SYN_LAYERS, num_layers=30, delta=DELTA, epsilon=EPSILON)
    with pytest.raises(ValueError, match="check_fraction"):
        calibrate_segments(signals=signals, matched=matched, segments=np.array(["a"] * 100),
                           exit_layers=SYN_LAYERS, num_layers=30, delta=DELTA, epsilon=EPSILON,
                           check_fraction=1.0)


def test_whole_requests_go_to_the_check_side_together():
    """Check requests (held out of the pooled set for a pooled check) are whole, and only a
    segment that may run a pooled check gives them: a small one always, a large one only under
    the Bonferroni split with a reserve."""
    large, small = _synthetic(3000, 10), _synthetic(600, 11)
    options = dict(signals=np.vstack([large[0], small[0]]),
                   matched=np.vstack([large[1], small[1]]),
                   segments=np.array(["a"] * 3000 + ["b"] * 600),
                   requests=np.repeat(np.arange(120), 30), exit_layers=SYN_LAYERS,
                   num_layers=30, delta=DELTA, epsilon=EPSILON, min_samples_per_layer=1000)
    result = calibrate_segments(**options)
    assert result.segments["a"].requests == 100 and result.segments["b"].requests == 20
    # 30% of b's 20 requests, 30 tokens each, held out of the pooled calibration; none of a's
    assert result.segments["b"].pooled_check.tokens == 6 * 30
    assert result.segments["a"].pooled_check is None
    assert result.pooled.samples["total"] == 3600 - 6 * 30
    reserved = calibrate_segments(pooled_check_share=0.1, **options)
    assert reserved.pooled.samples["total"] == 3600 - 6 * 30 - 30 * 30


@pytest.mark.slow  # repeated calibration trials: ~7 s
def test_every_segment_is_within_delta_jointly_in_at_least_one_minus_epsilon_of_trials():
    """Joint coverage: the share of trials where any segment's true risk (on 100,000 fresh
    tokens of that segment) exceeds δ stays <= ε (+ slack for 60 trials). The foil, one pooled
    set calibrated on the same mix, breaks δ on the harder segment far more often."""
    trials, slack = 60, 0.05
    fresh = {"chat": _synthetic(100_000, 10_001, "A"), "code": _synthetic(100_000, 10_002, "B"),
             "docs": _overconfident(100_000, 10_003)}
    sizes = {"chat": 3000, "code": 1500, "docs": 1500}
    joint, pooled_joint, exiting = 0, 0, 0
    for trial in range(trials):
        parts = {"chat": _synthetic(sizes["chat"], trial * 3, "A"),
                 "code": _synthetic(sizes["code"], trial * 3 + 1, "B"),
                 "docs": _overconfident(sizes["docs"], trial * 3 + 2)}
        result = _calibrate(parts, seed=trial, min_samples_per_layer=500)

        def over(thresholds, name):
            wrong, n = policy_disagreement(*fresh[name], [thresholds[k] for k in SYN_LAYERS])
            return wrong / n > DELTA

        joint += any(over(seg.thresholds, name) for name, seg in result.segments.items())
        pooled_joint += any(over(result.pooled.thresholds, name) for name in fresh)
        exiting += sum(seg.exits for seg in result.segments.values())
    print(f"joint violations {joint}/{trials}, pooled {pooled_joint}/{trials}, "
          f"exiting segments {exiting}/{3 * trials}")
    assert joint / trials <= EPSILON + slack
    assert pooled_joint / trials > EPSILON + slack  # the check could fail
    assert exiting >= 2 * trials  # and it is not vacuous: most segments do exit


def test_the_result_publishes_as_one_segmented_version(session):
    deployment = make_deployment(session)
    rng = np.random.default_rng(11)

    def part(n, cut):
        signals = rng.random((n, 3))
        return signals, signals > cut

    result = calibrate_segments(
        signals=np.vstack([part(3000, 0.3)[0], part(3000, 0.8)[0]]),
        matched=np.vstack([part(3000, 0.3)[1], part(3000, 0.8)[1]]),
        segments=np.array(["chat"] * 3000 + ["code"] * 3000), exit_layers=LAYERS,
        num_layers=12, delta=DELTA, epsilon=EPSILON)
    published = publish(session=session, deployment=deployment, thresholds=result.thresholds,
                        segments=result.segment_thresholds(), reason="per-segment calibration",
                        actor="calibration", expected_metrics=result.summary())
    wire = to_wire(deployment=deployment, threshold_set=published)
    wire.verify()
    assert set(wire.segments) == {"chat", "code"}
    assert wire.for_segment("code") == result.segments["code"].thresholds
    assert published.expected_metrics["segments"]["code"]["source"] in (
        "segment", "pooled", "conservative")
