"""The answers report (GET /v1/deployments/{name}/answers): answer consistency per stored
version and traffic segment over a window, read as `flows.answers` reads it, without the
witnesses the outlier screen sets aside on the window as the what-if reads it
(`flows.what_if.read_evidence`).

It covers the stored versions (1 and up). Requests served under version 0, the built-in
never-exit set a runtime applies before its first pull, are left out: under it no token exits,
so every such answer is the full-depth answer by construction.
"""

from __future__ import annotations

from datetime import datetime

import numpy as np
from sqlalchemy.orm import Session

from controlplane.calibration.answers import AnswerConsistency
from controlplane.calibration.service import CalibrationPolicy
from controlplane.deployments.models import Deployment
from controlplane.deployments.segment_sets import thresholds_for
from controlplane.deployments.segments import known_segments
from controlplane.deployments.service import aliases_of, get_threshold_set
from controlplane.errors import Invalid
from controlplane.flows.answers import NEVER_EXIT_VERSION, answer_consistency, read_answers
from controlplane.flows.what_if import read_evidence
from controlplane.settings import get_settings
from exitplane.wire import DEFAULT_SEGMENT


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
