"""Bounds on automatic promotion: how far a recalibrated set may move without an operator.

Robust evidence (`stats.robust_evidence`) keeps one runtime from deciding a verdict in a fleet;
these bounds hold whatever the evidence says, and are what is left with a single runtime:

- a candidate that lowers any threshold the active set exits on (of any segment's map) by more
  than `max_threshold_step`, or whose expected exit rate is more than `max_exit_rate_rise` above
  the active set's, waits for approval whatever the deployment's policy (auto or canary);
- a deployment whose window had fewer witnesses (credentials, `runtimes.witnesses`) than the
  robust minimum never auto-promotes a set more aggressive (some threshold lower) than its
  last good one: the newest earlier active, non-fallback set whose own shadow disagreement
  stayed within δ (`calibration.last_good`); nor, with no last good version yet, a set that
  opens exits where the active set never exits (a first calibration from never-exit): that
  waits for an operator, or runs as a canary under policy canary (which pauses for a human
  with too few canary witnesses);
- the expected exit rate a rise is read on is the larger of the calibration's test split and
  its median witness, so a minority of witnesses shaping their evidence moves neither.

A layer the active set never exits on has no threshold to step from: opening it is bounded by
the exit-rate rise, and with few witnesses by an operator. So a fleet of witnesses gets a first
calibration from never-exit through, a set that would exit everywhere is stopped (a liar's
thresholds 0.0: an exit rate rising to 1.0), and a recalibration may not drop a working
threshold far.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import case, func, literal, select
from sqlalchemy.orm import Session

from controlplane.calibration.last_good import last_good_version
from controlplane.deployments.models import Deployment, ThresholdSet
from controlplane.deployments.segment_sets import thresholds_for
from controlplane.runtimes.outliers import excluded_runtime_ids, excluded_witnesses
from controlplane.runtimes.witnesses import RUNTIME_PREFIX
from controlplane.telemetry.models import ShadowSampleRow
from exitplane.wire import DEFAULT_SEGMENT, NEVER_EXIT


@dataclass(frozen=True)
class PromotionBounds:
    """How far an automatic promotion may move the active set."""

    max_threshold_step: float = 0.75
    max_exit_rate_rise: float = 0.9
    min_shadow_tokens: int = 200  # for a set to count as the last good one
    # from this many witnesses on, a fleet can check each of them (the robust minimum)
    robust_min_witnesses: int = 3

    @classmethod
    def from_settings(cls, settings) -> PromotionBounds:
        return cls(max_threshold_step=settings.promotion_max_threshold_step,
                   max_exit_rate_rise=settings.promotion_max_exit_rate_rise,
                   min_shadow_tokens=settings.fallback_min_shadow_tokens,
                   robust_min_witnesses=settings.evidence_robust_min_runtimes)


def _segments(*sets: ThresholdSet) -> list[str]:
    names = {DEFAULT_SEGMENT}
    for threshold_set in sets:
        names.update(threshold_set.segments or {})
    return sorted(names)


def _expected_exit_rate(threshold_set: ThresholdSet, segment: str) -> float | None:
    """The set's expected exit rate on `segment`: the larger of its calibration's test split
    and its median witness (a minority of witnesses shaping their evidence sets neither); 0
    where it never exits; None if unknown."""
    if all(value >= NEVER_EXIT for value in thresholds_for(threshold_set, segment).values()):
        return 0.0
    metrics = threshold_set.expected_metrics or {}
    if segment != DEFAULT_SEGMENT:
        metrics = (metrics.get("segments") or {}).get(segment) or {}
    rates = [metrics.get(key) for key in ("total_exit_rate", "median_witness_exit_rate")]
    rates = [float(rate) for rate in rates if isinstance(rate, int | float)]
    return max(rates) if rates else None


def step_reasons(*, candidate: ThresholdSet, active: ThresholdSet,
                 bounds: PromotionBounds) -> list[str]:
    """Why `candidate` moves too far from `active` to be promoted without an operator."""
    reasons = []
    for segment in _segments(candidate, active):
        new, old = thresholds_for(candidate, segment), thresholds_for(active, segment)
        where = "" if segment == DEFAULT_SEGMENT else f" of segment {segment}"
        for layer in sorted(new):
            if old.get(layer, NEVER_EXIT) >= NEVER_EXIT:
                continue  # the active set never exits here: the exit-rate rise bounds it
            drop = old[layer] - new[layer]
            if drop > bounds.max_threshold_step + 1e-12:
                reasons.append(f"layer {layer}{where} threshold {old[layer]:g} "
                               f"-> {new[layer]:g} (lowered by {drop:.3f} > "
                               f"{bounds.max_threshold_step:g})")
        after, before = (_expected_exit_rate(candidate, segment),
                         _expected_exit_rate(active, segment))
        if after is not None and before is not None \
                and after - before > bounds.max_exit_rate_rise + 1e-12:
            reasons.append(f"expected exit rate{where} {before:.3f} -> {after:.3f} (rises by "
                           f"{after - before:.3f} > {bounds.max_exit_rate_rise:g})")
    return reasons


def more_aggressive(candidate: ThresholdSet, good: ThresholdSet) -> list[str]:
    """The thresholds where `candidate` exits more readily than `good`."""
    found = []
    for segment in _segments(candidate, good):
        new, old = thresholds_for(candidate, segment), thresholds_for(good, segment)
        where = "" if segment == DEFAULT_SEGMENT else f" of segment {segment}"
        found += [f"layer {layer}{where} {new[layer]:g} < {old[layer]:g}"
                  for layer in sorted(new) if layer in old and new[layer] < old[layer] - 1e-12]
    return found


def reporting_witnesses(*, session: Session, deployment: Deployment, since: datetime,
                        until: datetime | None = None) -> int:
    """Witnesses (credentials, `runtimes.witnesses`) whose shadow tokens the window holds,
    leaving out the excluded ones: N runtime ids of one token are one witness."""
    witness = case((ShadowSampleRow.witness == "",
                    literal(RUNTIME_PREFIX) + ShadowSampleRow.runtime_id),
                   else_=ShadowSampleRow.witness)
    query = select(func.count(func.distinct(witness))).where(
        ShadowSampleRow.deployment_id == deployment.id, ShadowSampleRow.ts >= since)
    if until is not None:
        query = query.where(ShadowSampleRow.ts < until)
    excluded = excluded_runtime_ids(session=session, deployment_id=deployment.id)
    if excluded:
        query = query.where(ShadowSampleRow.runtime_id.not_in(sorted(excluded)))
    set_aside = excluded_witnesses(session=session, deployment_id=deployment.id)
    if set_aside:
        query = query.where(ShadowSampleRow.witness.not_in(sorted(set_aside)))
    return int(session.scalar(query) or 0)


def opened_from_never_exit(candidate: ThresholdSet, active: ThresholdSet) -> list[str]:
    """The segments where `active` never exits and `candidate` does ('default' first)."""
    opened = []
    for segment in _segments(candidate, active):
        if (all(value >= NEVER_EXIT for value in thresholds_for(active, segment).values())
                and any(value < NEVER_EXIT
                        for value in thresholds_for(candidate, segment).values())):
            opened.append(segment)
    return opened


def promotion_hold(*, session: Session, deployment: Deployment, candidate: ThresholdSet,
                   active: ThresholdSet, conservative: int | None, since: datetime,
                   until: datetime | None, bounds: PromotionBounds) -> str:
    """Why `candidate` must wait for an operator whatever the policy ("" when it may be
    promoted automatically; module docstring)."""
    reasons = step_reasons(candidate=candidate, active=active, bounds=bounds)
    witnesses = reporting_witnesses(session=session, deployment=deployment, since=since,
                                    until=until)
    if witnesses < bounds.robust_min_witnesses:
        good = last_good_version(session=session, deployment=deployment,
                                 exclude={candidate.version} | (
                                     set() if conservative is None else {conservative}),
                                 min_shadow_tokens=bounds.min_shadow_tokens)
        opened = opened_from_never_exit(candidate, active) if good is None else []
        if opened and deployment.policy != "canary":
            reasons.append(
                f"{witnesses} witness(es) reported the samples (fewer than the "
                f"{bounds.robust_min_witnesses} a fleet needs to check each of them), and the "
                f"set opens exits where the active set never exits (segment "
                f"{', '.join(opened[:4])}) with no last good version to bound it: a first "
                "calibration on so few credentials waits for an operator, or runs as a canary")
        lower = [] if good is None else more_aggressive(candidate, good)
        if lower:
            reasons.append(f"{witnesses} witness(es) reported the samples, and the set is more "
                           f"aggressive than the last good version {good.version} ("
                           f"{'; '.join(lower[:4])})")
    if not reasons:
        return ""
    return "automatic promotion bounds: " + "; ".join(reasons[:6])
