"""Thin routes of the operating curve: evaluate any threshold set on stored shadow evidence
(`flows.what_if`), read the curve the workers keep (`flows.operating_curve`; the route only
reads the stored row) and the answer consistency of each version on shadow requests
(`flows.answers`)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query, Request
from pydantic import AwareDatetime, BaseModel, Field

from controlplane.auth.deps import OperatorPrincipal
from controlplane.calibration.service import CalibrationPolicy
from controlplane.db import SessionDep
from controlplane.deployments.service import get_deployment
from controlplane.errors import NotFound, error_answer
from controlplane.flows.answers_report import report
from controlplane.flows.operating_curve import latest_curve
from controlplane.flows.what_if import MAX_WINDOW, what_if, window_bounds
from controlplane.request_models import RequestModel
from exitplane.wire import DEFAULT_SEGMENT, INT32, SegmentName

router = APIRouter(prefix="/v1/deployments/{name}", tags=["operating curve"])

RuntimeId = Annotated[str, Field(min_length=1, max_length=128)]


class WhatIfRequest(RequestModel):
    """One threshold set to evaluate (exactly one of version, thresholds, delta) and the
    evidence to evaluate it on."""


    version: int | None = Field(default=None, ge=1, le=INT32,
                                description="a stored version of the deployment")
    thresholds: dict[str, float] | None = Field(
        default=None, max_length=1024, description=(
            "a hand-edited set: {exit layer: threshold in [0, 1]}; layers not named never exit"))
    delta: float | None = Field(default=None, gt=0, lt=1, description=(
        "the set a calibration would choose on the window at this δ (nothing is published)"))
    epsilon: float | None = Field(default=None, gt=0, lt=1, description=(
        "with delta: the calibration's ε (default: the deployment's)"))
    window_s: float | None = Field(default=None, gt=0, le=MAX_WINDOW.total_seconds(),
                                   description="the last this many seconds (default 3600)")
    since: AwareDatetime | None = Field(default=None, description="window start")
    until: AwareDatetime | None = Field(default=None, description="window end (default: now)")
    segment: SegmentName | None = Field(default=None, description=(
        "this traffic segment's shadow tokens (none: every segment's, each with its map)"))
    runtimes: list[RuntimeId] | None = Field(default=None, max_length=256, description=(
        "these runtimes' shadow tokens only (the trust rules still apply)"))


class WhatIfRead(BaseModel):
    """What the set would do on the window's shadow evidence."""

    thresholds: dict[str, float]
    source: str = Field(description="version, set or calibration")
    version: int | None
    tokens: int = Field(description="shadow tokens evaluated, after the trust rules")
    requests: int
    witnesses: int
    exit_rate_by_layer: dict[str, float]
    exit_rate: float
    disagreement: float
    disagreement_bound: float = Field(description="upper bound at 1-ε, per request")
    certified: bool = Field(description="the bound is within δ")
    delta: float
    epsilon: float
    mean_depth: float
    mean_checks: float
    layers_speedup: float
    speedup: float = Field(description="through the cost model; else the layers ratio")
    net_saving: float = Field(description=(
        "share of full-depth time saved, net of exit checks and shadow tokens"))
    shadow_share: float
    cost_model: dict | None = Field(description="the fitted cost model; null: layers ratio")
    answers: dict | None = Field(default=None, description=(
        "answer consistency on the window's shadow requests: requests, identical_share, "
        "differing_share, differing_bound (at 1-ε), divergence positions; null: none"))


class AnswerSegmentRead(BaseModel):
    """One version's map for one segment, on the shadow requests served under it there."""

    segment: str
    thresholds: dict[str, float]
    requests: int = Field(description="complete shadow requests, after the trust rules")
    differing: int = Field(description="requests whose answer would differ from full depth")
    identical_share: float | None = Field(description="share answered exactly as full depth")
    differing_share: float | None
    differing_bound: float | None = Field(description=(
        "upper bound at 1-ε on the share of answers that differ (Clopper-Pearson)"))
    within_target: bool | None = Field(description=(
        "the bound is within the deployment's delta_answer; null: no target or no requests"))
    divergence_quantiles: dict[str, float] = Field(description=(
        "first divergence positions (tokens into the answer) of the differing requests"))
    divergence_histogram: list[dict] = Field(description=(
        "differing requests by first divergence position: {from, to (null: open), requests}"))
    mean_tokens: float | None


