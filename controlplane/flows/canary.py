"""Canary with automatic revert (Flagger / Argo Rollouts style), as plain functions.

A candidate on the `canary` alias is served to a hash-sticky fraction of runtimes (its
members, `deployments.service.in_canary` at `canary_fraction`). Every `interval` the last
whole-minute window of the members' telemetry at the canary version is judged beside the
stable group: failed (disagreement significantly above δ, or an exit rate materially above the
calibration's expectation), inconclusive (too little evidence, or a bound above δ) or clean.
Only members count; witnesses (credentials), not runtime ids, count, and no single witness
decides; requests are the test's clusters; each judged segment is tested on its own rows at
alpha / k; outlier runtimes are set aside first; with an answer target, the members' shadow
requests judge whole answers too (`canary_answers`). `clean_windows` clean windows promote,
`failure_limit` failures revert and fire `canary_failed`, `max_inconclusive` inconclusive
windows (or a clean one on too few witnesses) pause it for an operator.
docs/guides/recalibrate-and-canary.md, "How a window is judged", says why each rule is there.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

import numpy as np
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controlplane.alerts.kinds import AlertKind
from controlplane.alerts.service import Condition, fire
from controlplane.calibration.models import CalibrationJob, CanaryRun
from controlplane.db import utcnow
from controlplane.deployments.models import Deployment, ThresholdSet
from controlplane.deployments.segment_sets import thresholds_for
from controlplane.deployments.segments import known_segments
from controlplane.deployments.service import (
    aliases_of,
    clear_alias,
    get_threshold_set,
    in_canary,
    move_alias,
)
from controlplane.drift.detectors import LayerCounts, LayerReference, proportion_z_test
from controlplane.drift.outliers import detect_outliers
from controlplane.drift.window_checks import DriftOptions
from controlplane.errors import Conflict, NotFound
from controlplane.flows.canary_answers import answer_check, with_answers
from controlplane.runtimes.outliers import excluded_runtime_ids
from controlplane.stats.clustered import ClusteredProportion, clustered_rate
from controlplane.stats.exits import policy_outcomes
from controlplane.stats.robust_evidence import leave_one_out
from controlplane.telemetry.models import Rollup
from controlplane.telemetry.service import shadow_evidence
from exitplane.wire import DEFAULT_SEGMENT

log = logging.getLogger("exitplane.canary")


@dataclass(frozen=True)
class CanaryPolicy:
    """Interval, the verdict thresholds and the limits that end a canary."""

    interval: timedelta = timedelta(minutes=1)
    clean_windows: int = 3
    failure_limit: int = 1
    max_inconclusive: int = 10
    min_shadow_tokens: int = 200
    min_shadow_requests: int = 10  # fewer: clustering cannot be measured
    alpha: float = 0.01
    exit_rate_tolerance: float = 0.10  # absolute excess over the expected exit rate that fails
    min_runtimes: int = 3  # from this many canary runtimes on, none decides a verdict alone
    # the outlier test run on the canary version's shadow tokens (its false-alarm budget per
    # hour, requests needed, window: `drift.outliers`); its check interval is `interval`
    outliers: DriftOptions = field(default_factory=DriftOptions)

    @classmethod
    def from_settings(cls, settings) -> CanaryPolicy:
        return cls(interval=timedelta(seconds=settings.canary_interval_s),
                   clean_windows=settings.canary_clean_windows,
                   failure_limit=settings.canary_failure_limit,
                   max_inconclusive=settings.canary_max_inconclusive,
                   min_shadow_tokens=settings.canary_min_shadow_tokens,
                   min_shadow_requests=settings.canary_min_shadow_requests,
                   min_runtimes=settings.evidence_robust_min_runtimes,
                   outliers=DriftOptions.from_settings(settings))


def floor_minute(moment: datetime) -> datetime:
    return moment.replace(second=0, microsecond=0)


def start_canary(*, session: Session, deployment: Deployment, version: int, actor: str,
                 job_id: int | None = None, now: datetime | None = None,
                 replace_open: bool = True, reason: str = "") -> CanaryRun:
    """Point `canary` at `version` and start checking it. An open (running or paused) canary is
    aborted, or with `replace_open=False` refused (Conflict); a version that does not exist
    (NotFound) or is the active one (Conflict) is refused. `reason` is added to the audit
    log's own."""
    now = now or utcnow()
    get_threshold_set(session=session, deployment=deployment, version=version)
    baseline = aliases_of(session=session, deployment=deployment)["active"]
    if version == baseline:
        raise Conflict(f"version {version} is {deployment.name!r}'s active version: a canary "
                       "serves a different version beside it; publish or pick another one")
    for old in session.scalars(select(CanaryRun).where(
            CanaryRun.deployment_id == deployment.id,
            CanaryRun.status.in_(("running", "paused")))):
        if not replace_open:
            raise Conflict(f"deployment {deployment.name!r} already has a {old.status} canary "
                           f"of version {old.version}: promote or revert it first")
        _end(old, "aborted", f"replaced by a canary of version {version}", now)
    why = (f"canary of version {version} on {deployment.canary_fraction:.0%} of runtimes "
           f"(stable: version {baseline})")
    move_alias(session=session, deployment=deployment, alias="canary", version=version,
               actor=actor, action="canary.start",
               reason=f"{why}: {reason}" if reason else why,
               details={"calibration_job_id": job_id})
    # Windows start at the next whole minute: the current one mixes in pre-canary traffic.
    run = CanaryRun(deployment_id=deployment.id, version=version, baseline_version=baseline,
                    job_id=job_id, status="running", started_at=now,
                    next_window_start=floor_minute(now) + timedelta(minutes=1))
    session.add(run)
    session.flush()
    return run


