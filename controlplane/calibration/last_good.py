"""The last good threshold set of a deployment: the newest earlier active, non-fallback version
whose own shadow disagreement stayed within δ.

It is judged on the evidence the deployment takes: the shadow tokens and rollups of runtimes
set aside as outliers or serving other heads or another model
(`runtimes.outliers.excluded_runtime_ids`) count for nothing, so one runtime's forged
agreement cannot make a set "good" and its forged disagreement cannot disqualify one.

Fallback (`flows.fallback`, `last_good` mode) returns to it; the automatic promotion bounds
(`calibration.promotion`) keep a single-runtime recalibration from going more aggressive than it.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controlplane.calibration.learn_then_test import policy_disagreement
from controlplane.deployments.models import AuditEvent, Deployment, ThresholdSet
from controlplane.deployments.segment_sets import thresholds_for
from controlplane.runtimes.outliers import excluded_runtime_ids
from controlplane.telemetry.models import Rollup
from controlplane.telemetry.service import shadow_samples
from exitplane.wire import Origin


def last_good_version(*, session: Session, deployment: Deployment, exclude: set[int],
                      min_shadow_tokens: int, recent: tuple | None = None,
                      segment: str | None = None) -> ThresholdSet | None:
    """The newest earlier active, non-fallback version whose own shadow disagreement stayed
    within δ; with `recent` (signals, matched) also within δ on the recent traffic. With a
    `segment`, on that segment's traffic only and with the thresholds it applied there."""
    versions = session.scalars(
        select(AuditEvent.to_version).where(AuditEvent.deployment_id == deployment.id,
                                            AuditEvent.alias == "active",
                                            AuditEvent.to_version.is_not(None))
        .order_by(AuditEvent.id.desc()))
    seen: set[int] = set()
    for version in versions:
        if version in seen or version in exclude:
            continue
        seen.add(version)
        candidate = session.scalars(select(ThresholdSet).where(
            ThresholdSet.deployment_id == deployment.id, ThresholdSet.version == version)).one()
        if candidate.origin == str(Origin.fallback):
            continue
        shadow, mismatches = (
            _version_disagreement(session=session, deployment=deployment, version=version)
            if segment is None else _segment_disagreement(
                session=session, deployment=deployment, version=candidate, segment=segment))
        if shadow < min_shadow_tokens or mismatches / shadow > deployment.delta:
            continue
        if recent is not None and len(recent[0]) >= min_shadow_tokens:
            by_layer = (candidate.thresholds_by_layer() if segment is None
                        else thresholds_for(candidate, segment))
            wrong, n = policy_disagreement(recent[0], recent[1],
                                           [by_layer[k] for k in deployment.exit_layers])
            if wrong / n > deployment.delta:
                continue
        return candidate
    return None


def _version_disagreement(*, session: Session, deployment: Deployment,
                          version: int) -> tuple[int, int]:
    """(shadow tokens, policy mismatches) over the stored rollups of `version`, leaving out the
    runtimes the deployment does not take evidence from (outliers, other heads or model)."""
    rows = [Rollup.deployment_id == deployment.id, Rollup.version == version]
    excluded = excluded_runtime_ids(session=session, deployment_id=deployment.id)
    if excluded:
        rows.append(Rollup.runtime_id.not_in(sorted(excluded)))
    shadow = session.scalar(select(func.coalesce(func.sum(Rollup.shadow_total), 0)).where(
        *rows, Rollup.layer == deployment.exit_layers[0]))
    mismatches = session.scalar(select(func.coalesce(func.sum(Rollup.policy_mismatches), 0))
                                .where(*rows))
    return int(shadow), int(mismatches)


def _segment_disagreement(*, session: Session, deployment: Deployment, version: ThresholdSet,
                          segment: str, limit: int = 200_000) -> tuple[int, int]:
    """(shadow tokens, policy mismatches) of `version` on one segment's stored shadow tokens,
    replayed with the map that segment applies in `version` (from every stored shadow token of
    the segment under that version, not a window's rollups)."""
    signals, matched = shadow_samples(session=session, deployment=deployment,
                                      since=datetime.min.replace(tzinfo=UTC),
                                      version=version.version, segment=segment, limit=limit)
    if not len(signals):
        return 0, 0
    by_layer = thresholds_for(version, segment)
    wrong, n = policy_disagreement(signals, matched, [by_layer[k] for k in deployment.exit_layers])
    return n, wrong
