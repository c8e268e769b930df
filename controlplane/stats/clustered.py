"""Proportions from tokens that come in requests: cluster-robust variance and effective size.

A request's tokens exit (and agree with full depth) together, so a test that counts tokens as
independent samples overstates its evidence by the design effect. Here the unit is the request:
the ratio estimate over requests with its cluster-robust (CR1) variance, the Kish design effect
and effective sample size the binomial and z-tests read, and the score-form design effect of
calibration's request-level test. Why this estimator and not a bootstrap or a mean of
per-request rates: docs/concepts/statistics.md, "Clustered proportions".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy.stats import beta, norm
from scipy.stats import t as student_t


@dataclass(frozen=True)
class ClusteredProportion:
    """A proportion over tokens clustered in requests, with its design effect."""

    events: int
    tokens: int
    clusters: int
    rate: float
    design_effect: float
    effective_tokens: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def upper_bound(self, alpha: float) -> float:
        """One-sided (1 - alpha) upper bound of the rate: Clopper-Pearson on the effective size."""
        return clopper_pearson(self.rate, self.effective_tokens, alpha)[1]

    def lower_bound(self, alpha: float) -> float:
        """One-sided (1 - alpha) lower bound of the rate."""
        return clopper_pearson(self.rate, self.effective_tokens, alpha)[0]

    def p_value_above(self, delta: float) -> float:
        """One-sided p-value of H0: rate <= delta (exact binomial on the effective size)."""
        n = self.effective_tokens
        if n <= 0:
            return 1.0
        x = self.rate * n
        if x <= 0:
            return 1.0
        # P(Bin(n, delta) >= x) = I_delta(x, n - x + 1), continuous in a non-integer x
        return float(beta.cdf(delta, x, n - x + 1))


def clopper_pearson(rate: float, n: float, alpha: float) -> tuple[float, float]:
    """One-sided (1 - alpha) lower and upper bounds of `rate` seen on `n` (effective) trials."""
    if n <= 0:
        return 0.0, 1.0
    x = rate * n
    lower = 0.0 if x <= 0 else float(beta.ppf(alpha, x, n - x + 1))
    upper = 1.0 if x >= n else float(beta.ppf(1 - alpha, x + 1, n - x))
    return lower, upper


def cluster_codes(cluster_ids: Sequence) -> np.ndarray:
    """Dense integer codes 0..k-1 of per-token cluster ids (integer ids are coded without the
    string conversion). A window's ids are coded once: converting 10^5 ids to strings costs
    more than the statistics themselves."""
    if isinstance(cluster_ids, np.ndarray) and cluster_ids.dtype.kind in "iu":
        return np.unique(cluster_ids, return_inverse=True)[1].ravel()
    _, cluster = np.unique(np.asarray(cluster_ids, dtype=object).astype(str),
                           return_inverse=True)
    return cluster.ravel()


def per_cluster(cluster_ids: Sequence, events: np.ndarray,
                include: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per-cluster (tokens, events) from per-token cluster ids and 0/1 events.

    `include` (bool per token) restricts the tokens counted, e.g. those that reached a layer;
    clusters with no included token are dropped."""
    events = np.asarray(events, dtype=np.int64)
    keep = np.ones(len(events), dtype=bool) if include is None else np.asarray(include, bool)
    cluster = cluster_codes(cluster_ids)
    tokens = np.bincount(cluster.ravel(), weights=keep).astype(np.int64)
    hits = np.bincount(cluster.ravel(), weights=events * keep).astype(np.int64)
    present = tokens > 0
    return tokens[present], hits[present]


def clustered_proportion(tokens: np.ndarray, events: np.ndarray) -> ClusteredProportion:
    """The ratio estimate and its design effect from per-cluster token and event counts."""
    tokens, events = np.asarray(tokens, dtype=float), np.asarray(events, dtype=float)
    total, hits, clusters = float(tokens.sum()), float(events.sum()), len(tokens)
    if total <= 0:
        return ClusteredProportion(0, 0, 0, 0.0, 1.0, 0.0)
    rate = hits / total
    binomial = rate * (1.0 - rate) / total
    if clusters < 2 or binomial <= 0.0:
        effective = float(max(clusters, 1))  # no variation to measure: one sample per request
        return ClusteredProportion(int(hits), int(total), clusters, rate,
                                   total / effective, effective)
    residual = events - rate * tokens
    robust = clusters / (clusters - 1) * float(residual @ residual) / total**2
    design_effect = max(1.0, robust / binomial)
    return ClusteredProportion(int(hits), int(total), clusters, rate, design_effect,
                               total / design_effect)


def clustered_rate(cluster_ids: Sequence, events: np.ndarray,
                   include: np.ndarray | None = None) -> ClusteredProportion:
    """`clustered_proportion` straight from per-token cluster ids and events."""
    return clustered_proportion(*per_cluster(cluster_ids, events, include))


def mean_design_effect(cluster_ids: Sequence, values: np.ndarray) -> tuple[float, int]:
    """(design effect of the mean of `values`, clusters): CR1 variance of the ratio estimator
    sum(y_i) / sum(n_i) over the iid variance s^2 / n. What a two-sample test of a continuous
    per-token value (the signal histogram) must pay for clustering."""
    values = np.asarray(values, dtype=float)
    if len(values) < 2:
        return 1.0, len(values)
    cluster = cluster_codes(cluster_ids)
    sizes = np.bincount(cluster).astype(float)
    sums = np.bincount(cluster, weights=values)
    groups, total = len(sizes), float(sizes.sum())
    spread = float(values.var(ddof=1))
    if groups < 2 or spread <= 0.0:
        return 1.0, groups
    mean = sums.sum() / total
    residual = sums - mean * sizes
    robust = groups / (groups - 1) * float(residual @ residual) / total**2
    return max(1.0, robust / (spread / total)), groups