def running_canary(*, session: Session, deployment: Deployment,
                   lock: bool = False) -> CanaryRun | None:
    """The deployment's newest canary run, whatever its status (None if it never had one)."""
    query = (select(CanaryRun).where(CanaryRun.deployment_id == deployment.id)
             .order_by(CanaryRun.id.desc()).limit(1))
    if lock:
        query = query.with_for_update()
    return session.scalars(query).one_or_none()


def group_figures(*, session: Session, deployment: Deployment, version: int,
                  since: datetime, until: datetime, segment: str | None = None,
                  exclude: Collection[str] = ()) -> dict:
    """Tokens, exit rate, shadow tokens and policy disagreement of one version's runtimes (on
    one traffic segment's rows when given; without the runtimes in `exclude`)."""
    first = deployment.exit_layers[0]
    exit_layers = deployment.exit_layers
    base = (Rollup.deployment_id == deployment.id, Rollup.version == version,
            Rollup.minute >= since, Rollup.minute < until,
            *([Rollup.segment == segment] if segment is not None else []),
            *([Rollup.runtime_id.not_in(sorted(exclude))] if exclude else []))
    tokens, shadow = session.execute(
        select(func.coalesce(func.sum(Rollup.tokens), 0),
               func.coalesce(func.sum(Rollup.shadow_total), 0))
        .where(*base, Rollup.layer == first)).one()
    exits, mismatches = session.execute(
        select(func.coalesce(func.sum(Rollup.exits), 0),
               func.coalesce(func.sum(Rollup.policy_mismatches), 0))
        .where(*base, Rollup.layer.in_(exit_layers))).one()
    tokens, shadow, exits, mismatches = int(tokens), int(shadow), int(exits), int(mismatches)
    served = tokens - shadow  # shadow tokens never exit: the exit rate is over the others
    return {"version": version, "tokens": tokens, "served_tokens": served, "exits": exits,
            "exit_rate": exits / served if served else None, "shadow_tokens": shadow,
            "mismatches": mismatches, "disagreement": mismatches / shadow if shadow else None}


@dataclass(frozen=True)
class WindowEvidence:
    """A window's canary shadow evidence (of one traffic segment when judged by segment): the
    members' disagreement, the same without each one witness's tokens, and what was left out."""

    quality: ClusteredProportion
    without_one: list[ClusteredProportion]
    witnesses: int  # distinct member witnesses (credentials) behind `quality`
    non_member_shadow_tokens: int  # canary-version shadow tokens of non-members, ignored
    non_members: frozenset[str]  # the runtime ids that reported them


