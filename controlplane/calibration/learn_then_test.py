"""Threshold selection with a statistical guarantee: Learn-Then-Test over a threshold path.

A token exits at the first exit layer whose signal is above that layer's threshold (1.0 never
exits); the policy's risk is the share of tokens that exit at a layer whose top-1 differs from
full depth. `calibrate_thresholds` fits a path of threshold vectors on a learn part, tests its
steps in order on a test part (binomial p-values, request-level when request ids are given) and
returns the most aggressive certified step: P(risk > δ) <= ε. The derivation, the choice of
p-value and design effect, and what the test assumes: docs/concepts/statistics.md, "Threshold
selection in detail".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from scipy.special import expit, rel_entr
from scipy.stats import beta, binom, binomtest
from sklearn.isotonic import IsotonicRegression

from controlplane.stats.clustered import (
    binomial_lower_tail,
    binomial_upper_tail,
    cluster_codes,
    few_clusters_factor,
    null_design_effect,
)
from controlplane.stats.exits import policy_outcomes
from controlplane.stats.robust_evidence import holdout_runtimes, robust_p_values, runtime_count

NEVER_EXIT = 1.0


class NotEnoughShadowData(ValueError):
    """Fewer shadow samples than required on some exit layer."""

    def __init__(self, counts: dict[int, int], required: int) -> None:
        self.counts, self.required = counts, required
        short = {layer: n for layer, n in counts.items() if n < required}
        super().__init__(
            f"not enough shadow samples: need at least {required} per exit layer, "
            f"have {short} on the short layers; widen the sample window or wait for more "
            "shadow traffic"
        )


@dataclass(frozen=True)
class LayerCalibration:
    """Chosen threshold and expected behaviour of one exit layer (on the test split)."""

    layer: int
    threshold: float
    exit_rate: float  # share of all tokens exiting here
    conditional_exit_rate: float  # exits here / tokens reaching here (what drift monitors)
    risk: float  # share of all tokens exiting here with a mismatch
    risk_bound: float  # upper bound (level 1-ε) on `risk`, the path test's kind
    p_value: float  # the policy's adjusted p-value at the chosen step
    conditional_disagreement: float  # mismatches among tokens exiting here
    samples: int
    match_curve: list[tuple[float, float]]  # signal -> fitted P(match), for the report


@dataclass(frozen=True)
class CurvePoint:
    """One step of the threshold path: quality vs expected speed on the test split."""

    level: float  # calibrated match-probability level t, or the raw shared threshold
    thresholds: dict[int, float]
    risk: float
    risk_bound: float
    predicted_disagreement: float  # from the fitted match models
    p_value: float
    certified: bool  # rejected "risk > δ" in the fixed sequence
    exit_rate: float
    mean_depth: float
    speedup: float
    chosen: bool = False
    # The answer target's p-value at this step ("answer differs" >= δ_answer on shadow
    # requests), which `p_value` includes; None without an answer target.
    answer_p_value: float | None = None


@dataclass(frozen=True)
class HoldoutCheck:
    """Chosen thresholds replayed on held-out shadow samples."""

    tokens: int
    disagreements: int
    disagreement: float
    exit_rate: float
    mean_depth: float
    p_value: float  # one-sided binomial, H0: disagreement <= δ
    passed: bool


@dataclass(frozen=True)
class CalibrationResult:
    """Chosen per-layer thresholds with their evidence and the quality-vs-speed curve."""

    thresholds: dict[int, float]
    layers: list[LayerCalibration]
    delta: float
    epsilon: float
    num_layers: int
    strategy: str
    risk: float
    risk_bound: float
    p_value: float
    exit_rate: float
    mean_depth: float
    speedup: float
    curve: list[CurvePoint]
    samples: dict[str, int]
    holdout: HoldoutCheck | None = None
    notes: list[str] = field(default_factory=list)
    risk_test: str = "binomial"  # the path's p-value (docs/concepts/statistics.md)
    match_model: str = "logistic"  # the path's P(match) model (docs/concepts/statistics.md)
    # "request": p-values at the request level (docs/concepts/statistics.md); "token": tokens as
    # independent draws (no request ids, or one token each)
    risk_unit: str = "token"
    design_effect: float = 1.0  # of the chosen step's test (1 at the token level)
    # the chosen set's exit rate on each witness's samples (every part), when witnesses are
    # given: the promotion bound reads their median, which no minority of witnesses sets
    witness_exit_rates: dict[str, float] = field(default_factory=dict)
    # With an answer target: the chosen set's answer figures on the shadow requests
    # (`answers.AnswerConsistency.to_dict()` with `delta_answer` and the step's `p_value`)
    answers: dict[str, Any] | None = None

    @property
    def exit_rates(self) -> dict[int, float]:
        return {lc.layer: lc.exit_rate for lc in self.layers}

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (layer keys become strings in JSON)."""
        return asdict(self)


def hb_p_value(risk_hat: Any, n: int, delta: float) -> np.ndarray:
    """Hoeffding-Bentkus p-value for H0: risk > δ, from the empirical risk of n losses in {0,1}.

    p = min(exp(-n h1(min(r̂, δ), δ)), e * P(Binomial(n, δ) <= ceil(n r̂))), with
    h1(a, b) = a log(a/b) + (1-a) log((1-a)/(1-b)).
    """
    r = np.asarray(risk_hat, dtype=float)
    a = np.minimum(r, delta)
    h1 = rel_entr(a, delta) + rel_entr(1.0 - a, 1.0 - delta)
    hoeffding = np.exp(-n * h1)
    bentkus = np.e * binom.cdf(np.ceil(np.round(n * r, 9)), n, delta)
    return np.minimum(1.0, np.minimum(hoeffding, bentkus))


