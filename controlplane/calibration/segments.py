"""Per-segment calibration: each traffic segment gets its own Learn-Then-Test thresholds on
its own shadow tokens, with ε split across segments (Šidák over the segments large enough for
their own test, ε/k for each small segment's pooled check) so that one statement holds for all
of them at once: every segment within δ with probability 1-ε. A small segment's path may borrow
the larger segments' tokens; its own test decides. A one-segment recalibration runs at
`recalibration_level`. docs/concepts/segments.md, "How ε is split across segments", gives the
argument; docs/benchmarks.md, "Per-segment calibration", what the choices measure.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from controlplane.calibration.learn_then_test import (
    NEVER_EXIT,
    CalibrationResult,
    NotEnoughShadowData,
    calibrate_thresholds,
    check_counts,
    clustered_risk_p_values,
    risk_p_values,
)
from controlplane.stats.clustered import cluster_codes
from controlplane.stats.exits import policy_outcomes
from controlplane.stats.robust_evidence import robust_p_values, runtime_count
from exitplane.wire import DEFAULT_SEGMENT

# An answer target's test: the p-values of threshold sets ((K, L) and the witnesses held out of
# their path, or None -> (K,), `answers.AnswerTest.p_values`)
AnswerTestFn = Callable[[np.ndarray, np.ndarray | None], np.ndarray]

Source = Literal["segment", "pooled", "conservative"]

# The shrink of a borrowing segment's match model towards the fit on every segment's tokens
# (docs/benchmarks.md, "Per-segment calibration": 3 / 10 / 30 / 100 measured, 30 kept)
PRIOR_WEIGHT = 30.0


def own_test_level(epsilon: float, *, own: int, segments: int) -> float:
    """The level of each of the `own` segments' own LTTs when `segments` segments share ε and
    the rest (too small for their own) spend ε/k each on a pooled check: Šidák over the own
    tests' share ε own/k, 1 - (1 - ε own/k)^(1/own) (docs/concepts/segments.md)."""
    if not 0 < own <= segments:
        raise ValueError(f"need 0 < own <= segments, got own={own}, segments={segments}")
    return 1.0 - (1.0 - epsilon * own / segments) ** (1.0 / own)


def recalibration_level(epsilon: float, segments: int) -> float:
    """The level of a one-segment recalibration among `segments` segments: a (1-a)^(k-1) with
    a = 1 - (1-ε)^(1/k), which keeps "every segment within δ with probability 1-ε" by the union
    bound against whatever calibrations set the others (docs/concepts/segments.md)."""
    if segments < 1:
        raise ValueError(f"need at least one segment, got {segments}")
    a = own_test_level(epsilon, own=segments, segments=segments)
    return a * (1.0 - a) ** (segments - 1)


def path_borrowing(own_tokens: int, borrowed: tuple[np.ndarray, np.ndarray] | None, *,
                   prior_weight: float = PRIOR_WEIGHT) -> dict[str, Any]:
    """`calibrate_thresholds` options that let a segment of `own_tokens` shadow tokens draw its
    path with `borrowed` (signals, matched) of the other segments' requests, when those
    outnumber its own (docs/concepts/segments.md); {} otherwise. Used by `calibrate_segments`
    and by a one-segment recalibration (`flows.recalibration`), so both decide alike."""
    if borrowed is None or len(borrowed[0]) <= own_tokens:
        return {}
    return {"borrowed": borrowed, "prior_weight": prior_weight}


@dataclass(frozen=True)
class PooledCheck:
    """The pooled thresholds replayed on a segment's check tokens, tested against δ."""

    tokens: int
    disagreements: int
    p_value: float  # `risk_test` (exact binomial by default), H0: pooled risk here > δ
    level: float  # the share of ε this test may spend
    certified: bool
    # With an answer target: the pooled set's answer p-value on the segment's shadow requests;
    # `p_value` is then the larger of the two (the joint null, as in the LTT)
    answer_p_value: float | None = None