@dataclass(frozen=True)
class NonMembers:
    """What runtimes outside the canary group reported at the canary version in one window:
    their rollup tokens and shadow tokens, which no figure or test of the window counts."""

    tokens: int = 0
    shadow_tokens: int = 0
    runtimes: Collection[str] = frozenset()

    def add(self, evidence: WindowEvidence) -> NonMembers:
        """These figures with one judged segment's ignored shadow tokens added."""
        return NonMembers(tokens=self.tokens,
                          shadow_tokens=self.shadow_tokens + evidence.non_member_shadow_tokens,
                          runtimes=frozenset({*self.runtimes, *evidence.non_members}))

    def to_dict(self) -> dict:
        """The check's `non_members` figures (the first ten runtime ids, by name)."""
        names = sorted(self.runtimes)
        return {"runtimes": len(names), "runtime_ids": names[:10], "tokens": self.tokens,
                "shadow_tokens": self.shadow_tokens}


def canary_members(*, deployment: Deployment, runtime_ids: Iterable[str]) -> set[str]:
    """The runtime ids among `runtime_ids` that the deployment serves the canary set."""
    return {runtime_id for runtime_id in set(runtime_ids)
            if in_canary(runtime_id=runtime_id, fraction=deployment.canary_fraction)}


def window_runtimes(*, session: Session, deployment: Deployment, version: int,
                    since: datetime, until: datetime,
                    exclude: Collection[str] = ()) -> dict[str, int]:
    """Tokens per runtime id in one version's rollups of a window (without `exclude`)."""
    rows = session.execute(
        select(Rollup.runtime_id, func.coalesce(func.sum(Rollup.tokens), 0))
        .where(Rollup.deployment_id == deployment.id, Rollup.version == version,
               Rollup.minute >= since, Rollup.minute < until,
               Rollup.layer == deployment.exit_layers[0],
               *([Rollup.runtime_id.not_in(sorted(exclude))] if exclude else []))
        .group_by(Rollup.runtime_id)).all()
    return {runtime_id: int(tokens) for runtime_id, tokens in rows}


def window_quality(*, session: Session, deployment: Deployment, version: int,
                   thresholds: dict[int, float], since: datetime, until: datetime,
                   segment: str | None = None, exclude: Collection[str] | None = None,
                   min_runtimes: int = 3) -> WindowEvidence:
    """The policy's disagreement on the canary members' shadow tokens of one version in a window
    (of one traffic segment when given), clustered by request (the unit the quality test
    counts); then the same without each one witness's tokens when `min_runtimes` or more
    witnesses report (`stats.robust_evidence`). Non-members' tokens and excluded runtimes'
    (`exclude`, None: the deployment's) count for nothing."""
    found = shadow_evidence(session=session, deployment=deployment, since=since, until=until,
                            version=version, segment=segment, exclude=exclude)
    runtimes = np.asarray(found.runtimes, dtype=str)
    members = canary_members(deployment=deployment, runtime_ids=found.runtimes)
    # Filtered here, not by the rollups' runtime ids: shadow tokens may come without rollups.
    member = np.isin(runtimes, sorted(members))
    layers = sorted(deployment.exit_layers)
    _, disagree = policy_outcomes(found.signals[member], found.matched[member],
                                  [thresholds[k] for k in layers])
    requests = found.keyed_requests()[member]
    witnesses = np.asarray(found.witnesses, dtype=str)[member]
    without_one = [clustered_rate(requests[mask], disagree[mask])
                   for mask in leave_one_out(witnesses, min_runtimes)]
    return WindowEvidence(quality=clustered_rate(requests, disagree), without_one=without_one,
                          witnesses=len(set(witnesses.tolist())),
                          non_member_shadow_tokens=int((~member).sum()),
                          non_members=frozenset(runtimes[~member].tolist()))


