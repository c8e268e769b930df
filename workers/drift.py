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

Tokens are clustered by request (issue 17; the statistics are in `workers.stats.clustered`):
the quality test runs on the window's shadow tokens grouped by their request id; each exit
layer's design effect is measured on the same shadow tokens under the active policy and widens
that layer's exit-rate test (rollups carry no per-request counts, so the design effect travels
to them; without enough shadow requests to measure it, `default_design_effect` applies); the
distribution test sees only as many rows as the effective sample size. Every read is filtered to
the active version, so a window is never compared with one of another version, and tokens whose
exits were not checked carry no signal and are not in the histograms.

Distribution drift alone is an `info` finding with its Evidently report (no page); a second,
`warning` finding (subject "escalated") joins it when an exit-rate or quality condition fires in
the same check, or when the info finding persisted over `distribution_persist_windows`
consecutive recent windows. Each exit-rate spike carries the window's clustered shadow
disagreement (`quality_gate`), from which the fallback decides (`controlplane.calibration.
fallback`).
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

from controlplane.alerts.service import Condition, Reconciled, open_alerts, reconcile
from controlplane.db import utcnow
from controlplane.runtimes.models import Runtime
from controlplane.telemetry.models import HISTOGRAM_BINS
from controlplane.telemetry.service import (
    exit_rates,
    shadow_samples_by_request,
    signal_histogram,
)
from controlplane.thresholds.models import Alias, Deployment
from controlplane.thresholds.service import aliases_of, get_threshold_set
from workers.stats.clustered import (
    ClusteredProportion,
    clustered_rate,
    effective_rows,
    layer_design_effects,
    per_cluster,
    policy_outcomes,
    scale_design_effect,
    weighted_cluster_size,
)
from workers.stats.drift import (
    DISTRIBUTION_DRIFT,
    DISTRIBUTION_DRIFT_ESCALATED,
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
    # issue 17: clustered statistics, distribution drift that informs, the fallback's gate
    min_shadow_requests: int = 10  # fewer requests: the design effect is not measured
    default_design_effect: float = 1.0
    max_design_effect: float = 200.0
    quality_alpha: float = 1e-3
    gate_alpha: float = 0.05  # the quality gate's upper bound is a (1 - gate_alpha) bound
    distribution_persist_windows: int = 3
    distribution_p_value: float = 1e-3

    @classmethod
    def from_settings(cls, settings) -> DriftOptions:
        return cls(lookback_s=settings.drift_lookback_s, recent_s=settings.drift_recent_s,
                   clear_after_s=settings.alert_clear_after_s,
                   default_design_effect=settings.drift_default_design_effect,
                   gate_alpha=settings.fallback_gate_alpha,
                   distribution_persist_windows=settings.drift_distribution_persist_windows,
                   distribution_p_value=settings.drift_distribution_p_value)


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


@dataclass(frozen=True)
class ShadowWindow:
    """The shadow tokens of one window under the active policy, clustered by request."""

    disagreement: ClusteredProportion
    design_effect: dict[int, float]  # per exit layer, for the served (rollup) tokens
    measured: dict[int, dict]  # per exit layer where it was measured: the clustered exit rate

    def gate(self, *, delta: float, alpha: float, window: dict) -> dict:
        """What the fallback decides from: the clustered upper bound of the disagreement."""
        d = self.disagreement
        return {"shadow_tokens": d.tokens, "requests": d.clusters,
                "disagreements": d.events, "disagreement_rate": d.rate,
                "design_effect": d.design_effect, "effective_tokens": d.effective_tokens,
                "upper_bound": d.upper_bound(alpha) if d.tokens else 1.0,
                "confidence": 1.0 - alpha, "delta": delta, "window": window}


def shadow_window(*, session: Session, deployment: Deployment, version: int,
                  thresholds: list[float], since: datetime, until: datetime | None,
                  served_tokens: int, options: DriftOptions) -> ShadowWindow:
    """Clustered disagreement and per-layer design effects of `version` over a window.

    `served_tokens`: tokens that reached the first exit layer in the window (from the rollups),
    to carry the design effect from shadow-sized requests to served-sized ones."""
    requests, signals, matched = shadow_samples_by_request(
        session=session, deployment=deployment, since=since, until=until, version=version)
    layers = sorted(deployment.exit_layers)
    slot, disagree = policy_outcomes(signals, matched, thresholds)
    quality = clustered_rate(requests, disagree)
    measured = layer_design_effects(requests, slot, layers,
                                    min_clusters=options.min_shadow_requests)
    measured = {k: v for k, v in measured.items() if 0 < v.events < v.tokens}
    sizes, _ = per_cluster(requests, disagree) if requests else (np.zeros(0), None)
    shadow_size = weighted_cluster_size(sizes)
    share = len(requests) / served_tokens if served_tokens else 1.0
    effects = {}
    for layer in layers:
        found = measured.get(layer)
        if found is None:
            effects[layer] = options.default_design_effect
            continue
        served = scale_design_effect(found.design_effect, mean_cluster_size=shadow_size,
                                     target_cluster_size=shadow_size / min(max(share, 1e-6), 1))
        effects[layer] = min(served, options.max_design_effect)
    return ShadowWindow(quality, effects,
                        {k: v.to_dict() for k, v in measured.items()})


def exit_behaviour_conditions(*, session: Session, deployment: Deployment, now: datetime,
                              options: DriftOptions, want_report: bool = True
                              ) -> tuple[list[Condition], set[str]]:
    """Conditions observed now and the kinds that had enough data to be checked."""
    active = active_version(session=session, deployment=deployment)
    layers = sorted(deployment.exit_layers)
    start = active.activated_at.replace(second=0, microsecond=0)
    conditions: list[Condition] = []
    checked: set[str] = set()
    threshold_set = get_threshold_set(session=session, deployment=deployment,
                                      version=active.version)
    thresholds = [threshold_set.thresholds_by_layer()[k] for k in layers]

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
    recent_since = max(now - timedelta(seconds=options.recent_s), start)
    recent_window = {"since": recent_since.isoformat(), "until": now.isoformat(),
                     "version": active.version}
    served = sum(c[layers[0]].tokens for minute, c in windows
                 if layers[0] in c and minute >= recent_since.replace(second=0))
    shadow = shadow_window(session=session, deployment=deployment, version=active.version,
                           thresholds=thresholds, since=recent_since, until=None,
                           served_tokens=served, options=options)
    if reference is not None and windows:
        checked.update(EXIT_KINDS)
        window = {"since": since.isoformat(), "until": now.isoformat(),
                  "version": active.version, "reference": reference_origin,
                  "reference_until": reference_until.isoformat()}
        for finding in detect_exit_rate_drift(reference=reference,
                                              windows=[c for _, c in windows],
                                              design_effect=shadow.design_effect):
            condition = _exit_rate_condition(finding)
            condition.evidence["window"] = window
            condition.evidence["design_effect_measured"] = shadow.measured
            if finding.kind == EXIT_RATE_SPIKE:
                condition.evidence["quality_gate"] = shadow.gate(
                    delta=deployment.delta, alpha=options.gate_alpha, window=recent_window)
            conditions.append(condition)

    quality = shadow.disagreement
    if quality.tokens >= options.min_shadow_tokens:
        checked.add(QUALITY_REGRESSION)
        finding = check_shadow_disagreement(disagreement=quality, delta=deployment.delta,
                                            alpha=options.quality_alpha, window=recent_window)
        if finding is not None:
            conditions.append(Condition(
                kind=QUALITY_REGRESSION, severity=finding.severity, evidence=finding.to_dict(),
                summary=(f"disagreement with full depth {quality.events}/{quality.tokens} = "
                         f"{quality.rate:.2%} exceeds δ={deployment.delta:g} over "
                         f"{quality.clusters} requests (design effect "
                         f"{quality.design_effect:.1f}; p={finding.p_value:.2g})")))

    if found is not None:
        distribution = _distribution_condition(
            session=session, deployment=deployment, version=active.version,
            reference=(start, reference_until), recent_since=max(recent_since, reference_until),
            options=options, want_report=want_report,
            design_effect=max(shadow.design_effect.values(), default=1.0))
        if distribution is not None:
            checked.add(DISTRIBUTION_DRIFT)
            conditions += distribution
            if distribution:
                escalated = _escalation(session=session, deployment=deployment, now=now,
                                        info=distribution[0], others=conditions,
                                        options=options)
                if escalated is not None:
                    conditions.append(escalated)
    return conditions, checked


def _escalation(*, session: Session, deployment: Deployment, now: datetime, info: Condition,
                others: list[Condition], options: DriftOptions) -> Condition | None:
    """The `warning` twin of an info distribution finding, when a rule says it pages."""
    corroborating = [c for c in others if c.kind in (*EXIT_KINDS, QUALITY_REGRESSION)]
    rule = None
    if corroborating:
        names = ", ".join(f"{c.kind}" + (f" at layer {c.layer}" if c.layer is not None else "")
                          for c in corroborating)
        rule = {"rule": "corroborated", "by": [c.kind for c in corroborating],
                "text": f"corroborated by {names} in the same window"}
    else:
        key = info.dedup_key(deployment)
        open_info = next((a for a in open_alerts(session=session, deployment=deployment,
                                                 kinds=[DISTRIBUTION_DRIFT])
                          if a.dedup_key == key), None)
        needed = options.distribution_persist_windows
        if open_info is not None and open_info.clear_since is None:
            held = (now - open_info.fired_at).total_seconds()
            windows = 1 + int(held // options.recent_s)
            if windows >= needed:
                rule = {"rule": "persisted", "windows": windows,
                        "text": f"persisted over {windows} consecutive windows "
                                f"(limit {needed})"}
    if rule is None:
        return None
    return Condition(kind=DISTRIBUTION_DRIFT, severity=DISTRIBUTION_DRIFT_ESCALATED,
                     subject="escalated", summary=f"{info.summary}; {rule['text']}",
                     evidence=info.evidence | {"escalation": rule},
                     report_html=info.report_html)


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
                            options: DriftOptions, want_report: bool,
                            design_effect: float = 1.0) -> list[Condition] | None:
    """[distribution_drift info condition], [] when the distributions agree, None on too
    little data. Both sides are thinned to their effective sample size (tokens / design
    effect) and tested at `distribution_p_value`, so the verdict counts requests, not tokens."""
    from workers.stats.evidently_drift import distribution_drift_report

    before = signal_histogram(session=session, deployment=deployment, since=reference[0],
                              until=reference[1], version=version)
    after = signal_histogram(session=session, deployment=deployment, since=recent_since,
                             version=version)
    sizes = [sum(sum(b) for b in h.values()) for h in (before, after)]
    if min(sizes) < options.min_distribution_rows:
        return None
    rows = [min(20_000, effective_rows(n, design_effect)) for n in sizes]
    p_value = options.distribution_p_value
    report = distribution_drift_report(
        reference=_histogram_frame(before, rows[0]), current=_histogram_frame(after, rows[1]),
        methods={"signal": "ks", "exit_layer": "chisquare"},
        thresholds={"signal": p_value, "exit_layer": p_value}, include_html=want_report)
    finding = report.to_finding()
    if finding is None:
        return []
    drifted = ", ".join(f"{c.column} ({c.method} {c.statistic:.3g} < {c.threshold:g})"
                        for c in report.columns if c.drift_detected)
    return [Condition(kind=DISTRIBUTION_DRIFT, severity=SEVERITY[DISTRIBUTION_DRIFT],
                     summary=f"distribution drift in {drifted} vs the reference window",
                     evidence=finding.to_dict() | {
                         "reference_window": [reference[0].isoformat(),
                                              reference[1].isoformat()],
                         "recent_since": recent_since.isoformat(), "version": version,
                         "tokens": {"reference": sizes[0], "recent": sizes[1]},
                         "design_effect": design_effect},
                     report_html=report.html)]


def check_deployment(*, session: Session, deployment: Deployment, options: DriftOptions,
                     reports_dir: Path | None, now: datetime | None = None) -> Reconciled:
    """One drift-detection cycle for a deployment: observe, then fire / refresh / resolve."""
    now = now or utcnow()
    # Evidently's HTML is costly: render it only while an open distribution alert lacks one.
    reported = [a for a in open_alerts(session=session, deployment=deployment,
                                       kinds=[DISTRIBUTION_DRIFT]) if a.report_path]
    conditions, checked = exit_behaviour_conditions(
        session=session, deployment=deployment, now=now, options=options,
        want_report=reports_dir is not None and len(reported) < 2)
    return reconcile(session=session, deployment=deployment, conditions=conditions,
                     checked_kinds=checked, clear_after_s=options.clear_after_s, now=now,
                     reports_dir=reports_dir)


def stale_runtime_conditions(*, session: Session, deployment: Deployment, now: datetime,
                             stale_after_s: float, forget_after_s: float = 86400.0
                             ) -> list[Condition]:
    """Runtimes silent for `stale_after_s`, or still applying a version other than the active
    (or canary) one `stale_after_s` after the alias moved. Runtimes silent for longer than
    `forget_after_s` are considered decommissioned."""
    aliases = aliases_of(session=session, deployment=deployment)
    current = {aliases["active"], aliases.get("canary")} - {None}
    active = active_version(session=session, deployment=deployment)
    settled = (now - active.activated_at).total_seconds() >= stale_after_s
    conditions = []
    for runtime in session.scalars(select(Runtime).where(
            Runtime.deployment_id == deployment.id).order_by(Runtime.runtime_id)):
        silent = (now - runtime.last_seen).total_seconds()
        evidence = {"runtime_id": runtime.runtime_id, "last_seen": runtime.last_seen,
                    "silent_s": silent, "applied_version": runtime.applied_version,
                    "active_version": aliases["active"], "stale_after_s": stale_after_s}
        if silent > forget_after_s:
            continue
        if silent > stale_after_s:
            summary = (f"runtime {runtime.runtime_id} sent no heartbeat for {silent:.0f} s "
                       f"(limit {stale_after_s:g} s)")
        elif settled and runtime.applied_version not in current:
            summary = (f"runtime {runtime.runtime_id} still applies version "
                       f"{runtime.applied_version}; active is {aliases['active']}")
        else:
            continue
        conditions.append(Condition(kind=RUNTIME_STALE, severity="warning", summary=summary,
                                    subject=runtime.runtime_id, evidence=evidence))
    return conditions


def check_runtimes(*, session: Session, deployment: Deployment, stale_after_s: float,
                   clear_after_s: float, now: datetime | None = None) -> Reconciled:
    now = now or utcnow()
    conditions = stale_runtime_conditions(session=session, deployment=deployment, now=now,
                                          stale_after_s=stale_after_s)
    return reconcile(session=session, deployment=deployment, conditions=conditions,
                     checked_kinds=[RUNTIME_STALE], clear_after_s=clear_after_s, now=now)
