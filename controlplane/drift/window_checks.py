"""One drift-detection cycle on in-memory windows of one version: conditions out.

`controlplane.drift.service` reads the windows from the store (rollups, signal histograms,
shadow samples with request ids) and reconciles the alerts; `bench/drift_real.py` builds the
same windows from replayed records. Both run `evaluate`, so the benchmark measures the
detectors the service runs. The quality test looks at several sliding windows at every check,
all looks of an hour sharing one false-alarm budget (Bonferroni), and a check covering k
segments tests each at 1/k of every level (`evaluate_segments`). Why a union bound, and what
it guarantees: docs/concepts/statistics.md, "Drift detection in detail".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

import numpy as np

from controlplane.alerts.service import Condition
from controlplane.drift.detectors import (
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
    detect_exit_rate_drift,
)
from controlplane.stats.clustered import (
    ClusteredProportion,
    cluster_codes,
    clustered_rate,
    effective_rows,
    layer_design_effects,
    mean_design_effect,
    per_cluster,
    scale_design_effect,
    weighted_cluster_size,
)
from controlplane.stats.exits import policy_outcomes
from controlplane.stats.robust_evidence import leave_one_out
from controlplane.telemetry.models import HISTOGRAM_BINS
from exitplane.wire import DEFAULT_SEGMENT

EXIT_KINDS = (EXIT_RATE_COLLAPSE, EXIT_RATE_SPIKE)
Minutes = list[tuple[datetime, dict[int, LayerCounts]]]


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
    # Clustered statistics, distribution drift that informs, the fallback's gate
    min_shadow_requests: int = 10  # fewer requests: the design effect is not measured
    default_design_effect: float = 1.0
    max_design_effect: float = 200.0
    gate_alpha: float = 0.05  # the quality gate's upper bound is a (1 - gate_alpha) bound
    distribution_persist_windows: int = 3
    distribution_p_value: float = 1e-3
    min_expected_exits: float = 10.0  # before a confirming exit-rate test on fresh tokens
    # sliding quality windows and the hourly false-alarm budget their looks share (docstring)
    quality_windows_s: tuple[float, ...] = (60.0, 180.0, 600.0)
    quality_alpha_per_hour: float = 1e-2
    check_interval_s: float = 30.0
    exit_rate_alpha: float = 1e-4  # family-wise over the exit layers (Holm)
    # A tumbling exit-rate window also closes after this many minutes of
    # rollups (`ExitRateMonitor.window_rollups`), so thin traffic gets its window test in time
    exit_rate_window_min: int = 5
    # How many traffic segments this check covers; every level below is split by it
    segments_checked: int = 1
    # The newest shadow tokens a check reads per segment (fleet rates pass it)
    max_shadow_tokens: int = 100_000
    # robust evidence: from this many runtimes on, a quality regression, an exit-rate spike or
    # collapse (and a spike's fallback) must hold without any one runtime's evidence; outliers
    # are tested once a runtime and the rest have this many requests
    # (`controlplane.drift.outliers`)
    robust_min_runtimes: int = 3
    outlier_min_requests: int = 5

    @property
    def quality_look_alpha(self) -> float:
        """The level each window of each check of each segment is tested at."""
        looks_per_hour = (3600.0 / self.check_interval_s * len(self.quality_windows_s)
                          * self.segments_checked)
        return self.quality_alpha_per_hour / looks_per_hour

    @property
    def exit_rate_level(self) -> float:
        """The exit-rate tests' family-wise level for one segment."""
        return self.exit_rate_alpha / self.segments_checked

    @property
    def distribution_level(self) -> float:
        """The distribution test's p-value threshold for one segment."""
        return self.distribution_p_value / self.segments_checked

    def for_segments(self, count: int) -> DriftOptions:
        """These options for a check that covers `count` segments (module docstring)."""
        return replace(self, segments_checked=max(1, count))

    @classmethod
    def from_settings(cls, settings) -> DriftOptions:
        return cls(lookback_s=settings.drift_lookback_s, recent_s=settings.drift_recent_s,
                   clear_after_s=settings.alert_clear_after_s,
                   default_design_effect=settings.drift_default_design_effect,
                   gate_alpha=settings.fallback_gate_alpha,
                   distribution_persist_windows=settings.drift_distribution_persist_windows,
                   distribution_p_value=settings.drift_distribution_p_value,
                   quality_windows_s=tuple(settings.drift_quality_windows_s),
                   quality_alpha_per_hour=settings.drift_quality_alpha_per_hour,
                   check_interval_s=settings.drift_interval_s,
                   max_shadow_tokens=settings.drift_max_shadow_tokens,
                   exit_rate_window_min=settings.drift_exit_rate_window_min,
                   robust_min_runtimes=settings.evidence_robust_min_runtimes,
                   outlier_min_requests=settings.outlier_min_requests)


