"""Drift detection on a deployment's exit behaviour: rollups in, alert conditions out.

Each check reads the rollups of the version the `active` alias points at and compares them with
that version's reference — the calibration's expected conditional exit rates when the threshold
set carries them (`expected_metrics`), else the first window after activation in which every exit
layer saw `reference_tokens` tokens:

- exit rate per layer: the per-minute rollups of the lookback replayed through ADWIN with a
  confirming two-proportion test, Holm-corrected across layers (`workers.stats.drift`);
- shadow disagreement of the recent window vs the deployment's δ (one-sided binomial test);
- signal and exit-layer distributions of the recent window vs the reference window (Evidently);
- runtimes whose heartbeat stopped or that still apply another version (`runtime_stale`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.alerts.service import (
    Condition,
    Reconciled,
    jsonable,
    open_alerts,
    reconcile,
)
from controlplane.db import utcnow
from controlplane.runtimes.models import Runtime
from controlplane.telemetry.models import HISTOGRAM_BINS
from controlplane.telemetry.service import disagreement, exit_rates, signal_histogram
from controlplane.thresholds.models import Alias, Deployment
from controlplane.thresholds.service import aliases_of, get_threshold_set
from workers.stats.drift import (
    DISTRIBUTION_DRIFT,
    EXIT_RATE_COLLAPSE,
    EXIT_RATE_SPIKE,
    QUALITY_REGRESSION,
    SEVERITY,
    DriftFinding,
    LayerCounts,
    LayerReference,
    check_shadow_disagreement,
    conditional_exit_rates,
    detect_exit_rate_drift,
)

EXIT_KINDS = (EXIT_RATE_COLLAPSE, EXIT_RATE_SPIKE)
RUNTIME_STALE = "runtime_stale"


@dataclass(frozen=True)
class DriftOptions:
    """Windows and sample sizes of one check (seconds and tokens)."""

    lookback_s: float = 1800.0
    recent_s: float = 600.0
    reference_tokens: int = 2000
    reference_max_s: float = 3600.0
    min_shadow_tokens: int = 100
    min_distribution_rows: int = 500
    clear_after_s: float = 300.0

    @classmethod
    def from_settings(cls, settings) -> DriftOptions:
        return cls(lookback_s=settings.drift_lookback_s, recent_s=settings.drift_recent_s,
                   clear_after_s=settings.alert_clear_after_s)


@dataclass(frozen=True)
class ActiveVersion:
    version: int
    activated_at: datetime
    expected_metrics: dict


def active_version(*, session: Session, deployment: Deployment) -> ActiveVersion:
    version = aliases_of(session=session, deployment=deployment)["active"]
    moved_at = session.scalar(select(Alias.updated_at).where(
        Alias.deployment_id == deployment.id, Alias.name == "active"))
    threshold_set = get_threshold_set(session=session, deployment=deployment, version=version)
    return ActiveVersion(version, moved_at, threshold_set.expected_metrics or {})


def expected_reference(expected_metrics: Mapping, exit_layers: list[int]
                       ) -> dict[int, LayerReference] | None:
    """Known conditional exit rates from a calibration's expected metrics, when they cover
    every exit layer: `conditional_exit_rate` {layer: rate} (what `calibration.run` stores),
    `layers` [{layer, conditional_exit_rate}], or `exit_rate` {layer: share of all tokens}."""
    def by_layer(key: str) -> dict[int, float] | None:
        found = expected_metrics.get(key)
        return {int(k): float(v) for k, v in found.items()} if isinstance(found, Mapping) \
            else None

    rates = by_layer("conditional_exit_rate") or by_layer("conditional_exit_rates")
    if rates is None and isinstance(expected_metrics.get("layers"), list):
        rates = {int(item["layer"]): float(item["conditional_exit_rate"])
                 for item in expected_metrics["layers"] if "conditional_exit_rate" in item}
    if rates is None:
        shares = by_layer("exit_rate") or by_layer("exit_rates")
        rates = conditional_exit_rates(shares) if shares else None
    if not rates or not set(exit_layers) <= set(rates):
        return None
    return {layer: LayerReference(min(max(rates[layer], 0.0), 1.0)) for layer in exit_layers}


def _minute_windows(points: list[dict], exit_layers: list[int]
                    ) -> list[tuple[datetime, dict[int, LayerCounts]]]:
    by_minute: dict[datetime, dict[int, LayerCounts]] = defaultdict(dict)
    for point in points:
        if point["layer"] in exit_layers:
            by_minute[point["minute"]][point["layer"]] = LayerCounts(point["tokens"],
                                                                     point["exits"])
    return sorted(by_minute.items())


def _reference_window(windows, exit_layers: list[int], tokens: int):
    """The first minutes whose summed tokens reach `tokens` at every exit layer, or None."""
    reached = dict.fromkeys(exit_layers, 0)
    exits = dict.fromkeys(exit_layers, 0)
    for index, (_minute, counts) in enumerate(windows):
        for layer, c in counts.items():
            reached[layer] += c.tokens
            exits[layer] += c.exits
        if all(reached[layer] >= tokens for layer in exit_layers):
            reference = {layer: LayerReference.from_counts(LayerCounts(reached[layer],
                                                                       exits[layer]))
                         for layer in exit_layers}
            return reference, index + 1
    return None


def _exit_rate_condition(finding: DriftFinding) -> Condition:
    evidence = finding.to_dict()
    before = evidence["evidence"]["reference"]["rate"]
    after = evidence["evidence"]["recent"]["rate"]
    verb = "rose" if finding.kind == EXIT_RATE_SPIKE else "fell"
    summary = (f"exit rate at layer {finding.layer} {verb} from {before:.1%} to {after:.1%} "
               f"({finding.test}, adjusted p={finding.adjusted_p_value:.2g})")
    return Condition(kind=finding.kind, severity=finding.severity, summary=summary,
                     subject=str(finding.layer), layer=finding.layer, evidence=evidence)


def exit_behaviour_conditions(*, session: Session, deployment: Deployment, now: datetime,
                              options: DriftOptions, want_report: bool = True
                              ) -> tuple[list[Condition], set[str]]:
    """Conditions observed now and the kinds that had enough data to be checked."""
    active = active_version(session=session, deployment=deployment)
    layers = sorted(deployment.exit_layers)
    start = active.activated_at.replace(second=0, microsecond=0)
    conditions: list[Condition] = []
    checked: set[str] = set()

    reference = expected_reference(active.expected_metrics, layers)
    reference_until = start
    reference_origin = "expected_metrics"
    first = _minute_windows(exit_rates(
        session=session, deployment=deployment, since=start, version=active.version,
        until=start + timedelta(seconds=options.reference_max_s)), layers)
    found = _reference_window(first, layers, options.reference_tokens)
    if found is not None:
        reference_until = first[found[1] - 1][0] + timedelta(minutes=1)
    if reference is None and found is not None:
        reference, reference_origin = found[0], "first_window_after_activation"

    # A learned reference's own window is not tested against itself; a known one is.
    monitored_from = start if reference_origin == "expected_metrics" else reference_until
    since = max(monitored_from, now - timedelta(seconds=options.lookback_s))
    windows = _minute_windows(exit_rates(session=session, deployment=deployment, since=since,
                                         version=active.version), layers)
    if reference is not None and windows:
        checked.update(EXIT_KINDS)
        window = {"since": since.isoformat(), "until": now.isoformat(),
                  "version": active.version, "reference": reference_origin,
                  "reference_until": reference_until.isoformat()}
        for finding in detect_exit_rate_drift(reference=reference,
                                              windows=[c for _, c in windows]):
            condition = _exit_rate_condition(finding)
            condition.evidence["window"] = window
            conditions.append(condition)

    recent_since = now - timedelta(seconds=options.recent_s)
    quality = disagreement(session=session, deployment=deployment, since=recent_since,
                           version=active.version)
    shadow_tokens = sum(p["shadow_tokens"] for p in quality)
    mismatches = sum(p["mismatches"] for p in quality)
    if shadow_tokens >= options.min_shadow_tokens:
        checked.add(QUALITY_REGRESSION)
        finding = check_shadow_disagreement(
            disagreements=mismatches, shadow_tokens=shadow_tokens, delta=deployment.delta,
            window={"since": recent_since.isoformat(), "until": now.isoformat(),
                    "version": active.version})
        if finding is not None:
            conditions.append(Condition(
                kind=QUALITY_REGRESSION, severity=finding.severity, evidence=finding.to_dict(),
                summary=(f"disagreement with full depth {mismatches}/{shadow_tokens} = "
                         f"{mismatches / shadow_tokens:.2%} exceeds δ={deployment.delta:g} "
                         f"(one-sided binomial p={finding.p_value:.2g})")))

    if found is not None:
        distribution = _distribution_condition(
            session=session, deployment=deployment, version=active.version,
            reference=(start, reference_until), recent_since=max(recent_since, reference_until),
            options=options, want_report=want_report)
        if distribution is not None:
            checked.add(DISTRIBUTION_DRIFT)
            conditions += distribution
    return conditions, checked


def _histogram_frame(histogram: dict[int, list[int]], max_rows: int) -> dict[str, np.ndarray]:
    from workers.stats.evidently_drift import histogram_samples

    edges = np.linspace(0.0, 1.0, HISTOGRAM_BINS + 1)
    total = sum(sum(bins) for bins in histogram.values()) or 1
    signals, layers = [], []
    for layer, bins in histogram.items():
        samples = histogram_samples(edges, bins, max_rows=max(1, max_rows * sum(bins) // total))
        signals.append(samples)
        layers.append(np.full(len(samples), layer))
    if not signals:
        return {"signal": np.zeros(0), "exit_layer": np.zeros(0, dtype=int)}
    return {"signal": np.concatenate(signals), "exit_layer": np.concatenate(layers)}


def _distribution_condition(*, session: Session, deployment: Deployment, version: int,
                            reference: tuple[datetime, datetime], recent_since: datetime,
                            options: DriftOptions, want_report: bool) -> list[Condition] | None:
    """[distribution_drift condition], [] when the distributions agree, None on too little data."""
    from workers.stats.evidently_drift import distribution_drift_report

    before = signal_histogram(session=session, deployment=deployment, since=reference[0],
                              until=reference[1], version=version)
    after = signal_histogram(session=session, deployment=deployment, since=recent_since,
                             version=version)
    sizes = [sum(sum(b) for b in h.values()) for h in (before, after)]
    if min(sizes) < options.min_distribution_rows:
        return None
    report = distribution_drift_report(reference=_histogram_frame(before, 20_000),
                                       current=_histogram_frame(after, 20_000),
                                       include_html=want_report)
    finding = report.to_finding()
    if finding is None:
        return []
    drifted = ", ".join(f"{c.column} ({c.method} {c.statistic:.3g} > {c.threshold:g})"
                        for c in report.columns if c.drift_detected)
    return [Condition(kind=DISTRIBUTION_DRIFT, severity=SEVERITY[DISTRIBUTION_DRIFT],
                     summary=f"distribution drift in {drifted} vs the reference window",
                     evidence=finding.to_dict() | {
                         "reference_window": [reference[0].isoformat(),
                                              reference[1].isoformat()],
                         "recent_since": recent_since.isoformat(), "version": version},
                     report_html=report.html)]


def check_deployment(*, session: Session, deployment: Deployment, options: DriftOptions,
                     reports_dir: Path | None, now: datetime | None = None) -> Reconciled:
    """One drift-detection cycle for a deployment: observe, then fire / refresh / resolve."""
    now = now or utcnow()
    has_report = any(a.report_path for a in open_alerts(
        session=session, deployment=deployment, kinds=[DISTRIBUTION_DRIFT]))
    conditions, checked = exit_behaviour_conditions(
        session=session, deployment=deployment, now=now, options=options,
        want_report=not has_report and reports_dir is not None)
    return reconcile(session=session, deployment=deployment, conditions=conditions,
                     checked_kinds=checked, clear_after_s=options.clear_after_s, now=now,
                     reports_dir=reports_dir)


STALE_NAMED = 20  # runtimes named in a runtime_stale summary; the evidence lists up to 200
STALE_LISTED = 200


def stale_runtime_conditions(*, session: Session, deployment: Deployment, now: datetime,
                             stale_after_s: float, forget_after_s: float = 86400.0
                             ) -> list[Condition]:
    """At most one condition per deployment, listing its runtimes silent for `stale_after_s`
    or still applying a version other than the active (or canary) one `stale_after_s` after
    the alias moved: a thousand silent runtimes page once, not a thousand times. Runtimes
    silent for longer than `forget_after_s` are considered decommissioned."""
    aliases = aliases_of(session=session, deployment=deployment)
    current = {aliases["active"], aliases.get("canary")} - {None}
    active = active_version(session=session, deployment=deployment)
    settled = (now - active.activated_at).total_seconds() >= stale_after_s
    stale = []
    for runtime in session.scalars(select(Runtime).where(
            Runtime.deployment_id == deployment.id).order_by(Runtime.runtime_id)):
        silent = (now - runtime.last_seen).total_seconds()
        if silent > forget_after_s:
            continue
        if silent > stale_after_s:
            reason = f"no heartbeat for {silent:.0f} s (limit {stale_after_s:g} s)"
        elif settled and runtime.applied_version not in current:
            reason = (f"still applies version {runtime.applied_version}; "
                      f"active is {aliases['active']}")
        else:
            continue
        stale.append({"runtime_id": runtime.runtime_id, "reason": reason,
                      "last_seen": runtime.last_seen, "silent_s": silent,
                      "applied_version": runtime.applied_version})
    if not stale:
        return []
    named = "; ".join(f"{entry['runtime_id']}: {entry['reason']}"
                      for entry in stale[:STALE_NAMED])
    more = f"; and {len(stale) - STALE_NAMED} more" if len(stale) > STALE_NAMED else ""
    noun = "runtime is" if len(stale) == 1 else "runtimes are"
    summary = f"{len(stale)} {noun} stale: {named}{more}"
    evidence = {"stale_runtimes": len(stale), "runtimes": stale[:STALE_LISTED],
                "active_version": aliases["active"], "stale_after_s": stale_after_s}
    return [Condition(kind=RUNTIME_STALE, severity="warning", summary=summary,
                      subject="all", evidence=evidence)]


def check_runtimes(*, session: Session, deployment: Deployment, stale_after_s: float,
                   clear_after_s: float, now: datetime | None = None) -> Reconciled:
    now = now or utcnow()
    conditions = stale_runtime_conditions(session=session, deployment=deployment, now=now,
                                          stale_after_s=stale_after_s)
    result = reconcile(session=session, deployment=deployment, conditions=conditions,
                       checked_kinds=[RUNTIME_STALE], clear_after_s=clear_after_s, now=now)
    for alert in result.refreshed:  # the open alert says which runtimes are stale now
        alert.summary = conditions[0].summary
        alert.evidence = jsonable(conditions[0].evidence)
    session.flush()
    return result