@dataclass(frozen=True)
class SegmentCalibration:
    """What one segment gets: its own LTT thresholds, the pooled ones, or never-exit; and why."""

    segment: str
    source: Source
    thresholds: dict[int, float]
    reason: str
    tokens: int
    requests: int
    epsilon: float  # the level this segment's tests spend (docs/concepts/segments.md)
    result: CalibrationResult | None = None  # its own LTT, when it ran
    pooled_check: PooledCheck | None = None

    @property
    def exits(self) -> bool:
        return any(value < NEVER_EXIT for value in self.thresholds.values())


@dataclass(frozen=True)
class SegmentedCalibration:
    """Per-segment thresholds with one joint guarantee, plus the pooled set they fall back on.

    `thresholds` is what the `default` segment applies (and with it every segment the set does
    not name): the default segment's own decision when the samples carry that label, else the
    pooled set (whose guarantee is about the pooled mix, at ε, not part of the joint one)."""

    delta: float
    epsilon: float
    # the level of each own LTT (Šidák, or (1 - reserve) ε/k), ε/k when none ran; a small
    # segment's pooled check is at ε/k (each segment's own level: `segments[...].epsilon`)
    epsilon_per_segment: float
    thresholds: dict[int, float]
    segments: dict[str, SegmentCalibration]
    pooled: CalibrationResult | None
    notes: list[str] = field(default_factory=list)
    split: str = "sidak"  # how ε was split: "sidak" or "bonferroni" (docs/concepts/segments.md)
    # With an answer target: each segment's set's answer figures on its shadow requests
    answers: dict[str, dict[str, Any]] = field(default_factory=dict)

    def segment_thresholds(self) -> dict[str, dict[int, float]]:
        """The `segments` map to publish (every named segment; `default` is `thresholds`)."""
        return {name: dict(seg.thresholds) for name, seg in sorted(self.segments.items())
                if name != DEFAULT_SEGMENT}

    def summary(self) -> dict[str, Any]:
        """JSON-serialisable report: per segment its source, reason, sizes and exit rate."""
        return {
            "delta": self.delta, "epsilon": self.epsilon,
            "epsilon_per_segment": self.epsilon_per_segment, "split": self.split,
            "default_thresholds": {str(k): v for k, v in self.thresholds.items()},
            "pooled_exit_rate": None if self.pooled is None else self.pooled.exit_rate,
            "segments": {name: {
                "source": seg.source, "reason": seg.reason, "tokens": seg.tokens,
                "requests": seg.requests, "epsilon": seg.epsilon,
                "thresholds": {str(k): v for k, v in seg.thresholds.items()},
                "exit_rate": None if seg.result is None else seg.result.exit_rate,
                "holdout_passed": None if seg.result is None or seg.result.holdout is None
                else seg.result.holdout.passed,
                "borrowed_tokens": None if seg.result is None
                else seg.result.samples.get("borrowed", 0),
                "answers": self.answers.get(name),
            } for name, seg in sorted(self.segments.items())},
            "notes": list(self.notes),
        }


def split_check_requests(requests: np.ndarray, *, fraction: float, seed: int) -> np.ndarray:
    """Boolean mask of tokens whose request falls in a random `fraction` of the requests."""
    ids = np.unique(requests)
    count = round(len(ids) * fraction)
    chosen = np.random.default_rng(seed).choice(ids, size=count, replace=False)
    return np.isin(requests, chosen)


