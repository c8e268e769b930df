"""What-if: any threshold set evaluated on a window's stored shadow evidence, under the trust
rules calibration obeys; and the one read of that evidence the live curve uses as well.

The evidence (`read_evidence`): shadow tokens of the window, segment and runtimes asked for,
without the runtimes the deployment takes no evidence from (outliers, other exit heads or model
revision: `runtimes.outliers.excluded_runtime_ids`) and the witnesses already set aside; the
witnesses the outlier screen would set aside on this window are left out as well (the screen
calibration runs, `drift.outliers.screen_witnesses`, here without acting on what it finds);
then no witness holds more than its share (`stats.robust_evidence.cap_runtime_share`, the
calibration's caps).

With shadow requests in the window, the answer consistency of the set as well
(`flows.answers`: identical answers, the bound on those that differ, where they diverge).

The set (`what_if`): a stored version (each segment's tokens with the map that segment applies
in it), a hand-edited {layer: threshold} set, or the set a calibration would choose on the
window at another δ or ε (run without publishing). The statistics: `calibration.what_if`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timedelta

import numpy as np
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controlplane.calibration.learn_then_test import (
    CalibrationResult,
    NotEnoughShadowData,
    calibrate_thresholds,
)
from controlplane.calibration.service import CalibrationPolicy
from controlplane.calibration.what_if import (
    InvalidThresholds,
    WhatIf,
    evaluate,
    validate_thresholds,
)
from controlplane.db import utcnow
from controlplane.deployments.models import Deployment
from controlplane.deployments.segment_sets import thresholds_for
from controlplane.deployments.segments import known_segments
from controlplane.deployments.service import get_threshold_set
from controlplane.drift.outliers import screen_witnesses
from controlplane.drift.window_checks import DriftOptions
from controlplane.errors import Invalid
from controlplane.flows.answers import answer_consistency, read_answers
from controlplane.runtimes.outliers import excluded_witnesses
from controlplane.settings import get_settings
from controlplane.stats.cost_model import CostModel
from controlplane.stats.robust_evidence import cap_runtime_share
from controlplane.telemetry.models import Rollup
from controlplane.telemetry.savings import savings
from controlplane.telemetry.service import shadow_evidence
from exitplane.wire import DEFAULT_SEGMENT

# A what-if window reaches back at most this far (the shadow store's horizon is the retention).
MAX_WINDOW = timedelta(days=30)


@dataclass(frozen=True)
class Evidence:
    """A window's shadow tokens after the trust rules, in exit-layer order."""

    signals: np.ndarray  # (n, L) float
    matched: np.ndarray  # (n, L) bool
    requests: np.ndarray  # (n,) request ids keyed by runtime (and segment)
    witnesses: np.ndarray  # (n,) the credential that posted each token
    segments: np.ndarray  # (n,) each token's segment
    since: datetime
    until: datetime
    set_aside: tuple[str, ...] = ()  # witnesses the outlier screen left out of this window

    def __len__(self) -> int:
        return len(self.signals)

    def kept(self, mask: np.ndarray) -> Evidence:
        return replace(self, signals=self.signals[mask], matched=self.matched[mask],
                       requests=self.requests[mask], witnesses=self.witnesses[mask],
                       segments=self.segments[mask])


def window_bounds(*, window_s: float | None, since: datetime | None, until: datetime | None,
                  now: datetime | None = None) -> tuple[datetime, datetime]:
    """(since, until) of a window given as its length back from now or as its two ends."""
    now = now or utcnow()
    until = until or now
    if since is None:
        since = until - timedelta(seconds=window_s or 3600.0)
    if until <= since:
        raise Invalid(f"the window is empty: until {until} is not after since {since}")
    if until - since > MAX_WINDOW:
        raise Invalid(f"the window spans {until - since}; ask for at most "
                      f"{MAX_WINDOW.days} days")
    return since, until


