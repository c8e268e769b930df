"""Per-segment calibration: each traffic segment gets its own Learn-Then-Test
thresholds on its own shadow tokens, with ε split across segments so that one statement holds
for all of them at once.

How ε is split (seg-power2: Šidák across the segments' own tests; it was Bonferroni, ε/k each,
with a tenth of each share reserved for a pooled check). Each segment s has its own risk R_s
(policy disagreement on its traffic); F_s is the event that the thresholds it gets have
R_s > δ. What operators need when the mix moves is "every segment within δ, with probability
1-ε": P(∪_s F_s) <= ε. Before any loss is seen, the token counts per layer (the same minimum
`calibrate_thresholds` applies, `stats.check_counts`) sort the k segments into the m that run
their own LTT and the k - m too small for it:

- a segment too small for its own LTT keeps the pooled set only if a test of the pooled
  thresholds on its check tokens certifies it, at ε/k (the same test as the LTT's, `risk_test`:
  by default the exact binomial tail, `stats.binomial_p_value`), else never-exit;
- a segment large enough runs its own fixed-sequence LTT (`calibrate_thresholds`) at the level
  a = 1 - (1 - ε m/k)^(1/m) (Šidák over the m own tests); if it certifies no exiting step the
  segment gets never-exit, with no pooled check (it has no level reserved for one: a segment
  with enough tokens almost never fell back, chat 100/100 and code 99/100 trials on
  bench/segments.py's real records, so the reserve bought nothing and cost level).

Why Šidák holds for the own tests (a conditional-independence argument, not an assumption about
the traffic). Order the segments by token count, largest first (ties by name): fixed by sizes
alone, before any test. Segment s's path may borrow tokens of the segments *before* it in that
order, never after (`borrow_path`, below); its holdout, learn and test parts are its own requests.
Let D_s be all of segment s's shadow tokens; the segments' requests are distinct and drawn
independently, so D_1, ..., D_k are independent. Given D_1..D_{s-1} (everything its path may
borrow), F_s depends only on D_s, and its LTT is valid conditionally: the path is then fixed
before its test requests are seen, so P(F_s | D_1..D_{s-1}) <= a for every value of them. The
events F_1..F_{s-1} are functions of D_1..D_{s-1}, so by the chain rule
P(no F_s among any set S of own segments) = Π_j P(no F_j | no earlier one) >= (1-a)^|S|, and
P(∪ F over the own segments) <= 1 - (1-a)^m = ε m/k. Borrowing both ways (two segments each
drawing its path with the other's test tokens) would break this: then each test is still valid
given the other's data, but two-way dependence lets the two failures avoid each other and
P(F_1 ∪ F_2) reach 2a > 1 - (1-a)^2; hence the order. The small segments' pooled checks depend
on the pooled set, drawn on every segment's tokens, so they join by the union bound: P(∪_s F_s)
<= ε m/k + (k - m) ε/k = ε, whatever the dependence between the two groups. With every segment
large (m = k) the own level is 1 - (1-ε)^(1/k) >= ε/k: 0.0513 instead of 0.045 (0.9 ε/k) at
ε 0.1, k 2. `pooled_check_share` > 0 restores the former scheme (Bonferroni ε/k, that share of
it reserved for the pooled check of a segment whose own LTT certifies nothing), for comparison.
Measured on bench/segments.py (`--requests 480`, 100 trials): the per-segment sets' served exit
rate 0.2149 (0.9 ε/k and the reserve) -> 0.2163 (ε/k, no reserve) -> 0.2165 (Šidák), against
0.2408 for the recalibrated pool: 0.892x -> 0.899x (bench/segments.py's table).

A later one-segment recalibration (a segment that fell back alone, `flows.recalibration`)
replaces one segment's set and must keep the joint statement with the sets the others hold.
Those came from other data, and its window may overlap theirs (its borrowed tokens, its own
tokens), so it does not lean on independence: it runs at b = a (1-a)^(k-1), a = 1-(1-ε)^(1/k)
(`recalibration_level`), which the union bound makes enough. Whatever calibration the others'
sets came from (this one, Bonferroni at ε/k, or earlier one-segment recalibrations at b), any j
of them fail together with probability <= 1 - (1-a)^j (for Šidák by the chain rule; for ε/k by
Bernoulli's inequality, j ε/k <= 1 - (1-ε)^(j/k); for the mixed split likewise), and
1 - (1-a)^j + (k-j) b <= 1 - (1-a)^k = ε because n a (1-a)^(n-1) <= 1 - (1-a)^n. At ε 0.1,
k 2: b = 0.0487 (it was ε/k = 0.05).

The pooled set is calibrated (at ε, its own statement about the mix) on every segment's tokens
except the check tokens, a share (`check_fraction`) of the *requests* of each segment that may
run a pooled check (tokens of one request are correlated, so they stay on one side), so the
pooled check sees data the pooled set was not chosen on; a segment that runs its own LTT with
no reserve gives the pooled set all its tokens. If no test passes the segment keeps the
conservative never-exit thresholds. The result says, per segment, which set it got and why.

A small segment's path borrows the larger segments' tokens (`borrow_path`: power on
a small segment). The LTT's guarantee needs only that the path be fixed independently of the
tokens it is tested on; other segments' tokens come from other requests, so they may help draw
it. When the segments before it in the size order (above: only those, so that the own tests stay
independent given what they borrow) together hold more tokens than this one, its match model per
layer is its own learn tokens' logistic fit shrunk towards a fit on them plus those segments'
tokens (`prior_weight`, a Gaussian prior on the coefficients: `stats._fit_logistic`); the test,
its requests, its level and the reference reading of the design effect are exactly those of the
segment's own LTT without borrowing, so its validity is the same by construction. With two
segments this is what it was (the smaller borrows all of the larger's tokens); with three or
more a middle segment no longer borrows the smaller ones' (they hold the least to lend). A
one-segment recalibration (a segment that fell back alone) decides alike (`path_borrowing`)
with every other segment's shadow tokens of its window (its level rests on the union bound, not
on independence). The largest segment keeps its own path: its learn part is already the
largest, and a pool it dominates has little to lend (when chat borrowed too, its served exit
rate did not move: 0.199 with, 0.198 without, 100 trials).

What it buys, measured on bench/segments.py's real records (`--requests 480`): little. Over 100
trials the served exit rate of the per-segment sets went 0.2141 -> 0.2149 (code 0.218 -> 0.219)
against 0.2408 for the recalibrated pool (0.889x -> 0.892x: the 0.9x target is still missed).
On 30 trials with every segment borrowing: 0.2184 own path -> 0.2207 at `prior_weight` 30
(0.2191 at 3, 0.2201 at 10, 0.2195 at 100, 0.2191 with the pooled fit itself). The path is not
what limits code there: on its serving half (15 trials) the best step of its own path under true
risk 0.035 exits 0.2166, of the borrowed one 0.2190, of a path fitted on its 240 serving
requests themselves 0.2195; the test's power on 34 requests at 0.9 ε/k is what limits it (its
chosen steps' true risk 0.018-0.046 in 6 trials, the certified p-values falling monotonically
along the path, so no step is lost to an early failure). On a 40-request segment whose requests
vary more within themselves it pays more (tests/controlplane/calibration/test_segment_power.py:
fresh exit rate 0.4496 -> 0.4590).

Weighed and not adopted, with the figures: (1) a smaller learn share for a segment whose path
is borrowed (0.15 instead of 0.3, so its test holds 41 requests instead of 34): +0.005 served
exit rate on 30 trials, but its learn requests are half of the reference on which the design
effect is read apart from the test (26 -> 19 requests), and at the null's boundary the
request-level test then rejects more often than its level (ε 0.045, 8,000 draws of 32-token
requests, intra-request correlation 0.03 / 0.09 / 0.25 / 0.67: 0.035 / 0.040 / 0.048 / 0.060
with 34 tested and 26 apart, 0.038 / 0.048 / 0.054 / 0.071 with 41 and 19): it buys power by
weakening validity. (2) ε split by 1 / sqrt(tokens) instead of ε/k: +0.002 on 30 trials on top
of the borrowed path, but it is zero-sum: it takes level from the segments large at
calibration, and bench/segments.py serves 80% of the segment that was small at calibration,
which a product default should not assume; and a later one-segment recalibration would have to
read its recorded share (not a rule of ε and k) to keep the joint statement.

Like the LTT itself (`calibration.learn_then_test`, "the request-level test"), both tests work
at the request level when `requests` are given: a segment's own LTT splits and tests whole requests,
and the pooled check deflates its check tokens by the design effect read on them and on the
segment's other requests. Without request ids every token is its own request, the token-level
test of before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
    simulate_policy,
)
from controlplane.stats.clustered import cluster_codes
from controlplane.stats.robust_evidence import robust_p_values, runtime_count
from exitplane.wire import DEFAULT_SEGMENT

Source = Literal["segment", "pooled", "conservative"]

# The shrink of a borrowing segment's match model towards the fit on every segment's tokens
# (module docstring: 3 / 10 / 30 / 100 measured, 30 kept)
PRIOR_WEIGHT = 30.0


def own_test_level(epsilon: float, *, own: int, segments: int) -> float:
    """The level of each of the `own` segments' own LTTs when `segments` segments share ε and
    the rest (too small for their own) spend ε/k each on a pooled check: Šidák over the own
    tests' share ε own/k, 1 - (1 - ε own/k)^(1/own) (module docstring, "How ε is split")."""
    if not 0 < own <= segments:
        raise ValueError(f"need 0 < own <= segments, got own={own}, segments={segments}")
    return 1.0 - (1.0 - epsilon * own / segments) ** (1.0 / own)