def calibrate_segments(
    *,
    signals: np.ndarray,
    matched: np.ndarray,
    segments: np.ndarray,
    exit_layers: list[int],
    num_layers: int,
    delta: float,
    epsilon: float,
    requests: np.ndarray | None = None,
    check_fraction: float = 0.3,
    min_samples_per_layer: int = 1000,
    strategy: str = "calibrated",
    learn_fraction: float = 0.3,
    holdout_fraction: float = 0.2,
    pooled_check_share: float = 0.0,
    risk_test: str = "binomial",
    match_model: str = "logistic",
    borrow_path: bool = True,
    prior_weight: float = PRIOR_WEIGHT,
    seed: int = 0,
    runtimes: np.ndarray | None = None,
    robust_min_runtimes: int = 3,
    answer_tests: Mapping[str, AnswerTestFn] | None = None,
    pooled_answer_test: AnswerTestFn | None = None,
) -> SegmentedCalibration:
    """Thresholds per segment with P(some segment's risk > δ) <= ε (docs/concepts/segments.md).

    signals, matched: (n, L) shadow tokens as for `calibrate_thresholds`; segments: (n,) the
    segment name of each token; requests: (n,) request ids (each token its own request when
    None), so that the pooled set's check tokens are whole requests. `risk_test` and
    `match_model` go to every `calibrate_thresholds` run (and the pooled check uses the same
    test); `pooled_check_share` 0 (the default): a segment large enough for its own LTT runs it
    at the Šidák level and has no pooled fallback; > 0: Bonferroni, every segment at
    ε/k with that share of it kept for a pooled check (for comparison). `borrow_path` lets a
    segment draw its path with the tokens of the larger segments when they outnumber its own,
    shrunk by `prior_weight` (docs/concepts/segments.md; False: each path from its own learn
    tokens only). `runtimes` (n,): each token's runtime, for the cross-runtime holdout and the
    leave-one-runtime-out test of every LTT run (`calibrate_thresholds`). `answer_tests`: per
    segment the answer target's test on that segment's shadow requests (`calibrate_thresholds`'s
    `answer_test`), which its own LTT and its pooled check combine with the token test on the
    joint null at the same level (a segment without one: tokens only); `pooled_answer_test`:
    the pooled set's, on every segment's shadow requests. Raises ValueError on
    malformed input; a segment or pool too small for LTT is not an error, it is reported.
    """
    signals, matched = np.asarray(signals, dtype=float), np.asarray(matched, dtype=bool)
    labels = np.asarray(segments).astype(str)
    if labels.shape != (len(signals),):
        raise ValueError(f"segments has shape {labels.shape}; need one name per token "
                         f"({len(signals)},)")
    if not 0 < check_fraction < 1:
        raise ValueError(f"check_fraction must lie in (0, 1), got {check_fraction}")
    if not 0 <= pooled_check_share < 1:
        raise ValueError(f"pooled_check_share must lie in [0, 1), got {pooled_check_share}")
    requests = np.arange(len(signals)) if requests is None else np.asarray(requests)
    names = sorted(set(labels.tolist()))
    if not names:
        raise ValueError("no shadow tokens to calibrate on")
    options = dict(exit_layers=exit_layers, num_layers=num_layers, delta=delta,
                   strategy=strategy, learn_fraction=learn_fraction,
                   holdout_fraction=holdout_fraction, risk_test=risk_test,
                   match_model=match_model,
                   min_samples_per_layer=min_samples_per_layer, seed=seed,
                   robust_min_runtimes=robust_min_runtimes)
    runtimes = None if runtimes is None else np.asarray(runtimes).astype(str)
    # Which segments run their own LTT, from token counts alone (before any test): the levels
    # below depend on it, so it must not depend on any outcome.
    too_small = {name: _too_small_for_own(signals[labels == name], exit_layers,
                                          min_samples_per_layer) for name in names}
    large = {name: why is None for name, why in too_small.items()}
    k, own_count = len(names), sum(large.values())
    split, own_level, own_rule = _split(epsilon, own=own_count, segments=k,
                                        reserve=pooled_check_share)
    check = np.zeros(len(signals), dtype=bool)
    for index, name in enumerate(names):
        if large[name] and split == "sidak":
            continue  # no pooled check will run on it: all its tokens may help the pooled set
        mine = labels == name
        check[mine] = split_check_requests(requests[mine], fraction=check_fraction,
                                           seed=seed + 7919 * (index + 1))
    notes: list[str] = []
    try:
        pooled = calibrate_thresholds(signals=signals[~check], matched=matched[~check],
                                      requests=requests[~check], epsilon=epsilon,
                                      answer_test=pooled_answer_test,
                                      runtimes=None if runtimes is None else runtimes[~check],
                                      **options)
    except NotEnoughShadowData as error:
        pooled = None
        notes.append(f"pooled set not calibrated: {error}")
    never = dict.fromkeys((int(layer) for layer in exit_layers), NEVER_EXIT)
    # Largest first (ties by name): a segment borrows only from those before it (docstring).
    order = sorted(names, key=lambda name: (-int((labels == name).sum()), name))
    decided = {}
    for position, name in enumerate(order):
        mine = labels == name
        own_options = dict(options)
        if borrow_path and position > 0:
            # the larger segments' tokens: none is among this segment's test requests
            lender = np.isin(labels, order[:position])
            own_options.update(path_borrowing(int(mine.sum()),
                                              (signals[lender], matched[lender]),
                                              prior_weight=prior_weight))
        decided[name] = _decide(
            name, signals[mine], matched[mine], check[mine], requests[mine], pooled=pooled,
            never=never, delta=delta, too_small=too_small[name], own_level=own_level,
            own_rule=own_rule, per_segment=epsilon / k,
            reserve=pooled_check_share if split == "bonferroni" else 0.0,
            options=own_options | {"runtimes": None if runtimes is None else runtimes[mine],
                                   "answer_test": (answer_tests or {}).get(name)},
            fleet_witnesses=runtime_count(runtimes))
    decided = dict(sorted(decided.items()))
    default = decided[DEFAULT_SEGMENT].thresholds if DEFAULT_SEGMENT in decided else (
        dict(pooled.thresholds) if pooled is not None else never)
    return SegmentedCalibration(delta=delta, epsilon=epsilon,
                                epsilon_per_segment=own_level if own_count else epsilon / k,
                                thresholds=default, segments=decided, pooled=pooled,
                                notes=notes, split=split)