@dataclass
class WindowInputs:
    """Everything one check of one version looks at; every window is of `version` only."""

    version: int
    layers: list[int]
    thresholds: list[float]  # the version's, in exit-layer order
    delta: float
    now: datetime
    reference: dict[int, LayerReference] | None
    reference_origin: str
    reference_window: tuple[datetime, datetime] | None  # learned from these minutes, if any
    since: datetime  # start of the exit-rate lookback
    minutes: Minutes  # per-minute counts from `since`, oldest first
    recent_since: datetime
    shadow_requests: Sequence[str]  # the recent window's shadow tokens: request ids,
    shadow_signals: np.ndarray  # (n, L) signals and
    shadow_matched: np.ndarray  # (n, L) matches with full depth
    shadow_times: np.ndarray | None = None  # (n,) epoch seconds: the quality sub-windows
    # the read stopped at `max_shadow_tokens`: the windows begin at the oldest token read
    shadow_capped: bool = False
    histograms: tuple[dict[int, list[int]], dict[int, list[int]]] | None = None  # ref, recent
    info_open: tuple[datetime, datetime | None] | None = None  # open info alert: fired, clear
    extra: dict = field(default_factory=dict)
    shadow_runtimes: np.ndarray | None = None  # (n,) the runtime of each shadow token
    # Per reporting runtime, the exit-rate reference and minutes without its rollups (read
    # only when an exit-rate finding needs confirming; [] below `robust_min_runtimes`)
    exit_windows_without_each_runtime: (
        Callable[[], list[tuple[dict[int, LayerReference], Minutes]]] | None) = None


@dataclass(frozen=True)
class ShadowWindow:
    """The shadow tokens of one window under the active policy, clustered by request."""

    disagreement: ClusteredProportion
    design_effect: dict[int, float]  # per exit layer, for the served (rollup) tokens
    measured: dict[int, dict]  # per exit layer where it was measured: the clustered exit rate
    signal_design_effect: float = 1.0  # of the recorded signal, for the served tokens

    def gate(self, *, delta: float, alpha: float, window: dict) -> dict:
        """What the fallback decides from: the clustered upper bound of the disagreement."""
        d = self.disagreement
        return {"shadow_tokens": d.tokens, "requests": d.clusters,
                "disagreements": d.events, "disagreement_rate": d.rate,
                "design_effect": d.design_effect, "effective_tokens": d.effective_tokens,
                "upper_bound": d.upper_bound(alpha) if d.tokens else 1.0,
                "confidence": 1.0 - alpha, "delta": delta, "window": window}


def reference_window(minutes: Minutes, layers: list[int], tokens: int
                     ) -> tuple[dict[int, LayerReference], int] | None:
    """The first minutes whose summed tokens reach `tokens` at every exit layer: (reference,
    how many minutes), or None."""
    reached = dict.fromkeys(layers, 0)
    exits = dict.fromkeys(layers, 0)
    for index, (_minute, counts) in enumerate(minutes):
        for layer, c in counts.items():
            reached[layer] += c.tokens
            exits[layer] += c.exits
        if all(reached[layer] >= tokens for layer in layers):
            reference = {layer: LayerReference.from_counts(LayerCounts(reached[layer],
                                                                       exits[layer]))
                         for layer in layers}
            return reference, index + 1
    return None