def _verdict(*, canary: dict, quality: ClusteredProportion, expected_exit_rate: float | None,
             delta: float, policy: CanaryPolicy,
             without_one: Sequence[ClusteredProportion] = ()) -> tuple[str, str, dict]:
    """(clean | failed | inconclusive, why, test figures) for one window of the canary. With
    `without_one` (the window without each one witness's tokens), a failure must show, and a
    clean window's bound hold, without any one witness too: no witness decides alone."""
    n, k, requests = quality.tokens, quality.events, quality.clusters
    tests: dict = {"quality": quality.to_dict()}
    over = (f"{k}/{n} shadow tokens over {requests} requests (design effect "
            f"{quality.design_effect:.1f}, effective {quality.effective_tokens:.0f})")
    if n:
        p_quality = max([quality.p_value_above(delta),
                         *(rest.p_value_above(delta) for rest in without_one)])
        tests["disagreement_p_value"] = float(p_quality)
        if p_quality <= policy.alpha:
            return "failed", (f"canary disagreement {k / n:.4f} on {over} is significantly "
                              f"above δ={delta} (p={p_quality:.2g})"), tests
    if expected_exit_rate is not None and canary["served_tokens"]:
        observed = LayerCounts(tokens=canary["served_tokens"], exits=canary["exits"])
        z, p_rate = proportion_z_test(observed, LayerReference(rate=expected_exit_rate))
        tests |= {"exit_rate_z": z, "exit_rate_p_value": p_rate,
                  "expected_exit_rate": expected_exit_rate}
        excess = observed.rate - expected_exit_rate
        if z > 0 and p_rate <= policy.alpha and excess > policy.exit_rate_tolerance:
            return "failed", (f"canary exit rate {observed.rate:.3f} is {excess:.3f} above the "
                              f"calibration's expected {expected_exit_rate:.3f} "
                              f"(p={p_rate:.2g})"), tests
    if n < policy.min_shadow_tokens or requests < policy.min_shadow_requests:
        return "inconclusive", (f"only {n} canary shadow tokens from {requests} requests in the "
                                f"window; need {policy.min_shadow_tokens} from "
                                f"{policy.min_shadow_requests}"), tests
    bound = max([quality.upper_bound(policy.alpha),
                 *(rest.upper_bound(policy.alpha) for rest in without_one)])
    tests["disagreement_upper_bound"] = bound
    if bound > delta:
        return "inconclusive", (f"canary disagreement {k / n:.4f} on {over}: its "
                                f"{1 - policy.alpha:.0%} upper bound {bound:.4f} is above "
                                f"δ={delta}"), tests
    return "clean", (f"canary disagreement {k / n:.4f} on {over}; {1 - policy.alpha:.0%} upper "
                     f"bound {bound:.4f} <= δ={delta}"), tests


def evaluate_canary(*, session: Session, deployment: Deployment,
                    policy: CanaryPolicy = CanaryPolicy(),
                    now: datetime | None = None) -> CanaryRun | None:
    """Check the running canary's windows that completed since the last check and act on the
    verdicts; returns the run (None when no canary runs)."""
    now = now or utcnow()
    session.refresh(deployment, with_for_update=True)  # one evaluator at a time
    run = session.scalars(select(CanaryRun).where(
        CanaryRun.deployment_id == deployment.id, CanaryRun.status == "running")
        .order_by(CanaryRun.id.desc()).limit(1).with_for_update()).one_or_none()
    if run is None:
        return None
    aliases = aliases_of(session=session, deployment=deployment)
    if aliases.get("canary") != run.version:
        _end(run, "aborted", "the canary alias was moved or cleared by hand", now)
        _settle_job(session=session, run=run, promotion="superseded")
        session.flush()
        return run
    candidate = session.scalars(select(ThresholdSet).where(
        ThresholdSet.deployment_id == deployment.id, ThresholdSet.version == run.version)).one()
    baseline = session.scalars(select(ThresholdSet).where(
        ThresholdSet.deployment_id == deployment.id,
        ThresholdSet.version == aliases["active"])).one()
    judged = judged_segments(candidate=candidate, baseline=baseline, known=known_segments(
        session=session, deployment_id=deployment.id))
    # Several segments judged: each failing test at alpha / k, so a good candidate is not
    # reverted more often because it changes more segments (as the drift checks split alpha).
    split = replace(policy, alpha=policy.alpha / len(judged))
    if floor_minute(now) >= run.next_window_start + policy.interval:
        canary_outliers(session=session, deployment=deployment, run=run, candidate=candidate,
                        policy=policy, now=now)
    exclude = excluded_runtime_ids(session=session, deployment_id=deployment.id)
    while run.status == "running":
        start = run.next_window_start
        end = start + policy.interval
        if end > floor_minute(now):  # only whole minutes that are over
            break
        check, thin = _judge_window(session=session, deployment=deployment, run=run,
                                    candidate=candidate, judged=judged, exclude=exclude,
                                    stable_version=aliases["active"], policy=policy,
                                    split=split, since=start, until=end)
        check["at"] = now.isoformat()
        run.checks = [*run.checks, check]
        run.next_window_start = end
        _count(session=session, deployment=deployment, run=run, verdict=check["verdict"],
               why=check["reason"], policy=policy, now=now, pause=thin)
    session.flush()
    return run