def _split(epsilon: float, *, own: int, segments: int, reserve: float
           ) -> tuple[str, float, str]:
    """(how ε is split, the level of each own LTT, that level in words for the reasons)."""
    if reserve > 0:  # Bonferroni with a pooled-check reserve, for comparison
        level = epsilon / segments * (1.0 - reserve)
        return "bonferroni", level, f"{1 - reserve:g} ε/k = {level:.4g}"
    if own == 0:  # no segment runs its own test: each small one's pooled check at ε/k
        return "bonferroni", epsilon / segments, ""
    level = own_test_level(epsilon, own=own, segments=segments)
    return "sidak", level, (f"1 - (1 - ε m/k)^(1/m) = {level:.4g} (Šidák over the m = {own} "
                            f"own tests of k = {segments} segments)")


def _too_small_for_own(signals: np.ndarray, exit_layers: list[int],
                       required: int) -> str | None:
    """Why a segment's tokens fail the LTT's size rule (`stats.check_counts`); None if not."""
    try:
        check_counts(signals, exit_layers, max(1, required))
    except NotEnoughShadowData as error:
        return str(error)
    return None


def _decide(name: str, signals: np.ndarray, matched: np.ndarray, check: np.ndarray,
            requests: np.ndarray, *, pooled: CalibrationResult | None, never: dict[int, float],
            delta: float, too_small: str | None, own_level: float, own_rule: str,
            per_segment: float, reserve: float, options: dict,
            fleet_witnesses: int = 0) -> SegmentCalibration:
    """One segment: a large one its own LTT if it certifies something, else (only with a
    `reserve`, the share of ε/k kept under the Bonferroni split) a certified pooled set, else
    never-exit; one `too_small` for its own LTT a certified pooled set at ε/k, else
    never-exit."""
    sizes = dict(tokens=len(signals), requests=len(np.unique(requests)))
    if too_small is not None:
        return _fall_back(name, signals, matched, check, requests, pooled=pooled, never=never,
                          delta=delta, level=per_segment,
                          why_not=f"too few shadow tokens for its own calibration ({too_small})",
                          own=None, risk_test=options["risk_test"], sizes=sizes,
                          witnesses=options.get("runtimes"),
                          min_witnesses=options["robust_min_runtimes"],
                          fleet_witnesses=fleet_witnesses,
                          answer_test=options.get("answer_test"))
    own = calibrate_thresholds(signals=signals, matched=matched, requests=requests,
                               epsilon=own_level, **options)
    if any(value < NEVER_EXIT for value in own.thresholds.values()):
        return SegmentCalibration(
            segment=name, source="segment", thresholds=dict(own.thresholds), result=own,
            epsilon=own_level,
            reason=(f"own Learn-Then-Test at {own_rule}: risk bound {own.risk_bound:.4g} <= "
                    f"δ {delta:g}, exit rate {own.exit_rate:.3f}" + _borrowed_note(own)),
            **sizes)
    why_not = f"its own calibration at {own_rule} certified no exiting step"
    if reserve == 0:
        # Its whole share of ε went to its own test (decided by size, before any test): a
        # pooled check now would spend level the joint statement does not have.
        return SegmentCalibration(
            segment=name, source="conservative", thresholds=dict(never), result=own,
            epsilon=own_level,
            reason=(f"{why_not}; a segment large enough for its own calibration has no "
                    "pooled-check reserve: never exit"), **sizes)
    return _fall_back(name, signals, matched, check, requests, pooled=pooled, never=never,
                      delta=delta, level=per_segment * reserve, why_not=why_not, own=own,
                      risk_test=options["risk_test"], sizes=sizes,
                      epsilon=own_level + per_segment * reserve,
                      witnesses=options.get("runtimes"),
                      min_witnesses=options["robust_min_runtimes"],
                      fleet_witnesses=fleet_witnesses,
                      answer_test=options.get("answer_test"))