def scale_design_effect(design_effect: float, *, mean_cluster_size: float,
                        target_cluster_size: float) -> float:
    """A design effect measured on clusters of `mean_cluster_size` tokens, carried to clusters
    of `target_cluster_size` through the intra-request correlation rho: d = 1 + (m - 1) rho."""
    if mean_cluster_size <= 1.0:
        return max(1.0, design_effect)
    rho = min(1.0, max(0.0, (design_effect - 1.0) / (mean_cluster_size - 1.0)))
    return max(1.0, 1.0 + (max(target_cluster_size, 1.0) - 1.0) * rho)


def weighted_cluster_size(tokens: np.ndarray) -> float:
    """Mean cluster size seen by a token (sum n_i^2 / sum n_i): the design effect grows with it."""
    tokens = np.asarray(tokens, dtype=float)
    return float((tokens @ tokens) / tokens.sum()) if tokens.sum() > 0 else 0.0


def layer_design_effects(cluster_ids: Sequence, exit_slot: np.ndarray, layers: Sequence[int],
                         *, min_clusters: int = 10) -> dict[int, ClusteredProportion]:
    """Per exit layer, the clustered conditional exit rate of shadow tokens under the policy
    (tokens that reached the layer; exits there): its design effect is what an exit-rate test
    of that layer must pay for clustering. Layers with fewer than `min_clusters` requests
    reaching them are left out."""
    out = {}
    for slot, layer in enumerate(layers):
        reached = exit_slot >= slot
        found = clustered_rate(cluster_ids, exit_slot == slot, include=reached)
        if found.clusters >= min_clusters:
            out[layer] = found
    return out


def effective_rows(rows: int, design_effect: float) -> int:
    """How many rows a sample of `rows` clustered tokens is worth as independent samples."""
    return max(1, math.floor(rows / max(design_effect, 1.0)))


# -- request-level risk tests (calibration's Learn-Then-Test) ------------------------------------

def null_design_effect(tokens: np.ndarray, events: np.ndarray, rate: Any) -> np.ndarray:
    """Design effect of a clustered 0/1 count *under a hypothesised rate* (the score form):
    sum_i (x_i - rate n_i)^2 / (rate (1 - rate) sum_i n_i), clipped to [1, sum n_i^2 / sum n_i].

    Centred at the hypothesised rate because a test of "risk >= rate" needs the count's spread
    at the null, and the observed-rate variance is 0 on a sample with no event
    (docs/concepts/statistics.md, "The request-level test").

    `events`: (m,) or (steps, m) per-cluster counts against (m,) `tokens`; `rate` a number or
    one per step; returns (steps,)."""
    tokens = np.asarray(tokens, dtype=float)
    events = np.atleast_2d(np.asarray(events, dtype=float))
    total = float(tokens.sum())
    if total <= 0:
        return np.ones(len(events))
    rate = np.broadcast_to(np.asarray(rate, dtype=float), (len(events),))
    score = ((events - rate[:, None] * tokens[None, :]) ** 2).sum(axis=1)
    ceiling = max(1.0, float(tokens @ tokens) / total)
    spread = rate * (1.0 - rate) * total  # 0 at rate 0 or 1, where nothing varies: d = 1
    design = np.where(spread > 0, score / np.where(spread > 0, spread, 1.0), 1.0)
    return np.clip(design, 1.0, ceiling)


def few_clusters_factor(clusters: int, alpha: float) -> float:
    """Korn & Graubard's degrees-of-freedom shrink of an effective sample size,
    (z_{1-alpha} / t_{clusters-1, 1-alpha})^2 (one-sided): a variance estimated from few
    requests is itself uncertain. 1 is approached as requests grow (0.94 at 34 requests,
    alpha 0.045; 0.83 at 12)."""
    if clusters < 2:
        return 0.0
    return float((norm.ppf(1.0 - alpha) / student_t.ppf(1.0 - alpha, clusters - 1)) ** 2)


def binomial_upper_tail(events: Any, trials: Any, rate: Any) -> np.ndarray:
    """P(Binomial(trials, rate) >= events), continuous in non-integer (effective) events and
    trials: I_rate(events, trials - events + 1); 1 at no events, 0 past the trials. Equal to
    scipy's binom.sf(events - 1) for integers."""
    k = np.asarray(events, dtype=float)
    n = np.asarray(trials, dtype=float)
    inside = (k > 0) & (k <= n)
    tail = beta.cdf(rate, np.where(inside, k, 1.0), np.where(inside, n - k + 1.0, 1.0))
    return np.where(k <= 0, 1.0, np.where(inside, tail, 0.0))


def binomial_lower_tail(events: Any, trials: Any, rate: Any) -> np.ndarray:
    """P(Binomial(trials, rate) <= events), continuous in non-integer (effective) events and
    trials through the regularised incomplete beta: I_{1-rate}(trials - events, events + 1).
    Equal to scipy's binom.cdf for integers."""
    k = np.asarray(events, dtype=float)
    n = np.asarray(trials, dtype=float)
    inside = k < n
    tail = beta.sf(rate, k + 1.0, np.where(inside, n - k, 1.0))
    return np.where(inside, tail, 1.0)