def shadow_window(*, requests: Sequence[str], signals: np.ndarray, matched: np.ndarray,
                  thresholds: list[float], layers: list[int], served_tokens: int,
                  options: DriftOptions) -> ShadowWindow:
    """Clustered disagreement and per-layer design effects of a window's shadow tokens.

    `served_tokens`: tokens that reached the first exit layer in the window (rollups), to carry
    the design effect from shadow-sized requests to served-sized ones."""
    requests = cluster_codes(requests)  # once for every statistic below
    slot, disagree = policy_outcomes(signals, matched, thresholds)
    quality = clustered_rate(requests, disagree)
    measured = layer_design_effects(requests, slot, layers,
                                    min_clusters=options.min_shadow_requests)
    # a layer where no shadow token (or every one) exits shows nothing about clustering
    measured = {k: v for k, v in measured.items() if 0 < v.events < v.tokens}
    shadow_size = weighted_cluster_size(per_cluster(requests, disagree)[0]) if len(requests) \
        else 0.0
    share = min(max(len(requests) / served_tokens if served_tokens else 1.0, 1e-6), 1.0)
    effects = {layer: min(scale_design_effect(found.design_effect, mean_cluster_size=shadow_size,
                                              target_cluster_size=shadow_size / share),
                          options.max_design_effect)
               for layer, found in measured.items()}
    # Clustering is a property of the traffic more than of a layer: a layer too rarely reached
    # (or exited) to measure its own borrows the largest measured one.
    fallback = max(effects.values(), default=options.default_design_effect)
    effects = {layer: effects.get(layer, fallback) for layer in layers}
    # The recorded signal (at the exit, else at the deepest layer the policy checks) is far more
    # alike within a request than a rare exit is: the histogram test gets its own design effect.
    live = [j for j, t in enumerate(thresholds) if t < 1.0] or [len(layers) - 1]
    column = np.where(slot < len(layers), slot, live[-1])
    recorded = signals[np.arange(len(slot)), column] if len(slot) else np.zeros(0)
    signal_effect, groups = mean_design_effect(requests, recorded)
    if groups >= options.min_shadow_requests:
        signal_effect = min(scale_design_effect(signal_effect, mean_cluster_size=shadow_size,
                                                target_cluster_size=shadow_size / share),
                            options.max_design_effect)
    else:
        signal_effect = fallback
    return ShadowWindow(quality, effects, {k: v.to_dict() for k, v in measured.items()},
                        signal_effect)


def _exit_rate_condition(finding: DriftFinding) -> Condition:
    evidence = finding.to_dict()
    before = evidence["evidence"]["reference"]["rate"]
    after = evidence["evidence"]["recent"]["rate"]
    verb = "rose" if finding.kind == EXIT_RATE_SPIKE else "fell"
    summary = (f"exit rate at layer {finding.layer} {verb} from {before:.1%} to {after:.1%} "
               f"({finding.test}, adjusted p={finding.adjusted_p_value:.2g}, design effect "
               f"{evidence['evidence']['design_effect']:.1f})")
    return Condition(kind=finding.kind, severity=finding.severity, summary=summary,
                     subject=str(finding.layer), layer=finding.layer, evidence=evidence)