def _fall_back(name: str, signals: np.ndarray, matched: np.ndarray, check: np.ndarray,
               requests: np.ndarray, *, pooled: CalibrationResult | None,
               never: dict[int, float], delta: float, level: float, why_not: str,
               own: CalibrationResult | None, risk_test: str, sizes: dict,
               epsilon: float | None = None, witnesses: np.ndarray | None = None,
               min_witnesses: int = 3, fleet_witnesses: int = 0,
               answer_test: AnswerTestFn | None = None) -> SegmentCalibration:
    """The pooled set if its check at `level` certifies it on the segment (without any one
    witness too, from `min_witnesses` on), else never-exit. In a fleet of `fleet_witnesses`
    that can check its witnesses (at least `min_witnesses`), a segment whose check tokens come
    from fewer keeps never-exit: no minority of the fleet vouches for a set alone."""
    sizes = sizes | {"epsilon": level if epsilon is None else epsilon}
    if pooled is None or not any(value < NEVER_EXIT for value in pooled.thresholds.values()):
        return SegmentCalibration(
            segment=name, source="conservative", thresholds=dict(never), result=own,
            reason=f"{why_not}; no exiting pooled set to fall back on: never exit", **sizes)
    vouching = runtime_count(None if witnesses is None else np.asarray(witnesses)[check])
    if witnesses is not None and fleet_witnesses >= min_witnesses > vouching:
        return SegmentCalibration(
            segment=name, source="conservative", thresholds=dict(never), result=own,
            reason=(f"{why_not}; its check tokens come from {vouching} witness(es), fewer than "
                    f"the {min_witnesses} that let the fleet check each of them: the pooled "
                    "set is not taken on their word, never exit"), **sizes)
    check_test = _pooled_check(pooled.thresholds, signals, matched, check, requests,
                               delta=delta, level=level, risk_test=risk_test,
                               witnesses=witnesses, min_witnesses=min_witnesses)
    if answer_test is not None:
        answer_p = float(answer_test(np.array([[pooled.thresholds[k]
                                                for k in sorted(pooled.thresholds)]]),
                                     None)[0])
        joint = max(check_test.p_value, answer_p)
        check_test = replace(check_test, p_value=joint, certified=joint <= level,
                             answer_p_value=answer_p)
    if check_test.certified:
        return SegmentCalibration(
            segment=name, source="pooled", thresholds=dict(pooled.thresholds), result=own,
            pooled_check=check_test,
            reason=(f"{why_not}; keeps the pooled set, certified on its {check_test.tokens} "
                    f"check tokens ({check_test.disagreements} disagreements, p "
                    f"{check_test.p_value:.3g} <= {level:.4g})"), **sizes)
    return SegmentCalibration(
        segment=name, source="conservative", thresholds=dict(never), result=own,
        pooled_check=check_test,
        reason=(f"{why_not}; the pooled set is not certified on its {check_test.tokens} check "
                f"tokens ({check_test.disagreements} disagreements, p "
                f"{check_test.p_value:.3g} > {level:.4g}): never exit"), **sizes)