def read_evidence(*, session: Session, deployment: Deployment, since: datetime,
                  until: datetime, segment: str | None = None,
                  runtimes: list[str] | None = None,
                  policy: CalibrationPolicy | None = None, seed: int = 0) -> Evidence:
    """The window's shadow evidence under the trust rules (module docstring); `segment` None:
    every segment's tokens, each labelled with its segment; `runtimes`: those runtimes only."""
    settings = get_settings()
    policy = policy or CalibrationPolicy.from_settings(settings)
    names = [segment] if segment is not None else [
        DEFAULT_SEGMENT, *known_segments(session=session, deployment_id=deployment.id)]
    parts = []
    for name in dict.fromkeys(names):
        found = shadow_evidence(session=session, deployment=deployment, since=since,
                                until=until, segment=name)
        keep = np.ones(len(found.requests), dtype=bool)
        if runtimes:
            keep &= np.isin(np.asarray(found.runtimes, dtype=str), list(runtimes))
        parts.append((name, found, keep))
    width = len(deployment.exit_layers)
    evidence = Evidence(
        signals=np.concatenate([f.signals[k] for _, f, k in parts]
                               or [np.zeros((0, width))]).reshape(-1, width),
        matched=np.concatenate([f.matched[k] for _, f, k in parts]
                               or [np.zeros((0, width), bool)]).reshape(-1, width),
        requests=np.concatenate([np.char.add(f"{n}/", f.keyed_requests())[k]
                                 if len(f.requests) else np.zeros(0, str)
                                 for n, f, k in parts]).astype(str),
        witnesses=np.concatenate([np.asarray(f.witnesses, dtype=str)[k] if len(f.requests)
                                  else np.zeros(0, str) for _, f, k in parts]).astype(str),
        segments=np.concatenate([np.full(int(k.sum()), n, dtype=object)
                                 for n, _, k in parts]).astype(str),
        since=since, until=until)
    evidence = _screened(session=session, deployment=deployment, evidence=evidence,
                         settings=settings)
    if not len(evidence):
        return evidence
    keep = cap_runtime_share(evidence.witnesses, evidence.requests,
                             max_share=policy.evidence.max_runtime_share, seed=seed,
                             max_share_of_median=policy.evidence.max_share_of_median,
                             min_runtimes=policy.evidence.robust_min_runtimes)
    return evidence if keep.all() else evidence.kept(keep)


def _screened(*, session: Session, deployment: Deployment, evidence: Evidence,
              settings) -> Evidence:
    """`evidence` without the witnesses the outlier screen finds on it, segment by segment, at
    the level calibration screens its window (`flows.recalibration.screen_window`)."""
    if not len(evidence):
        return evidence
    options = DriftOptions.from_settings(settings)
    names = sorted(set(evidence.segments.tolist()))
    alpha = options.quality_alpha_per_hour * options.check_interval_s / 3600.0 / len(names)
    already = len(excluded_witnesses(session=session, deployment_id=deployment.id))
    set_aside: set[str] = set()
    for name in names:
        mine = evidence.segments == name
        keep = cap_runtime_share(evidence.witnesses[mine], evidence.requests[mine],
                                 max_share=1.0, max_share_of_median=1.0, seed=0,
                                 min_runtimes=settings.evidence_robust_min_runtimes)
        screen = screen_witnesses(
            requests=evidence.requests[mine][keep], runtimes=evidence.witnesses[mine][keep],
            signals=evidence.signals[mine][keep], matched=evidence.matched[mine][keep],
            thresholds=None, layers=sorted(deployment.exit_layers), alpha=alpha,
            min_requests=options.outlier_min_requests,
            robust_min_runtimes=settings.evidence_robust_min_runtimes,
            already_set_aside=already)
        set_aside |= {finding.runtime_id for finding in screen.findings}
    if not set_aside:
        return evidence
    out = evidence.kept(~np.isin(evidence.witnesses, sorted(set_aside)))
    return replace(out, set_aside=tuple(sorted(set_aside)))


def shadow_share(*, session: Session, deployment: Deployment, since: datetime,
                 until: datetime, segment: str | None = None) -> float:
    """The share of the window's tokens that ran as shadow tokens (rollups at the first exit
    layer, which every token reaches); 0 with no rollups."""
    rows = [Rollup.deployment_id == deployment.id, Rollup.minute >= since,
            Rollup.minute < until, Rollup.layer == min(deployment.exit_layers)]
    if segment is not None:
        rows.append(Rollup.segment == segment)
    tokens, shadow = session.execute(select(
        func.coalesce(func.sum(Rollup.tokens), 0),
        func.coalesce(func.sum(Rollup.shadow_total), 0)).where(*rows)).one()
    # A record batch may carry shadow tokens an aggregate batch of the same runtime counted
    # too (or not at all): the two counts come from different batches, so the ratio is bounded
    # here to the share it is.
    return min(1.0, float(shadow) / float(tokens)) if tokens else 0.0


def deployment_cost_model(*, session: Session, deployment: Deployment, since: datetime,
                          until: datetime) -> CostModel | None:
    """The cost model the savings fit on the window's timed rollups (`telemetry.savings`: the
    deployment's main lineage, else its pooled fit); None when none can be fitted (the what-if
    and the curve then use the layers ratio)."""
    (report,) = savings(session=session, deployments=[deployment], since=since, until=until)
    fitted = report.get("cost_model")
    if not fitted:
        return None
    return CostModel(**{key: value for key, value in fitted.items() if key != "full_depth_us"})


