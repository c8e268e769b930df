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

Each comparison is a request-clustered two-proportion z-test: under H0 both sides share the
pooled rate p, and each side's variance is p(1-p) n d / n^2 with d its design effect read at p
(`stats.clustered.null_design_effect`: a request counts as the evidence its clustering is worth,
and a runtime that shows no variation at all is not thereby certain). The tests share the drift
false-alarm budget: each check spends `quality_alpha_per_hour x check_interval_s / 3600`, split
(Bonferroni) over the segments, runtimes and statistics tested. A runtime is tested once it and
the rest have `outlier_min_requests` requests each, and only in a fleet of at least
`robust_min_runtimes` (with two there is no majority to tell which one is off). At most a
minority of the fleet is set aside per check, the most significant first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta

import numpy as np
from scipy.stats import norm
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
        at = f" at layer {self.layer}" if self.layer is not None else ""
        return (f"runtime {self.runtime_id}: {what}{at} {self.runtime_rate:.1%} on "
                f"{self.tokens} shadow tokens ({self.requests} requests) vs {self.fleet_rate:.1%} "
                f"on the other {self.fleet_runtimes} runtimes' {self.fleet_tokens} (z "
                f"{self.z:+.1f}, p={self.p_value:.2g} < {self.level:.2g}); its samples are set "
                f"aside until an operator clears it")


def clustered_two_proportion(codes: np.ndarray, events: np.ndarray, inside: np.ndarray
                             ) -> tuple[float, float, float, float]:
    """(rate inside, rate outside, z, two-sided p) of 0/1 `events` over tokens clustered by
    request `codes`, testing inside vs outside (module docstring)."""
    events = np.asarray(events, dtype=float)
    sides = []
    for mask in (inside, ~inside):
        dense = np.unique(codes[mask], return_inverse=True)[1]
        sides.append((np.bincount(dense).astype(float),
                      np.bincount(dense, weights=events[mask])))
    (n_in, x_in), (n_out, x_out) = sides
    total_in, total_out = n_in.sum(), n_out.sum()
    rate_in, rate_out = x_in.sum() / total_in, x_out.sum() / total_out
    pooled = (x_in.sum() + x_out.sum()) / (total_in + total_out)
    if pooled <= 0.0 or pooled >= 1.0:
        return rate_in, rate_out, 0.0, 1.0
    variance = pooled * (1.0 - pooled) * sum(
        float(null_design_effect(n, x, pooled)[0]) / n.sum() for n, x in sides)
    z = (rate_in - rate_out) / math.sqrt(variance)
    return float(rate_in), float(rate_out), float(z), float(2.0 * norm.sf(abs(z)))


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
    statistics = 2 * len(layers) + 1
    level = alpha / (len(tested) * statistics)
    found = []
    for index in tested:
        inside = by_runtime == index
        rest = ~inside & np.isin(by_runtime, tested)
        scope = inside | rest
        checks = [("policy_disagreement", None, disagree)]
        for j, layer in enumerate(layers):
            median = float(np.nanmedian(signals[rest, j]))
            checks += [("matched", layer, matched[:, j]),
                       ("signal_above_median", layer, np.nan_to_num(signals[:, j]) > median)]
        best = None
        for statistic, layer, events in checks:
            rate, fleet, z, p = clustered_two_proportion(codes[scope], events[scope],
                                                         inside[scope])
            if p < level and (best is None or p < best.p_value):
                best = OutlierFinding(
                    runtime_id=str(names[index]), statistic=statistic, layer=layer,
                    runtime_rate=rate, fleet_rate=fleet, z=z, p_value=p, level=level,
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
