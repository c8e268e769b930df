"""Drift detection on a deployment's exit behaviour: rollups in, alert conditions out.

Each check reads the rollups of the version the `active` alias points at and compares them with
that version's reference — the calibration's expected conditional exit rates when the threshold
set carries them (`expected_metrics`), else the first window after activation in which every exit
layer saw `reference_tokens` tokens:

- exit rate per layer: the per-minute rollups of the lookback replayed through ADWIN with a
  confirming two-proportion test, Holm-corrected across layers (`controlplane.drift.detectors`);
  from `robust_min_runtimes` reporting runtimes on, a spike or collapse must also show without
  each one runtime's rollups (`window_checks.robust_exit_findings`);
- shadow disagreement of sliding windows of the recent shadow tokens vs the deployment's δ
  (one-sided binomial test; the looks share an hourly false-alarm budget, see
  `controlplane.drift.window_checks`);
- signal and exit-layer distributions of the recent window vs the reference window (Evidently);
- runtimes whose heartbeat stopped or that still apply another version (`runtime_stale`);
- with an answer target, whole answers on the recent shadow requests vs δ_answer
  (`answer_regression`, `controlplane.drift.answers`).

Tokens are clustered by request (`controlplane.stats.clustered`): each exit layer's design
effect, measured on the window's shadow tokens, widens that layer's exit-rate test
(`default_design_effect` without enough shadow requests), and the distribution test sees only
as many rows as the effective sample size. Every read is filtered to the active version, so a
window is never compared with one of another version.

Distribution drift alone is an `info` finding with its Evidently report (no page); a second,
`warning` finding (subject "escalated") joins it when an exit-rate or quality condition fires in
the same check, or when the info finding persisted over `distribution_persist_windows`
consecutive recent windows. Each exit-rate spike carries the window's clustered shadow
disagreement (`quality_gate`), from which the fallback decides (`controlplane.flows.
fallback`, through the rechecks registered in `controlplane.alerts.reactions`).

Traffic segments: every check covers 'default' and each segment the deployment
knows that has traffic of the active version in the window (`segments_to_check`); each segment
is tested on its own rows with the thresholds it applies (its own map, else the set's), against
its own reference (the calibration's expected metrics under `segments`, else its first window),
and the segments split the false-alarm budget (`window_checks.evaluate_segments`). Alerts name
their segment; a 'default' alert reads as a deployment without segments has it. The statistics
in detail: docs/concepts/statistics.md, "Drift detection in detail".
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

import numpy as np
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controlplane.alerts import reactions
from controlplane.alerts.kinds import AlertKind
from controlplane.alerts.service import Condition, Reconciled, jsonable, open_alerts, reconcile
from controlplane.db import utcnow
from controlplane.deployments.models import Alias, Deployment
from controlplane.deployments.segment_sets import thresholds_for
from controlplane.deployments.segments import known_segments
from controlplane.deployments.service import aliases_of, get_threshold_set
from controlplane.drift.answers import watch_answers
from controlplane.drift.detectors import (
    DISTRIBUTION_DRIFT,
    LayerCounts,
    LayerReference,
    conditional_exit_rates,
)
from controlplane.drift.outliers import detect_outliers
from controlplane.drift.window_checks import (
    EXIT_KINDS,
    DriftOptions,
    Minutes,
    WindowInputs,
    evaluate_segments,
    lookback_start,
    reference_window,
)
from controlplane.runtimes.models import Runtime
from controlplane.runtimes.outliers import excluded_runtime_ids
from controlplane.runtimes.service import runtime_witnesses
from controlplane.runtimes.witnesses import witness_of as runtime_witness
from controlplane.telemetry.models import Rollup, ShadowSampleRow
from controlplane.telemetry.service import exit_rates, shadow_evidence, signal_histogram
from exitplane.wire import DEFAULT_SEGMENT

# DriftOptions lives with evaluate
__all__ = ["EXIT_KINDS", "DriftOptions", "check_deployment", "check_runtimes",
           "conditions_by_segment", "exit_behaviour_conditions", "expected_reference",
           "segments_to_check"]

RUNTIME_STALE = AlertKind.RUNTIME_STALE


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
    # A calibration's rates are estimates from its test split, not constants: with the split's
    # size they are tested as a sample (tokens reaching each layer), else as known rates.
    samples = expected_metrics.get("samples")
    tested = samples.get("test") if isinstance(samples, Mapping) else None
    reference, reaching = {}, float(tested) if tested else None
    for layer in exit_layers:
        rate = min(max(rates[layer], 0.0), 1.0)
        tokens = max(1, round(reaching)) if reaching is not None else None
        reference[layer] = LayerReference(rate, tokens)
        if reaching is not None:
            reaching *= 1.0 - rate
    return reference


def _minute_windows(points: list[dict], exit_layers: list[int]
                    ) -> list[tuple[datetime, dict[int, LayerCounts]]]:
    """Per minute, the policy's conditional exit counts per exit layer.

    Shadow tokens run to full depth, so the rollups count them as reaching every layer and
    exiting nowhere; read that way a shadow rate of 0.3 lowers every exit rate by 30% against
    a calibration's expected rates. The policy's own exits of those tokens (`policy_exits`) put
    them back where the policy would have let them out."""
    by_minute: dict[datetime, dict[int, dict]] = defaultdict(dict)
    for point in points:
        if point["layer"] in exit_layers:
            by_minute[point["minute"]][point["layer"]] = point
    out = []
    for minute, layers in sorted(by_minute.items()):
        counts, left_earlier = {}, 0
        for layer in sorted(layers):
            point = layers[layer]
            policy_exits = point.get("policy_exits", 0)
            reached = point["tokens"] - left_earlier
            exits = point["exits"] + policy_exits
            if reached > 0:
                counts[layer] = LayerCounts(reached, min(exits, reached))
            left_earlier += policy_exits
        out.append((minute, counts))
    return out


def segments_to_check(*, session: Session, deployment: Deployment, version: int,
                      since: datetime) -> list[str]:
    """'default' and, sorted, each segment the deployment knows that has traffic of `version`
    (rollups or shadow tokens) since `since`: what one drift check covers."""
    known = set(known_segments(session=session, deployment_id=deployment.id))
    if not known:
        return [DEFAULT_SEGMENT]
    counted = set(session.scalars(select(Rollup.segment).where(
        Rollup.deployment_id == deployment.id, Rollup.version == version,
        Rollup.minute >= since.replace(second=0, microsecond=0)).distinct()))
    shadowed = set(session.scalars(select(ShadowSampleRow.segment).where(
        ShadowSampleRow.deployment_id == deployment.id,
        ShadowSampleRow.threshold_version == version, ShadowSampleRow.ts >= since).distinct()))
    return [DEFAULT_SEGMENT, *sorted(((counted | shadowed) & known) - {DEFAULT_SEGMENT})]


def segment_reference_metrics(expected_metrics: Mapping, segment: str) -> Mapping:
    """The calibration's expected metrics for `segment`: the set's own for 'default', a
    segment's under `segments` when the calibration stored them, else none (the segment's
    reference is then learned from its first window after activation)."""
    if segment == DEFAULT_SEGMENT:
        return expected_metrics
    found = (expected_metrics.get("segments") or {}).get(segment)
    return found if isinstance(found, Mapping) else {}


def segment_window_inputs(*, session: Session, deployment: Deployment, now: datetime,
                          options: DriftOptions, segment: str = DEFAULT_SEGMENT
                          ) -> WindowInputs:
    """The windows of the active version on one traffic segment's rows, read from the store,
    with the thresholds that segment applies."""
    active = active_version(session=session, deployment=deployment)
    layers = sorted(deployment.exit_layers)
    version = active.version
    start = active.activated_at.replace(second=0, microsecond=0)
    threshold_set = get_threshold_set(session=session, deployment=deployment, version=version)
    by_layer = thresholds_for(threshold_set, segment)
    thresholds = [by_layer[k] for k in layers]
    # Runtimes set aside as outliers or serving other heads are stored and shown, never judged.
    exclude = excluded_runtime_ids(session=session, deployment_id=deployment.id)
    rows = {"session": session, "deployment": deployment, "version": version,
            "segment": segment, "exclude": exclude}

    reference = expected_reference(segment_reference_metrics(active.expected_metrics, segment),
                                   layers)
    reference_until, reference_origin = start, "expected_metrics"
    first = _minute_windows(exit_rates(
        since=start, until=start + timedelta(seconds=options.reference_max_s), **rows), layers)
    found = reference_window(first, layers, options.reference_tokens)
    if found is not None:
        reference_until = first[found[1] - 1][0] + timedelta(minutes=1)
    if reference is None and found is not None:
        reference, reference_origin = found[0], "first_window_after_activation"
    since = lookback_start(start=start, reference_origin=reference_origin,
                           reference_until=reference_until, now=now, options=options)
    minutes = _minute_windows(exit_rates(since=since, **rows), layers)

    def without_each_runtime() -> list[tuple[dict[int, LayerReference], Minutes]]:
        return _exit_windows_without_each_runtime(
            session=session, deployment=deployment, version=version, segment=segment,
            exclude=exclude, start=start, since=since, layers=layers, options=options,
            reference=reference, learned=reference_origin != "expected_metrics")
    recent_since = max(now - timedelta(seconds=options.recent_s), start)
    shadow = shadow_evidence(since=recent_since, limit=options.max_shadow_tokens,
                             with_times=True, **rows)
    requests, signals, matched, times = (shadow.keyed_requests(), shadow.signals,
                                         shadow.matched, shadow.times)
    histograms = info_open = None
    if found is not None:
        histograms = (
            signal_histogram(since=start, until=reference_until, **rows),
            signal_histogram(since=max(recent_since, reference_until), **rows))
        key = Condition(kind=DISTRIBUTION_DRIFT, severity="info", summary="",
                        segment=segment).dedup_key(deployment)
        info = next((a for a in open_alerts(session=session, deployment=deployment,
                                            kinds=[DISTRIBUTION_DRIFT])
                     if a.dedup_key == key), None)
        info_open = (info.fired_at, info.clear_since) if info is not None else None
    return WindowInputs(
        version=version, layers=layers, thresholds=thresholds, delta=deployment.delta, now=now,
        reference=reference, reference_origin=reference_origin,
        reference_window=(start, reference_until) if found is not None else None,
        since=since, minutes=minutes, recent_since=recent_since, shadow_requests=requests,
        shadow_signals=signals, shadow_matched=matched, shadow_times=times,
        shadow_capped=len(requests) >= options.max_shadow_tokens, histograms=histograms,
        info_open=info_open, shadow_runtimes=np.asarray(shadow.witnesses, dtype=str),
        exit_windows_without_each_runtime=without_each_runtime)


def _exit_windows_without_each_runtime(
        *, session: Session, deployment: Deployment, version: int, segment: str,
        exclude: set[str], start: datetime, since: datetime, layers: list[int],
        options: DriftOptions, reference: dict[int, LayerReference] | None, learned: bool
) -> list[tuple[dict[int, LayerReference], Minutes]]:
    """Per reporting witness (the credential whose runtimes reported: `runtimes.witnesses`),
    the exit-rate reference and per-minute windows of the version without its runtimes'
    rollups (a learned reference learned again without them); none when fewer than
    `robust_min_runtimes` witnesses report (`window_checks.robust_exit_findings`)."""
    witness_of = runtime_witnesses(session=session, deployment_id=deployment.id)
    query = (select(Rollup.runtime_id, Rollup.minute, Rollup.layer,
                    func.sum(Rollup.tokens).label("tokens"),
                    func.sum(Rollup.exits).label("exits"),
                    func.sum(Rollup.policy_exits).label("policy_exits"))
             .where(Rollup.deployment_id == deployment.id, Rollup.version == version,
                    Rollup.segment == segment, Rollup.layer.in_(layers),
                    Rollup.minute >= min(start, since.replace(second=0, microsecond=0)))
             .group_by(Rollup.runtime_id, Rollup.minute, Rollup.layer))
    if exclude:
        query = query.where(Rollup.runtime_id.not_in(sorted(exclude)))
    by_runtime: dict[str, dict[tuple[datetime, int], np.ndarray]] = defaultdict(dict)
    for row in session.execute(query):
        points = by_runtime[witness_of.get(row.runtime_id) or runtime_witness(
            token_id=None, runtime_id=row.runtime_id)]
        points[(row.minute, row.layer)] = points.get((row.minute, row.layer), 0) + np.array(
            [int(row.tokens), int(row.exits), int(row.policy_exits)])
    if len(by_runtime) < max(2, options.robust_min_runtimes):
        return []
    total: dict[tuple[datetime, int], np.ndarray] = defaultdict(lambda: np.zeros(3, int))
    for points in by_runtime.values():
        for key, values in points.items():
            total[key] = total[key] + values
    out = []
    for points in by_runtime.values():
        rest = [{"minute": minute, "layer": layer, "tokens": int(values[0]),
                 "exits": int(values[1]), "policy_exits": int(values[2])}
                for (minute, layer), values in sorted(
                    ((key, total[key] - points.get(key, 0)) for key in total),
                    key=lambda item: (item[0][0], item[0][1]))]
        windows = _minute_windows(rest, layers)
        own = reference
        if learned:
            first = [(m, c) for m, c in windows
                     if m < start + timedelta(seconds=options.reference_max_s)]
            found = reference_window(first, layers, options.reference_tokens)
            if found is not None:
                own = found[0]
        if own is None:
            continue
        out.append((own, [(m, c) for m, c in windows if m >= since]))
    return out


def exit_behaviour_conditions(*, session: Session, deployment: Deployment, now: datetime,
                              options: DriftOptions, want_report: bool = True
                              ) -> tuple[list[Condition], set[str]]:
    """Every segment's conditions observed now (each names its segment) and the kinds some
    segment had enough data to check (`conditions_by_segment`, merged)."""
    observed = conditions_by_segment(session=session, deployment=deployment, now=now,
                                     options=options, want_report=want_report)
    conditions = [c for found, _ in observed.values() for c in found]
    return conditions, set().union(*(checked for _, checked in observed.values()))


def conditions_by_segment(*, session: Session, deployment: Deployment, now: datetime,
                          options: DriftOptions, want_report: bool = True
                          ) -> dict[str, tuple[list[Condition], set[str]]]:
    """Per traffic segment checked ('default' first): the conditions observed now and the
    kinds that had enough data to be checked; the windows of the active version read from the
    store, then `window_checks.evaluate_segments` (the segments share the false-alarm
    budget)."""
    active = active_version(session=session, deployment=deployment)
    since = max(now - timedelta(seconds=max(options.lookback_s, options.recent_s)),
                active.activated_at)
    segments = segments_to_check(session=session, deployment=deployment,
                                 version=active.version, since=since)
    inputs = {segment: segment_window_inputs(session=session, deployment=deployment, now=now,
                                             options=options, segment=segment)
              for segment in segments}
    observed = evaluate_segments(inputs, options, want_report=want_report)
    return watch_answers(session=session, deployment=deployment, observed=observed,
                         thresholds={name: w.thresholds for name, w in inputs.items()},
                         version=active.version, activated_at=active.activated_at, now=now,
                         options=options)


def check_deployment(*, session: Session, deployment: Deployment, options: DriftOptions,
                     keep_reports: bool = False, now: datetime | None = None) -> Reconciled:
    """One drift-detection cycle for a deployment: observe each traffic segment, then fire /
    refresh / resolve that segment's alerts. Outlier runtimes are looked for first, so that a
    runtime set aside now no longer weighs on this cycle's verdicts."""
    now = now or utcnow()
    find_outliers(session=session, deployment=deployment, now=now, options=options)
    # Evidently's HTML is costly: render it only while an open distribution alert lacks one.
    reported = [a for a in open_alerts(session=session, deployment=deployment,
                                       kinds=[DISTRIBUTION_DRIFT]) if a.has_report]
    observed = conditions_by_segment(
        session=session, deployment=deployment, now=now, options=options,
        want_report=keep_reports and len(reported) < 2)
    result = Reconciled()
    for segment, (conditions, checked) in observed.items():
        found = reconcile(session=session, deployment=deployment, conditions=conditions,
                          checked_kinds=checked, clear_after_s=options.clear_after_s, now=now,
                          keep_reports=keep_reports, segment=segment)
        result.fired += found.fired
        result.refreshed += found.refreshed
        result.resolved += found.resolved
        # A spike that kept the set is re-judged on each window's shadow evidence while it
        # lasts (the fallback registers that recheck).
        gates = {c.dedup_key(deployment): c.evidence["quality_gate"] for c in conditions
                 if "quality_gate" in c.evidence}
        for alert in found.refreshed:
            if alert.dedup_key in gates:
                reactions.recheck(session=session, alert=alert,
                                  quality_gate=gates[alert.dedup_key])
    return result


def find_outliers(*, session: Session, deployment: Deployment, now: datetime,
                  options: DriftOptions) -> list:
    """Test each runtime against the rest of the fleet on every checked segment's recent shadow
    tokens of the active version; set aside the outliers (`controlplane.drift.outliers`)."""
    active = active_version(session=session, deployment=deployment)
    since = max(now - timedelta(seconds=options.recent_s), active.activated_at)
    threshold_set = get_threshold_set(session=session, deployment=deployment,
                                      version=active.version)
    layers = sorted(deployment.exit_layers)
    thresholds_of = {}
    for segment in segments_to_check(session=session, deployment=deployment,
                                     version=active.version, since=since):
        by_layer = thresholds_for(threshold_set, segment)
        thresholds_of[segment] = [by_layer[k] for k in layers]
    return detect_outliers(session=session, deployment=deployment, version=active.version,
                           thresholds_of=thresholds_of, activated_at=active.activated_at,
                           now=now, options=options, min_requests=options.outlier_min_requests,
                           robust_min_runtimes=options.robust_min_runtimes)


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
