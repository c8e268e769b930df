"""Outlier runtimes: a runtime whose shadow evidence differs from the rest of its fleet beyond
chance is set aside (`runtime_outlier`) until an operator clears it.

Every drift cycle, for each traffic segment checked, the window's shadow tokens of the active
version are grouped by runtime, and each runtime is compared with the rest of the fleet (the
others pooled) on what a lying, buggy or mismatched runtime cannot hide:

- per exit layer, the share of its shadow tokens whose top-1 matched full depth there (its
  shadow disagreement at that exit point, whatever the thresholds): a forged all-matched or
  all-mismatched runtime, a broken match check;
- per exit layer, the share whose signal is above the rest's median signal there (its exit
  behaviour under a threshold that does not depend on the active set, so a conservative set
  that exits nowhere still shows it): shifted signals, other heads;
- the active policy's disagreement on its shadow tokens.

Each comparison is a request-clustered test of the runtime's rates against the rest's, all
exit layers of a family at once (a chi-square on the per-layer z's: a liar that moves every
layer a little is seen as soon as one that moves one layer a lot). Each layer's z puts the
pooled rate p on both sides, with variance p(1-p) n d / n^2 and d each side's design effect
(`stats.clustered.null_design_effect`, centred at that side's own rate so that the difference
under test does not inflate it; a runtime's own d is at least the rest's, so a few requests
that happen to look unclustered do not make it certain). The layers' correlation is the
request-level (sandwich) one of the difference, and the test takes the weaker of that and the
rest's own correlation, so an honest runtime is not flagged for a correlation its few requests
misstate. The tests share the drift false-alarm budget: each check spends
`quality_alpha_per_hour x check_interval_s / 3600`, split (Bonferroni) over the segments,
runtimes and the three families tested. Each check reads the segment's shadow tokens of the
active version since it was activated (at most `recent_s` back), so evidence accumulates over
checks. A runtime is tested once it and the rest have `outlier_min_requests` requests each, and
only in a fleet of at least `robust_min_runtimes` (with two there is no majority to tell which
one is off). At most a minority of the fleet is set aside per check, the most significant
first.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

import numpy as np
from scipy.stats import chi2
from sqlalchemy.orm import Session

from controlplane.alerts.kinds import AlertKind
from controlplane.alerts.service import Condition, fire
from controlplane.drift.window_checks import DriftOptions
from controlplane.runtimes.models import RuntimeOutlier
from controlplane.runtimes.outliers import excluded_runtime_ids, set_aside
from controlplane.stats.clustered import cluster_codes, null_design_effect, policy_outcomes
from controlplane.telemetry.service import shadow_evidence
from controlplane.thresholds.models import Deployment
from exitplane.wire import DEFAULT_SEGMENT

STATISTICS = ("policy_disagreement", "matched", "signal_above_median")
# a floor on the eigenvalues of a correlation between exit layers: a direction the fleet's
# evidence says never varies is still given this much room (conservative)
MIN_EIGENVALUE = 0.05


@dataclass(frozen=True)
class OutlierFinding:
    """One runtime's most significant difference from the rest of its fleet."""

    runtime_id: str
    statistic: str  # "matched", "signal_above_median" or "policy_disagreement"
    layer: int | None
    runtime_rate: float
    fleet_rate: float
    z: float
    p_value: float
    level: float
    tokens: int
    requests: int
    fleet_tokens: int
    fleet_requests: int
    fleet_runtimes: int

    def summary(self) -> str:
        what = {"matched": "shadow agreement with full depth",
                "signal_above_median": "share of signals above the fleet's median",
                "policy_disagreement": "disagreement under the active set"}[self.statistic]
        at = (f" at layer {self.layer} (most off of the exit layers tested together)"
              if self.layer is not None else "")
        return (f"runtime {self.runtime_id}: {what}{at} {self.runtime_rate:.1%} on "
                f"{self.tokens} shadow tokens ({self.requests} requests) vs {self.fleet_rate:.1%} "
                f"on the other {self.fleet_runtimes} runtimes' {self.fleet_tokens} (z "
                f"{self.z:+.1f}, p={self.p_value:.2g} < {self.level:.2g}); its samples are set "
                f"aside until an operator clears it")