def hb_upper_bound(risk_hat: Any, n: int, epsilon: float) -> Any:
    """Smallest R with Hoeffding-Bentkus p-value <= ε: an upper confidence bound at 1-ε.

    Vectorised over `risk_hat`; returns a float for a scalar input.
    """
    r = np.asarray(risk_hat, dtype=float)
    if n == 0:
        return np.ones_like(r) if r.ndim else 1.0
    lo, hi = r.copy(), np.ones_like(r)
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        reject = hb_p_value(r, n, mid) <= epsilon
        hi = np.where(reject, mid, hi)
        lo = np.where(reject, lo, mid)
    return hi if r.ndim else float(hi)


def binomial_p_value(losses: Any, n: int, delta: float) -> np.ndarray:
    """Exact p-value for H0: risk >= δ from `losses` disagreements (a count) among n
    independent 0/1 losses: P(Binomial(n, δ) <= losses). Valid because Binomial(n, R) is
    stochastically larger than Binomial(n, δ) whenever R >= δ (docs/concepts/statistics.md)."""
    k = np.asarray(losses, dtype=float)
    return np.minimum(1.0, binom.cdf(k, n, delta))


def binomial_upper_bound(losses: Any, n: int, epsilon: float) -> Any:
    """One-sided Clopper-Pearson bound: the smallest R with P(Binomial(n, R) <= losses) <= ε,
    so that `binomial_p_value(losses, n, R) <= ε` exactly when R >= this bound.

    Vectorised over `losses` (counts); returns a float for a scalar input.
    """
    k = np.asarray(losses, dtype=float)
    if n == 0:
        return np.ones_like(k) if k.ndim else 1.0
    bound = np.where(k >= n, 1.0, beta.ppf(1.0 - epsilon, k + 1, np.maximum(n - k, 1)))
    return bound if k.ndim else float(bound)


TESTS = ("binomial", "hoeffding-bentkus")


def risk_p_values(losses: Any, n: int, delta: float, test: str = "binomial") -> np.ndarray:
    """p-values for H0: risk > δ from loss counts, by the named test (the tests:
    docs/concepts/statistics.md, "The p-value")."""
    if test == "binomial":
        return binomial_p_value(losses, n, delta)
    if test == "hoeffding-bentkus":
        return hb_p_value(np.asarray(losses, dtype=float) / n, n, delta)
    raise ValueError(f"unknown test {test!r}; use one of {', '.join(TESTS)}")


def risk_upper_bound(losses: Any, n: int, epsilon: float, test: str = "binomial") -> Any:
    """The 1-ε upper bound on the risk that matches `risk_p_values`' test."""
    if test == "binomial":
        return binomial_upper_bound(losses, n, epsilon)
    if test == "hoeffding-bentkus":
        return hb_upper_bound(np.asarray(losses, dtype=float) / n if n else losses, n, epsilon)
    raise ValueError(f"unknown test {test!r}; use one of {', '.join(TESTS)}")


def clustered_risk_p_values(request_losses: Any, request_tokens: Any, delta: Any, *,
                            alpha: float, test: str = "binomial",
                            reference: tuple[Any, Any] | None = None
                            ) -> tuple[np.ndarray, np.ndarray]:
    """Request-level p-values for H0: risk >= δ, and the design effect each used.

    request_losses: (steps, m) or (m,) disagreements per request; request_tokens: (m,) tokens
    per request; `delta` a number or one per step; `alpha`: the level the p-values are
    compared with (the few-requests shrink depends on it). The count is deflated to its
    effective size n_eff = n / d * KG(m, alpha), losses k * n_eff / n, then the named test on
    (k_eff, n_eff). `reference`: (losses (steps, m'), tokens (m',)) of the same steps on
    requests apart from the tested ones; d is the larger of the two readings. Every request
    one token: exactly `risk_p_values` (d = 1). The derivation, and why the tested sample's
    own reading is not enough: docs/concepts/statistics.md, "The request-level test"."""
    tokens = np.asarray(request_tokens, dtype=float)
    losses = np.atleast_2d(np.asarray(request_losses, dtype=float))
    total, counts = float(tokens.sum()), losses.sum(axis=1)
    if tokens.max(initial=0.0) <= 1.0:  # every request is one token: independent draws
        return (np.atleast_1d(risk_p_values(counts.astype(int), int(total), delta, test)),
                np.ones(len(counts)))
    delta = np.broadcast_to(np.asarray(delta, dtype=float), counts.shape)
    effective, design = effective_trials(tokens, losses, delta, alpha=alpha,
                                         reference=reference)
    if test == "binomial":
        p_values = binomial_lower_tail(counts * effective / total, effective, delta)
    elif test == "hoeffding-bentkus":
        trials = np.floor(effective)
        p_values = np.where(trials >= 1, hb_p_value(counts / total, trials, delta), 1.0)
    else:
        raise ValueError(f"unknown test {test!r}; use one of {', '.join(TESTS)}")
    return np.minimum(1.0, p_values), design


