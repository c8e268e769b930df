"""The answer watch: do the active version's answers still equal full depth often enough?

A deployment with an answer target (`delta_answer`) promises that the share of requests whose
whole answer differs from the full-depth answer stays within δ_answer. Each drift check reads
the recent window's complete shadow requests of the active version, per traffic segment, under
the trust rules of every evidence read (`telemetry.shadow_requests.shadow_request_evidence`:
excluded runtimes, lineage, witnesses set aside, backdating), cuts each witness to its share of
the requests (`stats.robust_evidence.cap_runtime_share`, whole requests), and computes for each
request whether the segment's thresholds would have changed its answer and where first
(`ShadowRequests.divergence`, exact under greedy decoding with an exact KV policy).

Requests are drawn for shadowing at random and independently, so the number that differ among
n is Binomial(n, P(answer differs)): no design effect. The test is one-sided and exact,
H0: P(answer differs) <= δ_answer, and an `answer_regression` (critical; the fallback reacts as
to a `quality_regression`) fires when its p-value is at most the per-look level. The looks share
an hourly false-alarm budget like the quality test's (`drift_quality_alpha_per_hour`): one look
per check and segment, so each is tested at budget x interval / 3600 / segments. From
`evidence_robust_min_runtimes` witnesses on, the p-value is the largest over the window and the
window without each one witness (`stats.robust_evidence.robust_p_values`): no single witness
raises it. A segment with fewer than `drift_answer_min_requests` requests is not checked (its
open alert neither refreshes nor clears). docs/concepts/statistics.md, "The answer guarantee".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime, timedelta

import numpy as np
from sqlalchemy.orm import Session

from controlplane.alerts.kinds import AlertKind
from controlplane.alerts.service import Condition
from controlplane.deployments.models import Deployment
from controlplane.drift.window_checks import DriftOptions
from controlplane.settings import get_settings
from controlplane.stats.answers import AnswerSummary
from controlplane.stats.clustered import binomial_upper_tail
from controlplane.stats.robust_evidence import (
    EvidencePolicy,
    robust_p_values,
    runtime_count,
)
from controlplane.telemetry.shadow_requests import ShadowRequests, shadow_request_evidence
from exitplane.wire import DEFAULT_SEGMENT

ANSWER_REGRESSION = AlertKind.ANSWER_REGRESSION
SEVERITY = "critical"

Observed = dict[str, tuple[list[Condition], set[str]]]


def answer_look_alpha(options: DriftOptions) -> float:
    """The level each segment's answer test is tested at in one check (module docstring)."""
    looks_per_hour = 3600.0 / options.check_interval_s * options.segments_checked
    return options.quality_alpha_per_hour / looks_per_hour


def p_value_above(differs: np.ndarray, delta_answer: float) -> float:
    """Exact one-sided p-value of H0: P(answer differs) <= δ_answer from each request's
    outcome (bool (n,)): P(Binomial(n, δ_answer) >= differing); 1.0 without requests."""
    n = len(differs)
    return 1.0 if n == 0 else float(binomial_upper_tail(int(np.sum(differs)), n, delta_answer))


def answer_condition(evidence: ShadowRequests, thresholds: list[float], *, delta_answer: float,
                     alpha: float, min_requests: int, policy: EvidencePolicy,
                     window: Mapping) -> tuple[Condition | None, bool]:
    """(an `answer_regression` or None, whether the window had enough requests to be checked)
    for one segment's requests served at full depth and its thresholds (exit-layer order)."""
    # the fixed seed: consecutive checks judge the same requests
    evidence = evidence.capped(policy, seed=0)
    if len(evidence) < min_requests:
        return None, False
    summary = AnswerSummary(evidence.divergence(np.asarray([thresholds], dtype=float)))
    differs = summary.divergence[:, 0] >= 0
    witnesses = np.asarray(evidence.witnesses, dtype=str)
    p_value = float(robust_p_values(
        lambda mask: np.array([p_value_above(differs if mask is None else differs[mask],
                                             delta_answer)]),
        witnesses, policy.robust_min_runtimes)[0])
    if p_value > alpha:
        return None, True
    n, k = summary.requests, int(summary.differing[0])
    positions = summary.positions(0)
    tokens = np.diff(evidence.offsets)
    text = (f"answers differ from full depth in {k}/{n} = {k / n:.1%} of shadow requests, "
            f"above δ_answer={delta_answer:g} (exact binomial, p={p_value:.2g} <= {alpha:.2g} "
            "per look)")
    found = {
        "test": "binomial_one_sided_requests", "p_value": p_value, "alpha": alpha,
        "delta_answer": delta_answer, "requests": n, "differing": k,
        "identical_share": (n - k) / n, "differing_share": k / n,
        "median_divergence_position": float(np.median(positions)),
        "mean_tokens": float(tokens.mean()), "thresholds": [float(t) for t in thresholds],
        "witnesses": runtime_count(witnesses), "window": dict(window)}
    return Condition(kind=ANSWER_REGRESSION, severity=SEVERITY, summary=text,
                     evidence=found), True


def watch_answers(*, session: Session, deployment: Deployment, observed: Observed,
                  thresholds: Mapping[str, list[float]], version: int, activated_at: datetime,
                  now: datetime, options: DriftOptions) -> Observed:
    """`observed` (the drift check's conditions and checked kinds per segment) with each
    segment's answer check added, when the deployment has an answer target; `thresholds`: the
    thresholds each segment applies under the active `version`, in exit-layer order."""
    delta_answer = deployment.delta_answer
    if delta_answer is None or not thresholds:
        return observed
    settings = get_settings()
    policy = EvidencePolicy.from_settings(settings)
    alpha = answer_look_alpha(options.for_segments(len(thresholds)))
    since = max(now - timedelta(seconds=options.recent_s), activated_at)
    out = dict(observed)
    for segment, by_layer in thresholds.items():
        evidence = shadow_request_evidence(
            session=session, deployment_id=deployment.id, width=len(deployment.exit_layers),
            since=since, until=now, version=version, segment=segment)
        window = {"since": since.isoformat(), "until": now.isoformat(), "version": version,
                  "segment": segment}
        condition, checked = answer_condition(
            evidence, list(by_layer), delta_answer=delta_answer, alpha=alpha,
            min_requests=settings.drift_answer_min_requests, policy=policy, window=window)
        conditions, kinds = out.get(segment, ([], set()))
        if condition is not None and segment != DEFAULT_SEGMENT:
            condition = replace(condition, segment=segment,
                                summary=f"segment {segment}: {condition.summary}")
        out[segment] = ([*conditions, *([condition] if condition else [])],
                        kinds | ({ANSWER_REGRESSION} if checked else set()))
    return out