def _side_totals(codes: np.ndarray, events: np.ndarray, mask: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Per request of one side: (tokens (m,), event counts (m, k))."""
    dense = np.unique(codes[mask], return_inverse=True)[1]
    tokens = np.bincount(dense).astype(float)
    counts = np.stack([np.bincount(dense, weights=column, minlength=len(tokens))
                       for column in events[mask].T], axis=1)
    return tokens, counts


def _correlation(covariance: np.ndarray) -> np.ndarray:
    scale = np.sqrt(np.clip(np.diag(covariance), 1e-300, None))
    return covariance / np.outer(scale, scale)


def clustered_difference(codes: np.ndarray, events: np.ndarray, inside: np.ndarray
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, int]:
    """Inside vs outside on k 0/1 `events` columns over tokens clustered by request `codes`:
    (rates inside (k,), rates outside (k,), z (k,), chi-square p of all k together, the
    degrees of freedom tested); see the module docstring."""
    events = np.asarray(events, dtype=float).reshape(len(codes), -1)
    (n_in, x_in), (n_out, x_out) = (_side_totals(codes, events, mask)
                                    for mask in (inside, ~inside))
    total_in, total_out = n_in.sum(), n_out.sum()
    rate_in, rate_out = x_in.sum(axis=0) / total_in, x_out.sum(axis=0) / total_out
    pooled = (x_in.sum(axis=0) + x_out.sum(axis=0)) / (total_in + total_out)
    varies = (pooled > 0.0) & (pooled < 1.0)
    z = np.zeros(len(pooled))
    if not varies.any():
        return rate_in, rate_out, z, 1.0, 0
    # each side's request-level spread, centred at its own rates (so a difference in rate does
    # not inflate it); a runtime's few requests borrow the fleet's clustering as a floor
    residual_in = x_in - n_in[:, None] * rate_in[None, :]
    residual_out = x_out - n_out[:, None] * rate_out[None, :]
    design_out = np.array([float(null_design_effect(n_out, x_out[:, j], rate_out[j])[0])
                           for j in range(len(pooled))])
    design_in = np.maximum(design_out, [float(null_design_effect(n_in, x_in[:, j],
                                                                 rate_in[j])[0])
                                        for j in range(len(pooled))])
    variance = pooled * (1.0 - pooled) * (design_in / total_in + design_out / total_out)
    z[varies] = (rate_in - rate_out)[varies] / np.sqrt(variance[varies])
    kept = z[varies]
    statistics = []
    for covariance in (residual_in.T @ residual_in / total_in ** 2
                       + residual_out.T @ residual_out / total_out ** 2,
                       residual_out.T @ residual_out):
        correlation = _correlation(covariance[np.ix_(varies, varies)])
        values, vectors = np.linalg.eigh(correlation)
        floored = np.clip(values, MIN_EIGENVALUE, None)
        statistics.append(float(((vectors.T @ kept) ** 2 / floored).sum()))
    return (rate_in, rate_out, z, float(chi2.sf(min(statistics), df=len(kept))),
            len(kept))


def runtime_outliers(*, requests, runtimes, signals: np.ndarray, matched: np.ndarray,
                     thresholds: list[float], layers: list[int], alpha: float,
                     min_requests: int, robust_min_runtimes: int) -> list[OutlierFinding]:
    """The runtimes that differ from the rest beyond chance at family-wise level `alpha`, the
    most significant first, at most a minority of those tested (module docstring)."""
    runtimes = np.asarray(runtimes).astype(str)
    if len(runtimes) == 0:
        return []
    codes = cluster_codes(np.char.add(np.char.add(runtimes, "/"),
                                      np.asarray(requests).astype(str)))
    names, by_runtime = np.unique(runtimes, return_inverse=True)
    request_counts = np.array([len(np.unique(codes[by_runtime == i])) for i in range(len(names))])
    tested = np.flatnonzero(request_counts >= min_requests)
    if len(tested) < max(3, robust_min_runtimes):
        return []
    _, disagree = policy_outcomes(signals, matched, thresholds)
    level = alpha / (len(tested) * len(STATISTICS))
    found = []
    for index in tested:
        inside = by_runtime == index
        rest = ~inside & np.isin(by_runtime, tested)
        scope = inside | rest
        medians = np.nanmedian(signals[rest], axis=0)
        families = [("policy_disagreement", None, disagree[:, None]),
                    ("matched", layers, matched),
                    ("signal_above_median", layers,
                     np.nan_to_num(signals) > medians[None, :])]
        best = None
        for statistic, family_layers, events in families:
            rates, fleet, z, p, _ = clustered_difference(codes[scope], events[scope],
                                                         inside[scope])
            if p < level and (best is None or p < best.p_value):
                j = int(np.argmax(np.abs(z)))
                best = OutlierFinding(
                    runtime_id=str(names[index]), statistic=statistic,
                    layer=None if family_layers is None else int(family_layers[j]),
                    runtime_rate=float(rates[j]), fleet_rate=float(fleet[j]), z=float(z[j]),
                    p_value=p, level=level,
                    tokens=int(inside.sum()), requests=int(request_counts[index]),
                    fleet_tokens=int(rest.sum()),
                    fleet_requests=int(request_counts[tested].sum() - request_counts[index]),
                    fleet_runtimes=len(tested) - 1)
        if best is not None:
            found.append(best)
    found.sort(key=lambda finding: finding.p_value)
    return found[:(len(tested) - 1) // 2]


def detect_outliers(*, session: Session, deployment: Deployment, version: int,
                    thresholds_of: dict[str, list[float]], activated_at: datetime,
                    now: datetime, options: DriftOptions, min_requests: int,
                    robust_min_runtimes: int) -> list[RuntimeOutlier]:
    """Test each runtime against the rest on each segment's recent shadow tokens of `version`
    (`thresholds_of`: the thresholds each segment applies); set aside and alert on the
    outliers found. Returns the runtimes newly set aside."""
    since = max(now - timedelta(seconds=options.recent_s), activated_at)
    layers = sorted(deployment.exit_layers)
    alpha = (options.quality_alpha_per_hour * options.check_interval_s / 3600.0
             / max(1, len(thresholds_of)))
    newly = []
    for segment, thresholds in thresholds_of.items():
        found = shadow_evidence(
            session=session, deployment=deployment, since=since, version=version,
            segment=segment, limit=options.max_shadow_tokens,
            exclude=excluded_runtime_ids(session=session, deployment_id=deployment.id))
        for finding in runtime_outliers(
                requests=found.requests, runtimes=found.runtimes, signals=found.signals,
                matched=found.matched, thresholds=thresholds, layers=layers, alpha=alpha,
                min_requests=min_requests, robust_min_runtimes=robust_min_runtimes):
            evidence = finding.__dict__ | {"version": version, "segment": segment,
                                           "window": {"since": since.isoformat(),
                                                      "until": now.isoformat()}}
            where = "" if segment == DEFAULT_SEGMENT else f"segment {segment}: "
            alert, _ = fire(session=session, deployment=deployment, now=now,
                            condition=Condition(
                                kind=AlertKind.RUNTIME_OUTLIER, severity="warning",
                                subject=finding.runtime_id, segment=segment,
                                summary=where + finding.summary(), evidence=evidence))
            record, created = set_aside(
                session=session, deployment=deployment, runtime_id=finding.runtime_id,
                version=version, segment=segment, summary=finding.summary(),
                evidence=evidence, alert_id=alert.id, now=now)
            if created:
                alert.action_taken = (f"runtime {finding.runtime_id} set aside: its shadow "
                                      "tokens no longer feed calibration, drift or canary "
                                      "verdicts until an operator clears it")
                newly.append(record)
    session.flush()
    return newly