def _judge_window(*, session: Session, deployment: Deployment, run: CanaryRun,
                  candidate: ThresholdSet, judged: list[str | None], exclude: Collection[str],
                  stable_version: int, policy: CanaryPolicy, split: CanaryPolicy,
                  since: datetime, until: datetime) -> tuple[dict, bool]:
    """One window's check (verdict, reason and figures, on the canary members' telemetry
    alone), and whether it would have been clean on fewer than `min_runtimes` witnesses."""
    reported = window_runtimes(session=session, deployment=deployment, version=run.version,
                               since=since, until=until, exclude=exclude)
    outsiders = set(reported) - canary_members(deployment=deployment, runtime_ids=reported)
    ignored = NonMembers(tokens=sum(reported[runtime_id] for runtime_id in outsiders),
                         runtimes=frozenset(outsiders))
    verdicts, witnesses = {}, {}
    for segment in judged:
        figures = group_figures(session=session, deployment=deployment, version=run.version,
                                since=since, until=until, segment=segment,
                                exclude={*exclude, *outsiders})
        evidence = window_quality(
            session=session, deployment=deployment, version=run.version,
            thresholds=thresholds_for(candidate, segment or DEFAULT_SEGMENT), since=since,
            until=until, segment=segment, exclude=exclude, min_runtimes=policy.min_runtimes)
        verdict, why, tests = _verdict(
            canary=figures, quality=evidence.quality, delta=deployment.delta, policy=split,
            expected_exit_rate=_expected_exit_rate(candidate, segment),
            without_one=evidence.without_one)
        verdict, why, tests = with_answers(verdict, why, tests, answer_check(
            session=session, deployment=deployment, candidate=candidate, segment=segment,
            since=run.started_at, until=until, alpha=split.alpha,
            min_runtimes=policy.min_runtimes), alpha=split.alpha)
        tests["witnesses"] = witnesses[segment] = evidence.witnesses
        verdicts[segment] = (verdict, why, tests, figures)
        ignored = ignored.add(evidence)
    stable = group_figures(session=session, deployment=deployment, version=stable_version,
                           since=since, until=until, exclude=exclude)
    verdict, why, tests, figures = _combine(verdicts)
    thin = verdict == "clean" and min(witnesses.values()) < policy.min_runtimes
    if thin:
        verdict, why = "inconclusive", _too_few_witnesses(witnesses, policy, why)
    check = {"window": [since.isoformat(), until.isoformat()], "verdict": verdict,
             "reason": why, "canary": figures, "stable": stable, "tests": tests,
             "non_members": ignored.to_dict()}
    if judged != [None]:
        check["segments"] = {segment: {"verdict": v, "reason": r, "tests": t, "canary": f}
                             for segment, (v, r, t, f) in verdicts.items()}
    if ignored.runtimes:
        log.warning("canary of %s v%d: ignored %d tokens (%d shadow tokens) from %d runtimes "
                    "outside the canary group that reported its version", deployment.name,
                    run.version, ignored.tokens, ignored.shadow_tokens, len(ignored.runtimes))
    return check, thin


def _too_few_witnesses(witnesses: dict[str | None, int], policy: CanaryPolicy, why: str) -> str:
    """Why a window clean on fewer than `min_runtimes` witnesses is not counted as clean."""
    segment, count = min(witnesses.items(), key=lambda item: item[1])
    where = f" of segment {segment}" if segment is not None else ""
    return (f"clean on the shadow tokens{where} of only {count} canary witness"
            f"{'' if count == 1 else 'es'} (credentials), fewer than the {policy.min_runtimes} "
            f"needed before no one of them decides alone ({why}); more runtimes must serve the "
            "canary (raise the deployment's canary_fraction) or an operator must judge it")