def effective_trials(tokens: np.ndarray, losses: np.ndarray, delta: Any, *, alpha: float,
                     reference: tuple[Any, Any] | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(n_eff, d) per step: the token count n deflated by its design effect d under δ (the
    larger of the reading on these requests and on `reference`'s), shrunk for few requests
    (docs/concepts/statistics.md, "The request-level test")."""
    design = null_design_effect(tokens, losses, delta)
    if reference is not None and np.sum(reference[1]) > 0:
        design = np.maximum(design, null_design_effect(reference[1], reference[0], delta))
    clusters = int(np.count_nonzero(tokens))
    return float(np.sum(tokens)) / design * few_clusters_factor(clusters, alpha), design


def clustered_risk_upper_bound(request_losses: Any, request_tokens: Any, epsilon: float,
                               test: str = "binomial",
                               reference: tuple[Any, Any] | None = None,
                               delta: float | None = None) -> np.ndarray:
    """An upper bound at 1-ε matching `clustered_risk_p_values`: by bisection, an R at which the
    request-level p-value is <= ε, within 2^-30 of the smallest such R where the p-value falls
    as R grows. It need not everywhere (the design effect is re-read at each R), so where
    `delta` is given and the test rejects at δ, the search stays below δ: a certified step's
    bound is never above δ."""
    losses = np.atleast_2d(np.asarray(request_losses, dtype=float))
    tokens = np.asarray(request_tokens, dtype=float)
    lo = losses.sum(axis=1) / max(float(tokens.sum()), 1.0)
    hi = np.ones_like(lo)
    if delta is not None:
        at_delta = clustered_risk_p_values(losses, tokens, delta, alpha=epsilon, test=test,
                                           reference=reference)[0]
        hi = np.where((at_delta <= epsilon) & (lo <= delta), delta, hi)
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        p_values = clustered_risk_p_values(losses, tokens, mid, alpha=epsilon, test=test,
                                           reference=reference)[0]
        reject = p_values <= epsilon
        hi = np.where(reject, mid, hi)
        lo = np.where(reject, lo, mid)
    return hi



def policy_disagreement(
    signals: np.ndarray, matched: np.ndarray, thresholds: Sequence[float]
) -> tuple[int, int]:
    """(disagreements, samples) of a threshold vector on shadow samples, for drift checks."""
    _, disagree = policy_outcomes(np.asarray(signals), np.asarray(matched, bool), thresholds)
    return int(disagree.sum()), len(disagree)


class LogisticMatchModel:
    """Signal -> P(match) as a logistic regression on (s, logit s), made non-decreasing in the
    signal: the fitted curve is read on a fixed grid of signals and replaced by its running
    maximum, so a level t crosses it once. Exposes `X_thresholds_`/`y_thresholds_` (the grid
    and the curve) and `predict` like the isotonic model, so the path and the report use
    either."""

    GRID = np.linspace(0.0, 1.0, 1001)

    def __init__(self, signals: np.ndarray, matched: np.ndarray, *,
                 prior: LogisticMatchModel | None = None, prior_weight: float = 0.0) -> None:
        share = float(matched.mean()) if len(matched) else 0.0
        # `coefficients` (intercept, weights), or None for a flat fit; `prior`: a fit on other
        # (borrowed) tokens towards which this one is shrunk with strength `prior_weight`
        self.coefficients: tuple[float, np.ndarray] | None = None
        centre = None if prior is None or prior_weight <= 0 else prior.coefficients
        if centre is not None and len(matched):
            # a flat own sample (all matched, say) still moves the prior's curve: no early out
            self.coefficients = _fit_logistic(self._features(signals), matched.astype(float),
                                              prior=centre, prior_weight=prior_weight)
        elif 0.0 < share < 1.0:
            self.coefficients = _fit_logistic(self._features(signals), matched.astype(float))
        if self.coefficients is not None:
            intercept, weights = self.coefficients
            logits = intercept + self._features(self.GRID) @ weights
            curve = np.maximum.accumulate(expit(logits))
        elif centre is not None:  # nothing observed here: the prior's curve as it is
            curve = prior.y_thresholds_.copy()
        else:  # all matched or none (or nothing observed): a flat P(match)
            curve = np.full(len(self.GRID), share)
        self.X_thresholds_, self.y_thresholds_ = self.GRID, curve

    @staticmethod
    def _features(signals: np.ndarray) -> np.ndarray:
        s = np.clip(np.asarray(signals, dtype=float), 1e-6, 1.0 - 1e-6)
        return np.column_stack([s, np.log(s / (1.0 - s))])

    def predict(self, signals: Any) -> np.ndarray:
        return np.interp(np.asarray(signals, dtype=float), self.X_thresholds_, self.y_thresholds_)


def _fit_logistic(features: np.ndarray, y: np.ndarray, *, penalty: float = 1.0,
                  iterations: int = 50, prior: tuple[float, np.ndarray] | None = None,
                  prior_weight: float = 0.0) -> tuple[float, np.ndarray]:
    """(intercept, weights) minimising the log-loss sum + penalty/2 |weights|^2 (sklearn's
    LogisticRegression at C = 1/penalty: the mild L2 keeps a small or separable sample from an
    extreme slope), by Newton's method, which is quicker than lbfgs on a few parameters. With
    `prior` (intercept, weights) the penalty is instead prior_weight/2 |beta - prior|^2 on
    every coefficient, the intercept included: the fit is shrunk towards the prior's."""
    x = np.column_stack([np.ones(len(features)), features])
    if prior is None:
        ridge = np.diag([0.0] + [penalty] * features.shape[1])
        centre = np.zeros(x.shape[1])
    else:
        ridge = prior_weight * np.eye(x.shape[1])
        centre = np.concatenate([[prior[0]], prior[1]])

    def objective(b: np.ndarray) -> float:
        z = x @ b
        return float(np.sum(np.logaddexp(0.0, z) - y * z)
                     + 0.5 * (b - centre) @ ridge @ (b - centre))

    beta = centre.copy()
    for _ in range(iterations):
        p = expit(x @ beta)
        gradient = x.T @ (p - y) + ridge @ (beta - centre)
        hessian = (x * (p * (1.0 - p))[:, None]).T @ x + ridge + 1e-9 * np.eye(len(beta))
        step = np.linalg.solve(hessian, gradient)
        # Full Newton steps can cycle on a far start (seen: a fit started at a prior's
        # coefficients on 224 tokens swung between two points); halve until the loss falls.
        before = objective(beta)
        for _ in range(30):
            if objective(beta - step) <= before:
                break
            step = step / 2.0
        beta = beta - step
        if np.max(np.abs(step)) < 1e-8:
            break
    return float(beta[0]), beta[1:]


MATCH_MODELS = ("logistic", "isotonic")


def fit_match_models(
    signals: np.ndarray, matched: np.ndarray, kind: str = "logistic", *,
    borrowed: tuple[np.ndarray, np.ndarray] | None = None, prior_weight: float = 0.0,
) -> list[IsotonicRegression | LogisticMatchModel]:
    """Per exit layer, a model signal -> P(match), non-decreasing in the signal: `"logistic"`
    (`LogisticMatchModel`, the default) or `"isotonic"` regression (docs/concepts/statistics.md,
    "The match model").
    `borrowed` (signals, matched) of other tokens: the logistic fit is shrunk towards one on
    these and the own tokens together, with strength `prior_weight` (`_fit_logistic`); the
    isotonic one is fitted on both together."""
    if kind not in MATCH_MODELS:
        raise ValueError(f"unknown match model {kind!r}; use one of {', '.join(MATCH_MODELS)}")
    if borrowed is not None:
        pool_signals = np.vstack([signals, np.asarray(borrowed[0], dtype=float)])
        pool_matched = np.vstack([matched, np.asarray(borrowed[1], dtype=bool)])
        if kind == "isotonic":
            return fit_match_models(pool_signals, pool_matched, kind)
        pool = fit_match_models(pool_signals, pool_matched, kind)
    models = []
    for j in range(signals.shape[1]):
        ok = ~np.isnan(signals[:, j])
        if kind == "logistic":
            # a layer never observed gets P(match) = 0, so it never exits
            models.append(LogisticMatchModel(
                signals[ok, j], matched[ok, j].astype(bool),
                prior=None if borrowed is None else pool[j], prior_weight=prior_weight))
            continue
        model = IsotonicRegression(y_min=0.0, y_max=1.0, increasing=True, out_of_bounds="clip")
        if ok.any():
            model.fit(signals[ok, j], matched[ok, j].astype(float))
        else:  # layer never observed: P(match) = 0, so it never exits
            model.fit([0.0, 1.0], [0.0, 0.0])
        models.append(model)
    return models


def _match_curve(model, points: int = 50) -> list[tuple[float, float]]:
    xs, ys = model.X_thresholds_, model.y_thresholds_
    keep = np.unique(np.linspace(0, len(xs) - 1, min(points, len(xs))).astype(int))
    return [(float(xs[i]), float(ys[i])) for i in keep]


def _calibrated_thresholds(
    signals: np.ndarray, models: list[IsotonicRegression], levels: np.ndarray
) -> np.ndarray:
    """(levels, L) thresholds: per layer the largest learn signal whose P(match) is below t."""
    out = np.empty((len(levels), signals.shape[1]))
    for j, model in enumerate(models):
        s = np.sort(signals[~np.isnan(signals[:, j]), j])
        if len(s) == 0:
            out[:, j] = NEVER_EXIT
            continue
        f = model.predict(s)  # non-decreasing
        below = np.searchsorted(f, levels, side="left")  # how many learn signals have f < t
        out[:, j] = np.where(
            below >= len(s), NEVER_EXIT, np.where(below == 0, 0.0, s[np.maximum(below - 1, 0)])
        )
    return out


def default_levels() -> np.ndarray:
    """Match-probability levels, dense near 1 where small δ puts the answer."""
    return 1.0 - np.concatenate([[0.0], np.geomspace(1e-4, 1.0, 160)])


def _path_levels(signals: np.ndarray, models: list, per_layer: int = 64) -> np.ndarray:
    """`default_levels` plus each layer's fitted P(match) at `per_layer` quantiles of its learn
    signals, descending: each step adds about 1/`per_layer` of a layer's tokens, where the
    fixed levels could cross a flat stretch of the fit in one step that fails. From the learn
    part only, so the path stays fixed before the test."""
    extra = []
    for j, model in enumerate(models):
        seen = signals[~np.isnan(signals[:, j]), j]
        if len(seen):
            extra.append(model.predict(np.quantile(seen, np.linspace(0.0, 1.0, per_layer))))
    levels = np.unique(np.concatenate([default_levels(), *extra]))
    return levels[::-1]


def check_counts(signals: np.ndarray, exit_layers: Sequence[int], required: int) -> None:
    """Raise NotEnoughShadowData when some exit layer has fewer than `required` observed
    signals: the one size rule a Learn-Then-Test run applies (`calibration.segments` reads it
    before any test to decide which segments run their own)."""
    counts = {
        int(layer): int((~np.isnan(signals[:, j])).sum()) for j, layer in enumerate(exit_layers)
    }
    if min(counts.values(), default=0) < required:
        raise NotEnoughShadowData(counts, required)


def split_shadow_samples(
    n: int, *, holdout_fraction: float = 0.2, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Random (calibration indices, holdout indices)."""
    order = np.random.default_rng(seed).permutation(n)
    n_holdout = round(n * holdout_fraction)
    return np.sort(order[n_holdout:]), np.sort(order[:n_holdout])


def split_by_request(codes: np.ndarray, *, fraction: float, seed: int,
                     among: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(rest, part): token indices (of `among`, default all) split so that a random `fraction`
    of the requests (dense `codes` per token) goes to `part`, whole. Tokens of one request are
    correlated: a request split across the learn, test and holdout parts would let the test
    see what the path was fitted on."""
    among = np.arange(len(codes)) if among is None else np.asarray(among)
    ids = np.unique(codes[among])
    chosen = np.random.default_rng(seed).permutation(ids)[:round(len(ids) * fraction)]
    inside = np.isin(codes[among], chosen)
    return among[~inside], among[inside]


def _depth(first: np.ndarray, exit_layers: np.ndarray, num_layers: int) -> np.ndarray:
    return np.append(exit_layers, num_layers)[first]


def check_holdout(
    thresholds: dict[int, float],
    *,
    signals: np.ndarray,
    matched: np.ndarray,
    exit_layers: Sequence[int],
    num_layers: int,
    delta: float,
    alpha: float = 0.05,
    codes: np.ndarray | None = None,
) -> HoldoutCheck:
    """Replay thresholds on held-out samples; fails when disagreement > δ is significant.

    `codes`: each sample's dense request code. Given (and some request longer than a token),
    the test counts requests as the path's test does: the count deflated by its design
    effect under δ (`null_design_effect`, read on these requests, with the few-requests
    shrink), then the binomial upper tail: tokens of one request disagree together
    (docs/concepts/statistics.md, "The holdout check")."""
    first, disagree = policy_outcomes(signals, matched, [thresholds[k] for k in exit_layers])
    n, k = len(first), int(disagree.sum())
    p = binomtest(k, n, p=delta, alternative="greater").pvalue if n else 1.0
    if n and k and codes is not None and np.bincount(codes).max() > 1:
        tokens = np.bincount(codes).astype(float)
        losses = np.bincount(codes, weights=disagree.astype(float), minlength=len(tokens))
        effective = float(effective_trials(tokens, losses, delta, alpha=alpha)[0][0])
        p = float(binomial_upper_tail(k * effective / n, effective, delta)[()])
    return HoldoutCheck(
        tokens=n,
        disagreements=k,
        disagreement=k / n if n else 0.0,
        exit_rate=float((first < len(exit_layers)).mean()) if n else 0.0,
        mean_depth=float(_depth(first, np.asarray(exit_layers), num_layers).mean()) if n else 0,
        p_value=float(p),
        passed=bool(p > alpha),
    )


def _validate(signals, matched, layers: np.ndarray, delta: float, epsilon: float) -> None:
    if signals.ndim != 2 or signals.shape != matched.shape or signals.shape[1] != len(layers):
        raise ValueError(
            f"signals {signals.shape} and matched {matched.shape} must both be (n, "
            f"{len(layers)}) for exit layers {list(layers)}"
        )
    if np.any(np.diff(layers) <= 0):
        raise ValueError(f"exit layers must be strictly increasing, got {list(layers)}")
    if not (0 < delta < 1 and 0 < epsilon < 1):
        raise ValueError(f"need 0 < δ < 1 and 0 < ε < 1, got δ={delta}, ε={epsilon}")


def _threshold_path(
    strategy: str,
    signals: np.ndarray,
    matched: np.ndarray,
    calib: np.ndarray,
    *,
    grid: Sequence[float] | None,
    learn_fraction: float,
    match_model: str = "logistic",
    codes: np.ndarray | None = None,
    seed: int = 0,
    borrowed: tuple[np.ndarray, np.ndarray] | None = None,
    prior_weight: float = 0.0,
):
    """(path (steps, L) conservative first, levels, match models, learn idx, test idx).
    With request `codes` the learn part is a share of the requests, each whole. `borrowed`
    (signals, matched) of other requests join the learn part in drawing the path
    (`calibrate_thresholds`)."""
    if strategy == "calibrated":
        if codes is None:
            n_learn = round(len(calib) * learn_fraction)
            learn, test = calib[:n_learn], calib[n_learn:]
        else:
            test, learn = split_by_request(codes, fraction=learn_fraction, seed=seed + 1,
                                           among=calib)
        models = fit_match_models(signals[learn], matched[learn], match_model,
                                  borrowed=borrowed, prior_weight=prior_weight)
        seen = signals[learn] if borrowed is None else np.vstack([signals[learn], borrowed[0]])
        levels = np.asarray(grid if grid is not None else _path_levels(seen, models),
                            dtype=float)
        path = _calibrated_thresholds(seen, models, levels)
    elif strategy == "shared":
        learn, test = calib[:0], calib
        models = fit_match_models(signals[calib], matched[calib], match_model)  # report only
        levels = np.asarray(grid if grid is not None else np.linspace(1.0, 0.0, 201), float)
        path = np.repeat(levels[:, None], signals.shape[1], axis=1)
    else:
        raise ValueError(f"unknown strategy {strategy!r}; use 'calibrated' or 'shared'")
    # Never-exit first: risk exactly 0, the fallback when the first test already fails.
    path = np.vstack([np.full(signals.shape[1], NEVER_EXIT), path])
    levels = np.concatenate([[NEVER_EXIT], levels])
    _, first_idx = np.unique(path, axis=0, return_index=True)
    keep = np.sort(first_idx)
    return path[keep], levels[keep], models, learn, test


def _test_path(path, signals, matched, match_prob, *, delta, epsilon, risk_test, codes=None,
               reference=None, runtimes=None, robust_min_runtimes=3, held_out=None,
               answer_p_values=None):
    """Fixed-sequence test of every step: (exit index per step, losses, predicted, p, chosen,
    per-request losses (steps, m) or None, design effects, reference (losses, tokens) or None).
    `codes`: the test tokens' dense request codes, for the request-level p-values (None: tokens
    are independent draws); `reference`: (signals, matched, codes) of the requests outside the
    test, where each step's design effect is read as well; `runtimes`: the test tokens'
    runtimes: each step's p-value is then the largest over the test without each one runtime
    (`robust_evidence.robust_p_values`); `held_out`: (signals, matched, codes or None, runtimes) of
    the runtimes held out of the path and the test: each step's p-value is then also the
    larger of the test's and theirs (`_held_out_p_values`); `answer_p_values`: each step's
    p-value for the answer target, each step's p-value is then the larger of the two (the
    joint null "token risk > δ or answer risk >= δ_answer": `calibrate_thresholds`)."""
    n, n_layers = signals.shape
    firsts, losses, predicted, by_request, by_reference = [], [], [], [], []
    disagreements = []
    for thresholds in path:
        if codes is not None and reference is not None:
            ref_disagree = policy_outcomes(reference[0], reference[1], thresholds)[1]
            by_reference.append(np.bincount(reference[2], weights=ref_disagree,
                                            minlength=reference[2].max() + 1))
        first, disagree = policy_outcomes(signals, matched, thresholds)
        rows = np.flatnonzero(first < n_layers)
        firsts.append(first)
        if runtimes is not None and codes is None:
            disagreements.append(disagree)
        losses.append(int(disagree.sum()))
        predicted.append(float((1.0 - match_prob[rows, first[rows]]).sum() / n))
        if codes is not None:
            by_request.append(np.bincount(codes, weights=disagree, minlength=codes.max() + 1))
    if codes is None:
        p_values = risk_p_values(np.array(losses), n, delta, risk_test)
        design, request_losses, ref = np.ones(len(path)), None, None
    else:
        request_losses = np.array(by_request)
        ref = (np.array(by_reference), np.bincount(reference[2])) if by_reference else None
        p_values, design = clustered_risk_p_values(request_losses, np.bincount(codes), delta,
                                                   alpha=epsilon, test=risk_test, reference=ref)
        p_values = p_values.copy()
    if runtimes is not None:
        p_values = _without_each_runtime(
            p_values, runtimes, robust_min_runtimes, codes=codes, request_losses=request_losses,
            disagreements=disagreements, delta=delta, epsilon=epsilon, risk_test=risk_test,
            reference=ref)
    if held_out is not None and len(held_out[0]):
        p_values = np.maximum(p_values, _held_out_p_values(
            path, *held_out, delta=delta, epsilon=epsilon, risk_test=risk_test,
            reference=None if codes is None else (request_losses, np.bincount(codes)),
            min_runtimes=robust_min_runtimes))
    if answer_p_values is not None:
        p_values = np.maximum(p_values, answer_p_values)
    p_values[0] = 0.0  # never-exit is certain, not tested
    failed = np.flatnonzero(p_values > epsilon)
    chosen = int(failed[0] - 1) if len(failed) else len(path) - 1
    return firsts, np.array(losses), predicted, p_values, chosen, request_losses, design, ref


def _held_out_p_values(path, signals, matched, codes, runtimes=None, *, delta, epsilon,
                       risk_test, reference, min_runtimes=3):
    """Each step's p-value on the shadow tokens of the runtimes held out of the path and the
    test (the cross-runtime holdout), by the test's own kind: request-level with `codes`, the
    design effect read as well on `reference` (the test's per-request losses and tokens), which
    is independent of the held-out outcome. With `min_runtimes` held-out `runtimes`, the
    largest over them without each one (`robust_evidence.robust_p_values`): no held-out runtime
    decides alone."""
    disagreements = [policy_outcomes(signals, matched, thresholds)[1] for thresholds in path]

    def p_of(mask):
        kept = slice(None) if mask is None else mask
        if codes is None:
            return risk_p_values(np.array([int(d[kept].sum()) for d in disagreements]),
                                 len(signals[kept]), delta, risk_test)
        requests, mine = np.unique(codes[kept], return_inverse=True)
        losses = np.array([np.bincount(mine, weights=d[kept], minlength=len(requests))
                           for d in disagreements])
        return clustered_risk_p_values(losses, np.bincount(mine), delta, alpha=epsilon,
                                       test=risk_test, reference=reference)[0]

    return robust_p_values(p_of, runtimes, min_runtimes)


def _without_each_runtime(p_values, runtimes, min_runtimes, *, codes, request_losses,
                          disagreements, delta, epsilon, risk_test, reference):
    """Each step's p-value made the largest over the test tokens without each one runtime
    (`evidence.robust_p_values`; requests never span runtimes: the service keys them by
    runtime)."""
    def p_of(mask):
        if mask is None:
            return p_values
        if codes is None:
            kept = np.array([int(d[mask].sum()) for d in disagreements])
            return risk_p_values(kept, int(mask.sum()), delta, risk_test)
        columns = np.unique(codes[mask])
        return clustered_risk_p_values(request_losses[:, columns],
                                       np.bincount(codes)[columns], delta, alpha=epsilon,
                                       test=risk_test, reference=reference)[0]

    return robust_p_values(p_of, runtimes, min_runtimes).copy()


def _layer_results(first, disagree, path_step, signals, models, layers, epsilon, p_value,
                   risk_test, codes=None):
    n, reaching, out = len(first), len(first), []
    for j, layer in enumerate(layers):
        here = first == j
        exits, wrong = int(here.sum()), int((here & disagree).sum())
        if codes is None:
            bound = float(risk_upper_bound(wrong, n, epsilon, risk_test))
        else:
            bound = float(clustered_risk_upper_bound(
                np.bincount(codes, weights=here & disagree, minlength=codes.max() + 1),
                np.bincount(codes), epsilon, risk_test)[0])
        out.append(
            LayerCalibration(
                layer=int(layer),
                threshold=float(path_step[j]),
                exit_rate=exits / n,
                conditional_exit_rate=exits / reaching if reaching else 0.0,
                risk=wrong / n,
                risk_bound=bound,
                p_value=p_value,
                conditional_disagreement=wrong / exits if exits else 0.0,
                samples=int((~np.isnan(signals[:, j])).sum()),
                match_curve=_match_curve(models[j]),
            )
        )
        reaching -= exits
    return out


def calibrate_thresholds(
    *,
    signals: np.ndarray,
    matched: np.ndarray,
    exit_layers: Sequence[int],
    num_layers: int,
    delta: float,
    epsilon: float,
    strategy: str = "calibrated",
    grid: Sequence[float] | None = None,
    learn_fraction: float = 0.3,
    holdout_fraction: float = 0.2,
    min_samples_per_layer: int = 1000,
    seed: int = 0,
    risk_test: str = "binomial",
    match_model: str = "logistic",
    requests: Sequence | np.ndarray | None = None,
    borrowed: tuple[np.ndarray, np.ndarray] | None = None,
    prior_weight: float = 0.0,
    runtimes: Sequence | np.ndarray | None = None,
    robust_min_runtimes: int = 3,
    answer_test: Callable[[np.ndarray, np.ndarray | None], np.ndarray] | None = None,
) -> CalibrationResult:
    """Most aggressive thresholds with P(policy disagreement > δ) <= ε.

    docs/concepts/statistics.md ("Threshold selection in detail") derives the selection.
    signals: (n, L) float in [0, 1] (NaN = layer not observed); matched: (n, L) bool;
    exit_layers: the L exit layers in increasing order. A random `holdout_fraction` is set
    aside for `check_holdout`; of the rest, `learn_fraction` builds the path ("calibrated").
    `grid` overrides the path levels (match-probability levels for "calibrated", raw
    thresholds for "shared"; conservative first). `risk_test` names the path's p-value
    ("binomial" or "hoeffding-bentkus"), `match_model` the path's model of P(match)
    ("logistic" or "isotonic"). `requests`: each sample's request id; given, the holdout,
    learn and test parts are whole requests and the test is the request-level one; None, or
    every request one token: tokens are independent draws. `borrowed`: (signals, matched) of
    tokens from *other* requests (never these samples'), which help draw the path only
    (`prior_weight` the shrink towards them); the split, the test and its level are
    unchanged. `runtimes`: each sample's runtime; with two or more, the holdout part is whole
    runtimes (every step must be certified on runtimes it did not learn from as well as on the
    test part), and with at least `robust_min_runtimes` in the test part each step must be
    certified without any one runtime's tokens (`stats.robust_evidence`). `answer_test`: the
    answer target's p-values for the path's steps ((steps, L) and the runtimes held out of the
    path, or None -> (steps,), e.g. `answers.AnswerTest.p_values` on shadow requests the path
    was not drawn from); each step
    is then tested on the joint null "token risk > δ or answer risk >= δ_answer" with the
    larger of the two p-values (valid for the union null: each is valid for its part), in the
    same fixed sequence at ε, so both targets hold together with probability 1-ε and ε is not
    split. Raises
    NotEnoughShadowData below `min_samples_per_layer` samples on any layer, ValueError on
    malformed input.
    """
    signals, matched = np.asarray(signals, dtype=float), np.asarray(matched, dtype=bool)
    layers = np.asarray(exit_layers, dtype=int)
    _validate(signals, matched, layers, delta, epsilon)
    if match_model not in MATCH_MODELS:
        raise ValueError(f"unknown match model {match_model!r}; use one of "
                         f"{', '.join(MATCH_MODELS)}")
    if risk_test not in TESTS:
        raise ValueError(f"unknown test {risk_test!r}; use one of {', '.join(TESTS)}")
    check_counts(signals, layers, max(1, min_samples_per_layer))
    codes = _request_codes(requests, len(signals))
    if codes is None:
        calib, holdout = split_shadow_samples(
            len(signals), holdout_fraction=holdout_fraction, seed=seed
        )
        calib = np.random.default_rng(seed + 1).permutation(calib)
    else:
        calib, holdout = split_by_request(codes, fraction=holdout_fraction, seed=seed)
    runtimes = None if runtimes is None else np.asarray(runtimes).astype(str)
    if runtimes is not None and runtimes.shape != (len(signals),):
        raise ValueError(f"runtimes has shape {runtimes.shape}; need one per sample "
                         f"({len(signals)},)")
    held = None if runtimes is None else holdout_runtimes(
        runtimes, fraction=holdout_fraction, seed=seed, min_test_runtimes=robust_min_runtimes)
    if held is not None:
        holdout = np.flatnonzero(held)
        calib = np.random.default_rng(seed + 1).permutation(np.flatnonzero(~held))
    path, levels, models, learn, test = _threshold_path(
        strategy, signals, matched, calib, grid=grid, learn_fraction=learn_fraction,
        match_model=match_model, codes=codes, seed=seed, borrowed=borrowed,
        prior_weight=prior_weight,
    )
    s_test, m_test, n = signals[test], matched[test], len(test)
    test_codes = reference = None
    if codes is not None:
        test_codes = np.unique(codes[test], return_inverse=True)[1]
        # every request the test does not see (learn and holdout): where each step's design
        # effect is read independently of the test's outcome (docs/concepts/statistics.md)
        apart = np.setdiff1d(np.arange(len(signals)), test)
        if len(apart):
            reference = (signals[apart], matched[apart],
                         np.unique(codes[apart], return_inverse=True)[1])
    match_prob = np.column_stack(
        [models[j].predict(np.nan_to_num(s_test[:, j], nan=0.0)) for j in range(len(layers))]
    )  # (n, L)
    answer_p = None if answer_test is None else np.asarray(answer_test(
        path, None if held is None else np.unique(runtimes[holdout])), dtype=float)
    firsts, losses, predicted, p_values, chosen, request_losses, design, ref = _test_path(
        path, s_test, m_test, match_prob, delta=delta, epsilon=epsilon, risk_test=risk_test,
        codes=test_codes, reference=reference,
        runtimes=None if runtimes is None else runtimes[test],
        robust_min_runtimes=robust_min_runtimes,
        held_out=None if held is None else (
            signals[holdout], matched[holdout],
            None if codes is None else np.unique(codes[holdout], return_inverse=True)[1],
            runtimes[holdout]),
        answer_p_values=answer_p,
    )
    adjusted = float(np.maximum.accumulate(p_values)[chosen])  # fixed-sequence adjusted p
    if test_codes is None:
        bounds = risk_upper_bound(losses, n, epsilon, risk_test)
    else:
        bounds = clustered_risk_upper_bound(request_losses, np.bincount(test_codes), epsilon,
                                            risk_test, reference=ref, delta=delta)
    curve = []
    for i, first in enumerate(firsts):
        depth = float(_depth(first, layers, num_layers).mean())
        curve.append(
            CurvePoint(
                level=float(levels[i]),
                thresholds={int(k): float(t) for k, t in zip(layers, path[i], strict=True)},
                risk=losses[i] / n,
                risk_bound=float(bounds[i]),
                predicted_disagreement=predicted[i],
                p_value=float(p_values[i]),
                certified=i <= chosen,
                exit_rate=float((first < len(layers)).mean()),
                mean_depth=depth,
                speedup=num_layers / depth,
                chosen=i == chosen,
                answer_p_value=None if answer_p is None else float(answer_p[i]),
            )
        )
    best = curve[chosen]
    disagree = policy_outcomes(s_test, m_test, path[chosen])[1]
    holdout_check = None
    if len(holdout):
        holdout_check = check_holdout(
            best.thresholds,
            signals=signals[holdout],
            matched=matched[holdout],
            exit_layers=[int(x) for x in layers],
            num_layers=num_layers,
            delta=delta,
            codes=None if codes is None else np.unique(codes[holdout], return_inverse=True)[1],
        )
    return CalibrationResult(
        thresholds=dict(best.thresholds),
        layers=_layer_results(
            firsts[chosen], disagree, path[chosen], signals, models, layers, epsilon, adjusted,
            risk_test, test_codes,
        ),
        delta=delta,
        epsilon=epsilon,
        num_layers=num_layers,
        strategy=strategy,
        risk=best.risk,
        risk_bound=best.risk_bound,
        p_value=adjusted,
        exit_rate=best.exit_rate,
        mean_depth=best.mean_depth,
        speedup=best.speedup,
        curve=curve,
        samples=_sample_counts(codes, learn=learn, test=test, holdout=holdout) | (
            {} if borrowed is None else {"borrowed": len(borrowed[0])}) | (
            {} if runtimes is None else {
                "runtimes": runtime_count(runtimes),
                "test_runtimes": runtime_count(runtimes[test]),
                "holdout_runtimes": runtime_count(runtimes[holdout]) if held is not None
                else 0}),
        holdout=holdout_check,
        notes=[] if chosen > 0 else ["no exit step was certified: never-exit thresholds chosen"],
        risk_test=risk_test,
        match_model=match_model,
        risk_unit="token" if codes is None else "request",
        design_effect=float(design[chosen]),
        witness_exit_rates={} if runtimes is None else _exit_rates_by(
            runtimes, signals, path[chosen], len(layers)),
    )


def _exit_rates_by(labels: np.ndarray, signals: np.ndarray, thresholds, width: int
                   ) -> dict[str, float]:
    """The exit rate of `thresholds` on each label's samples."""
    first, _ = policy_outcomes(signals, np.ones(signals.shape, dtype=bool), thresholds)
    names, codes = np.unique(labels, return_inverse=True)
    exits = np.bincount(codes, weights=first < width, minlength=len(names))
    return {str(name): float(exits[i] / max(1, (codes == i).sum()))
            for i, name in enumerate(names)}


def _request_codes(requests, n: int) -> np.ndarray | None:
    """Dense request codes per sample, or None when tokens are to be taken as independent
    (no ids, or every request one token: the request-level test is then the token one)."""
    if requests is None:
        return None
    requests = np.asarray(requests)
    if requests.shape != (n,):
        raise ValueError(f"requests has shape {requests.shape}; need one id per sample ({n},)")
    codes = cluster_codes(requests)
    return None if np.bincount(codes).max(initial=0) <= 1 else codes


def _sample_counts(codes, *, learn, test, holdout) -> dict[str, int]:
    """Token counts per part, and request counts when the samples carry request ids."""
    counts = {"total": len(learn) + len(test) + len(holdout), "learn": len(learn),
              "test": len(test), "holdout": len(holdout)}
    if codes is not None:
        counts |= {"requests": len(np.unique(codes)),
                   "learn_requests": len(np.unique(codes[learn])),
                   "test_requests": len(np.unique(codes[test])),
                   "holdout_requests": len(np.unique(codes[holdout]))}
    return counts