def recalibration_level(epsilon: float, segments: int) -> float:
    """The level of a one-segment recalibration among `segments` segments: a (1-a)^(k-1) with
    a = 1 - (1-ε)^(1/k), which keeps "every segment within δ with probability 1-ε" by the union
    bound against whatever calibrations set the others (module docstring)."""
    if segments < 1:
        raise ValueError(f"need at least one segment, got {segments}")
    a = own_test_level(epsilon, own=segments, segments=segments)
    return a * (1.0 - a) ** (segments - 1)


def path_borrowing(own_tokens: int, borrowed: tuple[np.ndarray, np.ndarray] | None, *,
                   prior_weight: float = PRIOR_WEIGHT) -> dict[str, Any]:
    """`calibrate_thresholds` options that let a segment of `own_tokens` shadow tokens draw its
    path with `borrowed` (signals, matched) of the other segments' requests, when those
    outnumber its own (module docstring); {} otherwise. Used by `calibrate_segments` and by a
    one-segment recalibration (`flows.recalibration`), so both decide alike."""
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


@dataclass(frozen=True)
class SegmentCalibration:
    """What one segment gets: its own LTT thresholds, the pooled ones, or never-exit; and why."""

    segment: str
    source: Source
    thresholds: dict[int, float]
    reason: str
    tokens: int
    requests: int
    epsilon: float  # the level this segment's tests spend (module docstring)
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
    split: str = "sidak"  # how ε was split: "sidak" or "bonferroni" (module docstring)

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
) -> SegmentedCalibration:
    """Thresholds per segment with P(some segment's risk > δ) <= ε (see the module docstring).

    signals, matched: (n, L) shadow tokens as for `calibrate_thresholds`; segments: (n,) the
    segment name of each token; requests: (n,) request ids (each token its own request when
    None), so that the pooled set's check tokens are whole requests. `risk_test` and
    `match_model` go to every `calibrate_thresholds` run (and the pooled check uses the same
    test); `pooled_check_share` 0 (the default): a segment large enough for its own LTT runs it
    at the Šidák level and has no pooled fallback; > 0: the former scheme, every segment at
    ε/k with that share of it kept for a pooled check (comparison). `borrow_path` lets a
    segment draw its path with the tokens of the larger segments when they outnumber its own,
    shrunk by `prior_weight` (module docstring; False: each path from its own learn tokens
    only). `runtimes` (n,): each token's runtime, for the cross-runtime holdout and the
    leave-one-runtime-out test of every LTT run (`calibrate_thresholds`). Raises ValueError on
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
            options=own_options | {"runtimes": None if runtimes is None else runtimes[mine]},
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
    if reserve > 0:  # the former scheme, for comparison
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
    `reserve`, the share of ε/k kept by the former scheme) a certified pooled set, else
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
                          fleet_witnesses=fleet_witnesses)
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
                      fleet_witnesses=fleet_witnesses)


def _fall_back(name: str, signals: np.ndarray, matched: np.ndarray, check: np.ndarray,
               requests: np.ndarray, *, pooled: CalibrationResult | None,
               never: dict[int, float], delta: float, level: float, why_not: str,
               own: CalibrationResult | None, risk_test: str, sizes: dict,
               epsilon: float | None = None, witnesses: np.ndarray | None = None,
               min_witnesses: int = 3, fleet_witnesses: int = 0) -> SegmentCalibration:
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
    _, disagree = simulate_policy(signals, matched, [thresholds[k] for k in layers])
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