def canary_outliers(*, session: Session, deployment: Deployment, run: CanaryRun,
                    candidate: ThresholdSet, policy: CanaryPolicy, now: datetime) -> list:
    """Test each canary runtime against the rest on the canary version's shadow tokens since the
    canary started, segment by segment (`drift.outliers`, the test the drift cycle runs on the
    active version): a runtime that forges agreement or disagreement with the candidate is set
    aside before its tokens can promote or hold back the canary."""
    segments = [DEFAULT_SEGMENT, *sorted(set(known_segments(
        session=session, deployment_id=deployment.id)) - {DEFAULT_SEGMENT})]
    layers = sorted(deployment.exit_layers)
    thresholds_of = {}
    for segment in segments:
        by_layer = thresholds_for(candidate, segment)
        thresholds_of[segment] = [by_layer[k] for k in layers]
    options = replace(policy.outliers, check_interval_s=policy.interval.total_seconds())
    return detect_outliers(session=session, deployment=deployment, version=run.version,
                           thresholds_of=thresholds_of, activated_at=run.started_at, now=now,
                           options=options, min_requests=options.outlier_min_requests,
                           robust_min_runtimes=policy.min_runtimes,
                           counts=lambda runtime_id: in_canary(
                               runtime_id=runtime_id, fraction=deployment.canary_fraction))


def judged_segments(*, candidate: ThresholdSet, baseline: ThresholdSet, known: list[str]
                    ) -> list[str | None]:
    """The traffic segments a canary judges: those whose thresholds the candidate
    changes ('default' first), each on its own rows; [None] (all traffic as one)
    when neither set has segment maps and the deployment knows no segment, or when
    the candidate changes nothing."""
    if not known and not candidate.segments and not baseline.segments:
        return [None]
    names = [DEFAULT_SEGMENT, *sorted(set(known) - {DEFAULT_SEGMENT})]
    changed = [name for name in names
               if thresholds_for(candidate, name) != thresholds_for(baseline, name)]
    return changed or [None]


def _expected_exit_rate(candidate: ThresholdSet, segment: str | None) -> float | None:
    metrics = candidate.expected_metrics or {}
    if segment not in (None, DEFAULT_SEGMENT):
        metrics = (metrics.get("segments") or {}).get(segment) or {}
    return metrics.get("total_exit_rate")


def _combine(verdicts: dict) -> tuple[str, str, dict, dict]:
    """One window's verdict over the judged segments: failed if any failed, else inconclusive
    if any was, else clean; the reason and figures of the segment that decided."""
    for wanted in ("failed", "inconclusive", "clean"):
        for segment, (verdict, why, tests, figures) in verdicts.items():
            if verdict == wanted:
                if segment is not None:
                    why = f"segment {segment}: {why}"
                return verdict, why, tests, figures
    raise ValueError("no segment was judged")


def _count(*, session: Session, deployment: Deployment, run: CanaryRun, verdict: str, why: str,
           policy: CanaryPolicy, now: datetime, pause: bool = False) -> None:
    """Count one window's verdict and act on the limits; `pause` stops an inconclusive window's
    canary at once, whatever the count."""
    actor = "system:canary"
    if verdict == "clean":
        run.clean_windows += 1
        if run.clean_windows >= policy.clean_windows:
            promote_canary(session=session, deployment=deployment, run=run, actor=actor,
                           reason=f"{run.clean_windows} clean windows", now=now)
    elif verdict == "failed":
        run.failed_checks += 1
        if run.failed_checks >= policy.failure_limit:
            revert_canary(session=session, deployment=deployment, run=run, actor=actor,
                          reason=why, now=now)
    else:
        run.inconclusive_windows += 1
        if pause or run.inconclusive_windows >= policy.max_inconclusive:
            run.status = "paused"
            cause = why if pause else f"{run.inconclusive_windows} inconclusive windows ({why})"
            run.status_reason = f"{cause}; {_operator_paths(deployment, run)}"
            log.warning("canary of %s v%d paused: %s", deployment.name, run.version, why)