class AnswerVersionRead(BaseModel):
    version: int
    segments: list[AnswerSegmentRead]


class AnswersRead(BaseModel):
    """Answer consistency per version and segment over a window (docs/concepts/statistics.md,
    "The answer guarantee")."""

    deployment: str
    since: datetime
    until: datetime
    epsilon: float
    delta_answer: float | None
    active_version: int | None
    requests: int = Field(description="complete shadow requests read, after the trust rules")
    versions: list[AnswerVersionRead]


class OperatingCurveRead(BaseModel):
    """The stored operating curve of one segment (docs/concepts/operating-curve.md)."""

    deployment: str
    segment: str
    computed_at: str
    window: dict
    evidence: dict
    points: list[dict]
    marks: dict
    best: dict | None
    gap: dict | None
    opportunity: dict | None


@router.post("/what-if", response_model=WhatIfRead,
             responses={404: error_answer("no such deployment or version"),
                        422: error_answer("not exactly one set named, a set that does not "
                                          "fit the exit layers, or too few shadow samples")})
def evaluate_what_if(name: str, spec: WhatIfRequest, session: SessionDep,
                     principal: OperatorPrincipal, request: Request) -> WhatIfRead:
    """Evaluate a threshold set on the stored shadow evidence of a window: exit rates,
    disagreement and its bound, mean depth, predicted speed-up and net saving."""
    deployment = get_deployment(session=session, name=name)
    found = what_if(session=session, deployment=deployment, version=spec.version,
                    thresholds=spec.thresholds, delta=spec.delta, epsilon=spec.epsilon,
                    window_s=spec.window_s, since=spec.since, until=spec.until,
                    segment=spec.segment, runtimes=spec.runtimes,
                    policy=CalibrationPolicy.from_settings(request.app.state.settings))
    return WhatIfRead.model_validate(found.as_dict())


@router.get("/answers", response_model=AnswersRead,
            responses={404: error_answer("no such deployment or version"),
                       422: error_answer("an unknown segment or a bad window")})
def answers(name: str, session: SessionDep, principal: OperatorPrincipal,
            window: Annotated[int, Query(ge=60, le=int(MAX_WINDOW.total_seconds()),
                                         description="the last this many seconds")] = 3600,
            segment: Annotated[SegmentName | None, Query(description=(
                "this traffic segment only (default: each segment)"))] = None,
            version: Annotated[int | None, Query(ge=1, le=INT32, description=(
                "this stored version only (default: each stored version that served shadow "
                "requests in the window; requests under the built-in never-exit version 0 "
                "are left out)"))] = None) -> AnswersRead:
    """Answer consistency per version and segment: of the window's complete shadow requests
    served under a version in a segment, the share its map would have answered exactly as
    full depth, the bound on the share that would differ, and where the others diverged."""
    deployment = get_deployment(session=session, name=name)
    since, until = window_bounds(window_s=window, since=None, until=None)
    return AnswersRead.model_validate(report(session=session, deployment=deployment,
                                             since=since, until=until, segment=segment,
                                             version=version))


@router.get("/operating-curve", response_model=OperatingCurveRead,
            responses={404: error_answer("no curve drawn yet for this segment")})
def operating_curve(name: str, session: SessionDep, principal: OperatorPrincipal,
                    segment: Annotated[SegmentName, Query()] = DEFAULT_SEGMENT
                    ) -> OperatingCurveRead:
    """The operating curve the workers last drew for a segment (never computed here)."""
    deployment = get_deployment(session=session, name=name)
    found = latest_curve(session, deployment, segment)
    if found is None:
        raise NotFound(f"no operating curve of deployment {name!r}, segment {segment!r} yet: "
                       "the workers draw one every EXITPLANE_OPERATING_CURVE_INTERVAL_S once "
                       "shadow tokens arrive")
    return OperatingCurveRead.model_validate(found)
