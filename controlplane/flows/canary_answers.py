"""The canary's answer check, for a deployment with an answer target (`delta_answer`).

Shadow requests (whole requests served at full depth) are a small share of the traffic, far
fewer than the shadow tokens a one-minute window holds, so the answer check reads every
complete shadow request the canary's members served at the candidate version since the canary
started, up to the window's end (`telemetry.shadow_requests`, under the trust rules; each
witness cut to its share, `ShadowRequests.capped`; only members count, as for every canary
figure). Each request is judged under the candidate's thresholds for its segment
(`ShadowRequests.divergence_by_segment`). Requests are independent draws, so the number whose
answer differs is binomial: no design effect.

- failed: P(answer differs) significantly above δ_answer (exact one-sided binomial at the
  window's alpha), on the requests and, from `min_runtimes` witnesses on, without each one
  witness's (`stats.robust_evidence`): a bad candidate is reverted whatever its tokens show;
- inconclusive: the token verdict is clean, but the (1-alpha) upper bound on P(answer differs)
  is above δ_answer, too few requests included: the deployment asks for whole answers within
  δ_answer, so a canary cannot be promoted before its shadow requests show them (after
  `max_inconclusive` such windows the canary pauses for an operator; raise the deployment's
  `shadow_request_rate` to get there sooner);
- otherwise the token verdict stands, with the answer figures beside it.

A deployment without an answer target has no answer check (`answer_check` returns None).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

import numpy as np
from sqlalchemy.orm import Session

from controlplane.calibration.learn_then_test import binomial_upper_bound
from controlplane.deployments.models import Deployment, ThresholdSet
from controlplane.deployments.segment_sets import thresholds_for
from controlplane.deployments.service import in_canary
from controlplane.stats.clustered import binomial_upper_tail
from controlplane.stats.robust_evidence import EvidencePolicy, leave_one_out, runtime_count
from controlplane.telemetry.shadow_requests import shadow_request_evidence


@dataclass(frozen=True)
class AnswerCheck:
    """The canary members' shadow requests at the candidate, judged against δ_answer."""

    delta_answer: float
    requests: int
    differing: int
    p_value: float  # H0: P(answer differs) <= δ_answer; the largest without one witness
    upper_bound: float  # at 1 - alpha; the largest without one witness (1.0: no requests)
    witnesses: int
    since: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return (f"{self.differing}/{self.requests} canary shadow requests answer differently "
                f"from full depth (δ_answer={self.delta_answer:g})")


def answer_check(*, session: Session, deployment: Deployment, candidate: ThresholdSet,
                 segment: str | None, since: datetime, until: datetime, alpha: float,
                 min_runtimes: int, policy: EvidencePolicy | None = None
                 ) -> AnswerCheck | None:
    """The answer check of the canary's members' shadow requests at `candidate` served in
    [since, until) (of `segment`, None: every segment); None without an answer target."""
    if deployment.delta_answer is None:
        return None
    delta_answer = deployment.delta_answer
    layers = sorted(deployment.exit_layers)
    evidence = shadow_request_evidence(
        session=session, deployment_id=deployment.id, width=len(layers), since=since,
        until=until, version=candidate.version, segment=segment)
    member = np.array([in_canary(runtime_id=runtime_id, fraction=deployment.canary_fraction)
                       for runtime_id in evidence.runtimes], dtype=bool)
    evidence = evidence.take(member).capped(policy or EvidencePolicy(
        robust_min_runtimes=min_runtimes))
    differs = evidence.divergence_by_segment(
        lambda name: [thresholds_for(candidate, name)[k] for k in layers]) >= 0
    subsets = [differs, *(differs[mask] for mask in leave_one_out(
        np.asarray(evidence.witnesses, dtype=str), min_runtimes))]
    p_value = max(1.0 if not len(part) else float(binomial_upper_tail(
        int(part.sum()), len(part), delta_answer)) for part in subsets)
    bound = max(float(binomial_upper_bound(int(part.sum()), len(part), alpha))
                for part in subsets)
    return AnswerCheck(delta_answer=delta_answer, requests=len(differs),
                       differing=int(differs.sum()), p_value=p_value, upper_bound=bound,
                       witnesses=runtime_count(evidence.witnesses), since=since.isoformat())


def with_answers(verdict: str, why: str, tests: dict, check: AnswerCheck | None, *,
                 alpha: float) -> tuple[str, str, dict]:
    """The window's (verdict, why, tests) with the answer check applied (module docstring)."""
    if check is None:
        return verdict, why, tests
    tests = tests | {"answers": check.to_dict()}
    if check.p_value <= alpha:
        return "failed", (f"{check.describe()}: significantly above δ_answer "
                          f"(p={check.p_value:.2g})"), tests
    if verdict == "clean" and check.upper_bound > check.delta_answer:
        return "inconclusive", (f"{why}; but {check.describe()}: their {1 - alpha:.0%} upper "
                                f"bound {check.upper_bound:.3f} is above δ_answer, so answers "
                                "are not yet shown within the target"), tests
    if verdict == "clean":
        why = (f"{why}; {check.describe()}, {1 - alpha:.0%} upper bound "
               f"{check.upper_bound:.3f} <= δ_answer")
    return verdict, why, tests