def _operator_paths(deployment: Deployment, run: CanaryRun) -> str:
    """What an operator runs to end a paused canary."""
    paths = (f"`exitplane canary promote {deployment.name} --reason R` or `exitplane canary "
             f"revert {deployment.name} --reason R`")
    if run.job_id is not None:
        paths += (f", or approve / reject calibration job {run.job_id} (`exitplane "
                  f"calibrations approve|reject {deployment.name} {run.job_id} --reason R`)")
    return f"waiting for an operator to promote or revert: {paths}"


def promote_canary(*, session: Session, deployment: Deployment, run: CanaryRun, actor: str,
                   reason: str, now: datetime | None = None) -> CanaryRun:
    """Make the canary version active and clear the canary alias."""
    _require_open(run)
    now = now or utcnow()
    move_alias(session=session, deployment=deployment, alias="active", version=run.version,
               actor=actor, action="canary.promote", reason=f"canary promoted: {reason}",
               details={"canary_run_id": run.id, "calibration_job_id": run.job_id})
    if aliases_of(session=session, deployment=deployment).get("canary") == run.version:
        clear_alias(session=session, deployment=deployment, alias="canary", actor=actor,
                    reason=f"canary of version {run.version} promoted")
    _end(run, "promoted", reason, now)
    _settle_job(session=session, run=run, promotion="canary_promoted")
    session.flush()
    return run


def revert_canary(*, session: Session, deployment: Deployment, run: CanaryRun, actor: str,
                  reason: str, now: datetime | None = None, fire_alert: bool = True) -> CanaryRun:
    """Clear the canary alias (canary runtimes return to the stable set); alert by default."""
    _require_open(run)
    now = now or utcnow()
    if aliases_of(session=session, deployment=deployment).get("canary") == run.version:
        clear_alias(session=session, deployment=deployment, alias="canary", actor=actor,
                    reason=f"canary of version {run.version} reverted: {reason}")
    _end(run, "reverted", reason, now)
    _settle_job(session=session, run=run, promotion="canary_reverted")
    if fire_alert:
        _alert_revert(session=session, deployment=deployment, run=run, reason=reason, now=now)
    session.flush()
    return run


def get_canary(*, session: Session, deployment: Deployment, run_id: int) -> CanaryRun:
    run = session.get(CanaryRun, run_id)
    if run is None or run.deployment_id != deployment.id:
        raise NotFound(f"deployment {deployment.name!r} has no canary run {run_id}")
    return run


def abort_canary(*, session: Session, deployment: Deployment, actor: str, reason: str) -> None:
    """Stop a running or paused canary without a verdict (the fallback does this)."""
    now = utcnow()
    for run in session.scalars(select(CanaryRun).where(
            CanaryRun.deployment_id == deployment.id,
            CanaryRun.status.in_(("running", "paused")))):
        _end(run, "aborted", reason, now)
        _settle_job(session=session, run=run, promotion="canary_reverted")
    if "canary" in aliases_of(session=session, deployment=deployment):
        clear_alias(session=session, deployment=deployment, alias="canary", actor=actor,
                    reason=reason)


def _require_open(run: CanaryRun) -> None:
    if run.status not in ("running", "paused"):
        raise Conflict(f"canary run {run.id} is already {run.status}")


def _end(run: CanaryRun, status: str, reason: str, now: datetime) -> None:
    run.status, run.status_reason, run.finished_at = status, reason, now


def _settle_job(*, session: Session, run: CanaryRun, promotion: str) -> None:
    if run.job_id is not None:
        job = session.get(CalibrationJob, run.job_id)
        if job is not None:
            job.promotion, job.updated_at = promotion, utcnow()


def _alert_revert(*, session: Session, deployment: Deployment, run: CanaryRun, reason: str,
                  now: datetime) -> None:
    last = run.checks[-1] if run.checks else {}
    alert, _ = fire(session=session, deployment=deployment, now=now, condition=Condition(
        kind=AlertKind.CANARY_FAILED, severity="critical", subject=f"v{run.version}",
        summary=f"canary of version {run.version} reverted: {reason}",
        evidence={"canary_run_id": run.id, "version": run.version,
                  "baseline_version": run.baseline_version, "calibration_job_id": run.job_id,
                  "failed_checks": run.failed_checks, "last_check": last}))
    alert.action_taken = (f"canary alias cleared: canary runtimes are back on version "
                          f"{run.baseline_version}")