def _borrowed_note(result: CalibrationResult) -> str:
    """How the segment's path was drawn, for its reason (the operator sees what it rests on)."""
    borrowed = result.samples.get("borrowed")
    if not borrowed:
        return ""
    return (f"; path drawn with {borrowed} tokens of the other segments besides its own "
            f"{result.samples['learn']} learn tokens (tested on its own {result.samples['test']})")


def _pooled_check(thresholds: dict[int, float], signals: np.ndarray, matched: np.ndarray,
                  check: np.ndarray, requests: np.ndarray, *, delta: float, level: float,
                  risk_test: str, witnesses: np.ndarray | None = None,
                  min_witnesses: int = 3) -> PooledCheck:
    """The pooled set on the segment's check tokens, by the LTT's test: at the request level
    (its design effect also read on the segment's other requests, as the LTT reads it on the
    requests its test does not see) unless every request is one token. With `witnesses` (each
    token's) from `min_witnesses` of them on, the p-value is the largest over the check tokens
    and the check tokens without each one witness (`evidence.robust_p_values`): no witness
    certifies a segment's pooled set alone."""
    layers = sorted(thresholds)
    n = int(check.sum())
    if n == 0:
        return PooledCheck(tokens=0, disagreements=0, p_value=1.0, level=level, certified=False)
    _, disagree = policy_outcomes(signals, matched, [thresholds[k] for k in layers])
    wrong = int(disagree[check].sum())
    codes = cluster_codes(requests)
    clustered = np.bincount(codes).max() > 1

    def per_request(part: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        dense = np.unique(codes[part], return_inverse=True)[1]
        return np.bincount(dense, weights=disagree[part]), np.bincount(dense)

    reference = per_request(~check) if clustered and (~check).any() else None

    def p_of(mask: np.ndarray | None) -> np.ndarray:
        part = check if mask is None else check & mask
        if not part.any():
            return np.array([1.0])
        if not clustered:
            return np.atleast_1d(risk_p_values(int(disagree[part].sum()), int(part.sum()),
                                               delta, risk_test))
        return clustered_risk_p_values(*per_request(part), delta, alpha=level, test=risk_test,
                                       reference=reference)[0][:1]

    labels = None if witnesses is None else np.asarray(witnesses).astype(str)
    if labels is not None:
        p_value = float(robust_p_values(
            lambda mask: p_of(None if mask is None else _expand(mask, check)),
            labels[check], min_witnesses)[0])
    else:
        p_value = float(p_of(None)[0])
    return PooledCheck(tokens=n, disagreements=wrong, p_value=p_value, level=level,
                       certified=p_value <= level)


def _expand(mask: np.ndarray, check: np.ndarray) -> np.ndarray:
    """A mask over the check tokens as a mask over all the segment's tokens."""
    full = np.zeros(len(check), dtype=bool)
    full[np.flatnonzero(check)[mask]] = True
    return full