def what_if(*, session: Session, deployment: Deployment, version: int | None = None,
            thresholds: dict | None = None, delta: float | None = None,
            epsilon: float | None = None, window_s: float | None = None,
            since: datetime | None = None, until: datetime | None = None,
            segment: str | None = None, runtimes: list[str] | None = None,
            policy: CalibrationPolicy | None = None, now: datetime | None = None) -> WhatIf:
    """Evaluate one threshold set on the window's shadow evidence (module docstring): exactly
    one of `version`, `thresholds` or `delta` (with `epsilon`, default the deployment's) names
    it. Invalid: none or more than one, an unknown segment, a hand-edited set that does not fit
    the exit layers, a calibration short of samples."""
    named = [version is not None, thresholds is not None, delta is not None]
    if sum(named) != 1:
        raise Invalid("name exactly one threshold set: a version, a hand-edited set of "
                      "thresholds, or a δ (and ε) to calibrate at")
    if epsilon is not None and delta is None:
        raise Invalid("epsilon goes with delta: the set a calibration would choose at δ, ε")
    if segment not in (None, DEFAULT_SEGMENT) and segment not in known_segments(
            session=session, deployment_id=deployment.id):
        raise Invalid(f"deployment {deployment.name!r} knows no traffic segment {segment!r}")
    policy = policy or CalibrationPolicy.from_settings(get_settings())
    since, until = window_bounds(window_s=window_s, since=since, until=until, now=now)
    evidence = read_evidence(session=session, deployment=deployment, since=since, until=until,
                             segment=segment, runtimes=runtimes, policy=policy)
    layers = [int(layer) for layer in deployment.exit_layers]
    epsilon_at = deployment.epsilon if epsilon is None else epsilon
    delta_at = deployment.delta if delta is None else delta
    source, label = "set", None
    if version is not None:
        chosen = get_threshold_set(session=session, deployment=deployment, version=version)
        maps = {name: thresholds_for(chosen, name) for name in set(evidence.segments.tolist())}
        rows = np.array([[maps[name][layer] for layer in layers]
                         for name in evidence.segments.tolist()]).reshape(-1, len(layers))
        label = thresholds_for(chosen, segment or DEFAULT_SEGMENT)
        source, matrix = "version", rows
    elif thresholds is not None:
        try:
            label = validate_thresholds(thresholds, layers)
        except InvalidThresholds as wrong:
            raise Invalid(str(wrong)) from None
        matrix = np.array([label[layer] for layer in layers])
    else:
        if not 0 < delta_at < 1 or not 0 < epsilon_at < 1:
            raise Invalid("delta and epsilon lie strictly between 0 and 1")
        result = calibrate(evidence=evidence, deployment=deployment, delta=delta_at,
                           epsilon=epsilon_at, policy=policy)
        label, source = dict(result.thresholds), "calibration"
        matrix = np.array([label[layer] for layer in layers])
    found = evaluate(signals=evidence.signals, matched=evidence.matched, thresholds=matrix,
                    exit_layers=layers, num_layers=deployment.num_layers, delta=delta_at,
                    epsilon=epsilon_at, requests=evidence.requests,
                    witnesses=evidence.witnesses,
                    cost_model=deployment_cost_model(session=session, deployment=deployment,
                                                     since=since, until=until),
                    shadow_share=shadow_share(session=session, deployment=deployment,
                                              since=since, until=until, segment=segment),
                    source=source, version=version, label=label)
    answers = read_answers(session=session, deployment=deployment, since=since, until=until,
                           segment=segment, runtimes=runtimes, set_aside=evidence.set_aside,
                           policy=policy)
    if version is not None:
        def thresholds_of(name: str) -> list[float]:
            return [thresholds_for(chosen, name)[layer] for layer in layers]
    else:
        def thresholds_of(name: str) -> list[float]:
            return [label[layer] for layer in layers]
    figures = answer_consistency(answers, thresholds_of, epsilon=epsilon_at)
    return found if figures is None else replace(
        found, answers=figures.to_dict() | {"delta_answer": deployment.delta_answer})


def calibrate(*, evidence: Evidence, deployment: Deployment, delta: float, epsilon: float,
              policy: CalibrationPolicy, seed: int = 0) -> CalibrationResult:
    """The set a calibration would choose on `evidence` at δ, ε (nothing is published);
    Invalid when the window holds too few shadow samples."""
    try:
        return calibrate_thresholds(
            signals=evidence.signals, matched=evidence.matched,
            exit_layers=[int(layer) for layer in deployment.exit_layers],
            num_layers=deployment.num_layers, delta=delta, epsilon=epsilon,
            strategy=policy.strategy, min_samples_per_layer=policy.min_samples_per_layer,
            learn_fraction=policy.learn_fraction, seed=seed, requests=evidence.requests,
            runtimes=evidence.witnesses,
            robust_min_runtimes=policy.evidence.robust_min_runtimes)
    except NotEnoughShadowData as shortage:
        raise Invalid(f"{shortage} (window {evidence.since:%Y-%m-%d %H:%M} to "
                      f"{evidence.until:%Y-%m-%d %H:%M})") from None