def evaluate(inputs: WindowInputs, options: DriftOptions, *, want_report: bool = False
             ) -> tuple[list[Condition], set[str]]:
    """Conditions observed now and the kinds that had enough data to be checked."""
    layers, conditions, checked = inputs.layers, [], set()
    recent_window = {"since": inputs.recent_since.isoformat(), "until": inputs.now.isoformat(),
                     "version": inputs.version}
    first_minute = inputs.recent_since.replace(second=0, microsecond=0)
    served = sum(c[layers[0]].tokens for minute, c in inputs.minutes
                 if layers[0] in c and minute >= first_minute)
    shadow = shadow_window(requests=inputs.shadow_requests, signals=inputs.shadow_signals,
                           matched=inputs.shadow_matched, thresholds=inputs.thresholds,
                           layers=layers, served_tokens=served, options=options)
    if inputs.reference is not None and inputs.minutes:
        checked.update(EXIT_KINDS)
        window = {"since": inputs.since.isoformat(), "until": inputs.now.isoformat(),
                  "version": inputs.version, "reference": inputs.reference_origin}
        if inputs.reference_window is not None:
            window["reference_until"] = inputs.reference_window[1].isoformat()
        monitor = {"design_effect": shadow.design_effect,
                   "min_expected_events": options.min_expected_exits,
                   "alpha": options.exit_rate_level,
                   "window_rollups": options.exit_rate_window_min}
        findings = detect_exit_rate_drift(reference=inputs.reference,
                                          windows=[c for _, c in inputs.minutes], **monitor)
        findings, runtimes = robust_exit_findings(findings, inputs, monitor)
        for finding in findings:
            condition = _exit_rate_condition(finding)
            if runtimes:
                condition.evidence["runtimes"] = runtimes
            condition.evidence["window"] = window
            condition.evidence["design_effect_measured"] = shadow.measured
            if finding.kind == EXIT_RATE_SPIKE:
                condition.evidence["quality_gate"] = _robust_gate(
                    inputs, options, shadow.gate(delta=inputs.delta, alpha=options.gate_alpha,
                                                 window=recent_window))
            conditions.append(condition)

    if shadow.disagreement.tokens >= options.min_shadow_tokens:
        checked.add(QUALITY_REGRESSION)
        found = quality_condition(inputs, options)
        if found is not None:
            conditions.append(found)

    if inputs.histograms is not None and inputs.reference_window is not None:
        distribution = distribution_condition(
            inputs, options, want_report=want_report,
            design_effect=max(shadow.signal_design_effect,
                              *shadow.design_effect.values()))
        if distribution is not None:
            checked.add(DISTRIBUTION_DRIFT)
            conditions += distribution
            escalated = distribution and escalation(inputs, options, info=distribution[0],
                                                    others=conditions)
            if escalated:
                conditions.append(escalated)
    return conditions, checked


def robust_exit_findings(findings: list[DriftFinding], inputs: WindowInputs, monitor: dict
                         ) -> tuple[list[DriftFinding], int]:
    """The exit-rate findings that also show without each one runtime's rollups (the same kind
    at the same layer, against the reference learned without it where it is learned), and how
    many runtimes were left out in turn (0: fewer than `robust_min_runtimes` report): as for the
    quality test, no single runtime's exit behaviour raises a spike (and its fallback) or a
    collapse alone."""
    if not findings or inputs.exit_windows_without_each_runtime is None:
        return findings, 0
    subsets = inputs.exit_windows_without_each_runtime()
    if not subsets:
        return findings, 0
    kept = {(finding.kind, finding.layer) for finding in findings}
    for reference, minutes in subsets:
        found = detect_exit_rate_drift(reference=reference, windows=[c for _, c in minutes],
                                       **monitor)
        kept &= {(finding.kind, finding.layer) for finding in found}
        if not kept:
            break
    return [f for f in findings if (f.kind, f.layer) in kept], len(subsets)


def _robust_gate(inputs: WindowInputs, options: DriftOptions, gate: dict) -> dict:
    """A spike's quality gate whose upper bound is the smallest over the window without each
    one runtime's tokens: a fallback needs every such subset to leave δ in doubt, so one
    runtime's forged disagreement cannot set it off."""
    if inputs.shadow_runtimes is None:
        return gate
    masks = leave_one_out(inputs.shadow_runtimes, options.robust_min_runtimes)
    if not masks:
        return gate
    requests = cluster_codes(inputs.shadow_requests)
    _, disagree = policy_outcomes(inputs.shadow_signals, inputs.shadow_matched,
                                  inputs.thresholds)
    bounds = [clustered_rate(requests[mask], disagree[mask]).upper_bound(options.gate_alpha)
              for mask in masks]
    return gate | {"upper_bound": min(gate["upper_bound"], *bounds),
                   "upper_bound_all_runtimes": gate["upper_bound"],
                   "runtimes": len(masks)}


def evaluate_segments(inputs: Mapping[str, WindowInputs], options: DriftOptions, *,
                      want_report: bool = False
                      ) -> dict[str, tuple[list[Condition], set[str]]]:
    """`evaluate` for each traffic segment's windows, every segment at 1/k of the false-alarm
    budget (k = the segments checked, module docstring); each condition names its segment and
    a non-default one says so in its summary."""
    split = options.for_segments(len(inputs))
    out = {}
    for segment, windows in inputs.items():
        conditions, checked = evaluate(windows, split, want_report=want_report)
        out[segment] = ([c if segment == DEFAULT_SEGMENT else replace(
            c, segment=segment, summary=f"segment {segment}: {c.summary}",
            evidence=c.evidence | {"segment": segment}) for c in conditions], checked)
    return out


