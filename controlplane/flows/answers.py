"""Answer consistency read from shadow requests: for a window, per threshold version and
traffic segment, how many shadow requests the version's map for that segment would have
answered exactly as full depth did, the bound on the share that would differ, and where the
others first diverged (`calibration.answers`); and the same figures for any set the what-if and
the operating curve evaluate.

The evidence is the window's complete shadow requests under the trust rules every evidence read
applies (`telemetry.trust`: excluded runtimes, lineage, witnesses set aside, backdating), without
the witnesses the outlier screen set aside on the window's shadow tokens, each witness cut to its
share (`ShadowRequests.capped`).

The report per version and segment is `flows.answers_report`.
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
from controlplane.settings import get_settings
from controlplane.stats.robust_evidence import runtime_count
from controlplane.telemetry.shadow_requests import ShadowRequests, shadow_request_evidence

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
