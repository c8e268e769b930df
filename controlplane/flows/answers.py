"""Answer consistency read from shadow requests: for a window, per threshold version and
traffic segment, how many shadow requests the version's map for that segment would have
answered exactly as full depth did, the bound on the share that would differ, and where the
others first diverged (`calibration.answers`); and the same figures for any set the what-if and
the operating curve evaluate.

The evidence is the window's complete shadow requests under the trust rules every evidence read
applies (`telemetry.trust`: excluded runtimes, lineage, witnesses set aside, backdating), without
the witnesses the outlier screen set aside on the window's shadow tokens, each witness cut to its
share (`ShadowRequests.capped`).

The report per version (`report`) covers the stored versions (1 and up). Requests served under
version 0, the built-in never-exit set a runtime applies before its first pull, are left out:
under it no token exits, so every such answer is the full-depth answer by construction.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from datetime import datetime

import numpy as np
from sqlalchemy.orm import Session

from controlplane.calibration.answers import (
    AnswerConsistency,
    consistency,
)
from controlplane.calibration.service import CalibrationPolicy
from controlplane.deployments.models import Deployment
from controlplane.deployments.segment_sets import thresholds_for
from controlplane.deployments.segments import known_segments
from controlplane.deployments.service import aliases_of, get_threshold_set
from controlplane.errors import Invalid
from controlplane.settings import get_settings
from controlplane.stats.robust_evidence import runtime_count
from controlplane.telemetry.shadow_requests import ShadowRequests, shadow_request_evidence
from exitplane.wire import DEFAULT_SEGMENT

# The version of the built-in never-exit set a runtime serves before its first pull (no stored
# threshold set has it).
NEVER_EXIT_VERSION = 0


def read_answers(*, session: Session, deployment: Deployment, since: datetime,
                 until: datetime, segment: str | None = None, version: int | None = None,
                 runtimes: Collection[str] | None = None, set_aside: Collection[str] = (),
                 policy: CalibrationPolicy | None = None, seed: int = 0) -> ShadowRequests:
    """The window's shadow requests under the trust rules (module docstring): of `segment`,
    served under `version` and from `runtimes` when given; without the witnesses in
    `set_aside`."""
    policy = policy or CalibrationPolicy.from_settings(get_settings())
    found = shadow_request_evidence(session=session, deployment_id=deployment.id,
                                    width=len(deployment.exit_layers), since=since,
                                    until=until, version=version, segment=segment)
    keep = np.ones(len(found), dtype=bool)
    if runtimes:
        keep &= np.isin(np.asarray(found.runtimes, dtype=str), list(runtimes))
    if set_aside:
        keep &= ~np.isin(np.asarray(found.witnesses, dtype=str), list(set_aside))
    if not keep.all():
        found = found.take(keep)
    return found.capped(policy.evidence, seed=seed)


def answer_consistency(evidence: ShadowRequests, thresholds_of: Callable[[str], list[float]],
                       *, epsilon: float) -> AnswerConsistency | None:
    """One set's answer figures on `evidence`, each request under the thresholds
    `thresholds_of(its segment)` gives (exit-layer order); None without shadow requests."""
    if len(evidence) == 0:
        return None
    divergence = evidence.divergence_by_segment(thresholds_of)
    return consistency(divergence, epsilon=epsilon, tokens=np.diff(evidence.offsets),
                       witnesses=runtime_count(evidence.witnesses))


def report(*, session: Session, deployment: Deployment, since: datetime, until: datetime,
           segment: str | None = None, version: int | None = None) -> dict:
    """Answer consistency per version and segment over the window (module docstring): each
    stored version served with shadow requests in it (or `version`), each segment (or
    `segment`), that version's map for the segment on the requests served under it in that
    segment; without the witnesses the outlier screen sets aside on the window, as the what-if
    reads it (`flows.what_if.read_evidence`)."""
    if segment not in (None, DEFAULT_SEGMENT) and segment not in known_segments(
            session=session, deployment_id=deployment.id):
        raise Invalid(f"deployment {deployment.name!r} knows no traffic segment {segment!r}")
    if version is not None:
        get_threshold_set(session=session, deployment=deployment, version=version)  # 404
    # flows.what_if reads its evidence through this module: imported here, not at the top
    from controlplane.flows.what_if import read_evidence

    policy = CalibrationPolicy.from_settings(get_settings())
    screened = read_evidence(session=session, deployment=deployment, since=since, until=until,
                             segment=segment, policy=policy)
    evidence = read_answers(session=session, deployment=deployment, since=since, until=until,
                            segment=segment, version=version, set_aside=screened.set_aside,
                            policy=policy)
    evidence = evidence.take(evidence.versions != NEVER_EXIT_VERSION)
    layers = sorted(int(layer) for layer in deployment.exit_layers)
    served = sorted(set(evidence.versions.tolist())) if version is None else [version]
    versions = []
    for number in served:
        chosen = get_threshold_set(session=session, deployment=deployment, version=number)
        under = evidence.take(evidence.versions == number)
        names = sorted(set(under.segments)) if segment is None else [segment]
        rows = []
        for name in names:
            mine = under.take(np.asarray(under.segments, dtype=object) == name)
            by_layer = thresholds_for(chosen, name)
            figures = answer_consistency(mine, lambda _, m=by_layer: [m[k] for k in layers],
                                         epsilon=deployment.epsilon)
            rows.append({"segment": name,
                         "thresholds": {str(k): by_layer[k] for k in layers},
                         **_figures(figures, deployment)})
        versions.append({"version": number, "segments": rows})
    return {"deployment": deployment.name, "since": since, "until": until,
            "epsilon": deployment.epsilon, "delta_answer": deployment.delta_answer,
            "active_version": aliases_of(session=session, deployment=deployment).get("active"),
            "requests": len(evidence), "versions": versions}


def _figures(figures: AnswerConsistency | None, deployment: Deployment) -> dict:
    """A set's figures for an answer, with whether its bound meets the answer target (None
    without a target or without requests)."""
    if figures is None:
        return {"requests": 0, "differing": 0, "identical_share": None,
                "differing_share": None, "differing_bound": None, "within_target": None,
                "divergence_quantiles": {}, "divergence_histogram": [], "mean_tokens": None}
    out = figures.to_dict()
    out.pop("epsilon")
    out.pop("witnesses")
    target = deployment.delta_answer
    return out | {"within_target": None if target is None
                  else figures.differing_bound <= target}


def with_answers(evidence: ShadowRequests, sets: list[dict], *, layers: list[int],
                 epsilon: float, delta_answer: float | None) -> list[dict]:
    """`sets` (dicts with "thresholds": {"<layer>": t}, e.g. operating-curve points and
    marks) each with "answers": its answer figures on `evidence` (all sets at once), None
    without shadow requests."""
    if not sets:
        return sets
    if len(evidence) == 0:
        return [item | {"answers": None} for item in sets]
    matrix = np.array([[float(item["thresholds"][str(layer)]) for layer in layers]
                       for item in sets])
    divergence = evidence.divergence(matrix)
    tokens, witnesses = np.diff(evidence.offsets), runtime_count(evidence.witnesses)
    out = []
    for k, item in enumerate(sets):
        figures = consistency(divergence[:, k], epsilon=epsilon, tokens=tokens,
                              witnesses=witnesses).to_dict()
        out.append(item | {"answers": figures | {"delta_answer": delta_answer}})
    return out