def quality_windows(inputs: WindowInputs, options: DriftOptions
                    ) -> list[tuple[float, ClusteredProportion]]:
    """(seconds, clustered disagreement) of each sliding quality window, shortest first; only
    the whole recent window when the shadow tokens carry no times."""
    return [(seconds, rates[0]) for seconds, rates in _window_rates(inputs, options)]


def _window_rates(inputs: WindowInputs, options: DriftOptions
                  ) -> list[tuple[float, list[ClusteredProportion]]]:
    """Per sliding quality window: its clustered disagreement, then the same without each one
    runtime's tokens when the window holds `robust_min_runtimes` runtimes or more
    (`stats.robust_evidence.leave_one_out`)."""
    requests = cluster_codes(inputs.shadow_requests)
    _, disagree = policy_outcomes(inputs.shadow_signals, inputs.shadow_matched,
                                  inputs.thresholds)
    everything = np.ones(len(disagree), dtype=bool)
    if inputs.shadow_times is None:
        picks = [(options.recent_s, everything)]
    else:
        now = inputs.now.timestamp()
        picks = [(seconds, inputs.shadow_times >= now - seconds) for seconds in
                 sorted(min(w, options.recent_s) for w in set(options.quality_windows_s))]
    out = []
    for seconds, pick in picks:
        rates = [clustered_rate(requests[pick], disagree[pick])]
        if inputs.shadow_runtimes is not None:
            for mask in leave_one_out(inputs.shadow_runtimes[pick],
                                      options.robust_min_runtimes):
                rates.append(clustered_rate(requests[pick][mask], disagree[pick][mask]))
        out.append((seconds, rates))
    return out


def quality_condition(inputs: WindowInputs, options: DriftOptions) -> Condition | None:
    """A quality_regression when any sliding window's request-clustered disagreement is
    significantly above δ at the per-look level (module docstring); the most significant one."""
    alpha = options.quality_look_alpha
    best = None
    for seconds, (quality, *without_one) in _window_rates(inputs, options):
        if quality.tokens < options.min_shadow_tokens:
            continue
        # No single runtime decides: the regression must show without each one's tokens too.
        if any(check_shadow_disagreement(disagreement=rest, delta=inputs.delta, alpha=alpha,
                                         window={}) is None for rest in without_one):
            continue
        since = max(inputs.recent_since, inputs.now - timedelta(seconds=seconds))
        window = {"since": since.isoformat(), "until": inputs.now.isoformat(),
                  "version": inputs.version, "seconds": seconds}
        if inputs.shadow_capped and inputs.shadow_times is not None:
            read_from = datetime.fromtimestamp(float(inputs.shadow_times[0]), tz=UTC)
            if since.tzinfo is None:  # SQLite's naive UTC
                read_from = read_from.replace(tzinfo=None)
            if read_from > since:  # the window holds its newest max_shadow_tokens only
                window |= {"since": read_from.isoformat(),
                           "capped_at_tokens": options.max_shadow_tokens}
        finding = check_shadow_disagreement(disagreement=quality, delta=inputs.delta,
                                            alpha=alpha, window=window)
        if finding is not None and (best is None or finding.p_value < best[0].p_value):
            best = (finding, quality, seconds)
    if best is None:
        return None
    finding, quality, seconds = best
    evidence = finding.to_dict()
    looks = {"windows_s": list(options.quality_windows_s),
             "alpha_per_hour": options.quality_alpha_per_hour,
             "check_interval_s": options.check_interval_s, "alpha_per_look": alpha}
    if options.segments_checked > 1:
        looks["segments_checked"] = options.segments_checked
    evidence["evidence"] |= {"looks": looks}
    return Condition(
        kind=QUALITY_REGRESSION, severity=finding.severity, evidence=evidence,
        summary=(f"disagreement with full depth {quality.events}/{quality.tokens} = "
                 f"{quality.rate:.2%} exceeds δ={inputs.delta:g} over the last {seconds:g} s, "
                 f"{quality.clusters} requests (design effect {quality.design_effect:.1f}; "
                 f"p={finding.p_value:.2g} < {alpha:.2g} per look)"))


def escalation(inputs: WindowInputs, options: DriftOptions, *, info: Condition,
               others: list[Condition]) -> Condition | None:
    """The `warning` twin of an info distribution finding, when a rule says it pages:
    corroborated by an exit-rate or quality condition of the same check, or persisted over
    `distribution_persist_windows` consecutive recent windows (the info alert stayed open and
    never cleared since it fired)."""
    corroborating = [c for c in others if c.kind in (*EXIT_KINDS, QUALITY_REGRESSION)]
    rule = None
    if corroborating:
        names = ", ".join(c.kind + (f" at layer {c.layer}" if c.layer is not None else "")
                          for c in corroborating)
        rule = {"rule": "corroborated", "by": [c.kind for c in corroborating],
                "text": f"corroborated by {names} in the same window"}
    elif inputs.info_open is not None and inputs.info_open[1] is None:
        held = (inputs.now - inputs.info_open[0]).total_seconds()
        windows = 1 + int(held // options.recent_s)
        if windows >= options.distribution_persist_windows:
            rule = {"rule": "persisted", "windows": windows,
                    "text": f"persisted over {windows} consecutive windows "
                            f"(limit {options.distribution_persist_windows})"}
    if rule is None:
        return None
    return Condition(kind=DISTRIBUTION_DRIFT, severity=DISTRIBUTION_DRIFT_ESCALATED,
                     subject="escalated", summary=f"{info.summary}; {rule['text']}",
                     evidence=info.evidence | {"escalation": rule},
                     report_html=info.report_html)


def _histogram_frame(histogram: dict[int, list[int]], max_rows: int) -> dict[str, np.ndarray]:
    from controlplane.drift.evidently_drift import histogram_samples

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


def distribution_condition(inputs: WindowInputs, options: DriftOptions, *, want_report: bool,
                           design_effect: float = 1.0) -> list[Condition] | None:
    """[distribution_drift info condition], [] when the distributions agree, None on too
    little data. Both sides are thinned to their effective sample size (tokens / design
    effect) and tested at `distribution_p_value`, so the verdict counts requests, not tokens."""
    from controlplane.drift.evidently_drift import distribution_drift_report

    before, after = inputs.histograms
    sizes = [sum(sum(b) for b in h.values()) for h in (before, after)]
    if min(sizes) < options.min_distribution_rows:
        return None
    rows = [min(20_000, effective_rows(n, design_effect)) for n in sizes]
    p_value = options.distribution_level
    report = distribution_drift_report(
        reference=_histogram_frame(before, rows[0]), current=_histogram_frame(after, rows[1]),
        methods={"signal": "ks", "exit_layer": "chisquare"},
        thresholds={"signal": p_value, "exit_layer": p_value}, include_html=want_report,
        two_sample_thresholds={"signal": p_value, "exit_layer": p_value})
    finding = report.to_finding()
    if finding is None:
        return []
    drifted = ", ".join(f"{c.column} ({c.p_value_test} p={c.p_value:.3g} < {p_value:g})"
                        for c in report.columns if c.drift_detected)
    reference = inputs.reference_window
    return [Condition(kind=DISTRIBUTION_DRIFT, severity=SEVERITY[DISTRIBUTION_DRIFT],
                     summary=f"distribution drift in {drifted} vs the reference window",
                     evidence=finding.to_dict() | {
                         "reference_window": [reference[0].isoformat(),
                                              reference[1].isoformat()],
                         "recent_since": max(inputs.recent_since, reference[1]).isoformat(),
                         "version": inputs.version,
                         "tokens": {"reference": sizes[0], "recent": sizes[1]},
                         "design_effect": design_effect},
                     report_html=report.html)]


def minutes_between(minutes: Minutes, since: datetime, until: datetime | None = None) -> Minutes:
    """The minutes in [since, until)."""
    return [(m, c) for m, c in minutes if m >= since and (until is None or m < until)]


def lookback_start(*, start: datetime, reference_origin: str, reference_until: datetime,
                   now: datetime, options: DriftOptions) -> datetime:
    """A learned reference's own window is not tested against itself; a known one is."""
    monitored_from = start if reference_origin == "expected_metrics" else reference_until
    return max(monitored_from, now - timedelta(seconds=options.lookback_s))
