"""API shapes for recalibration jobs, operator decisions and the canary."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from controlplane.calibration.models import CANARY_STATUSES, JOB_STATUSES
from controlplane.request_models import RequestModel
from exitplane.wire import INT32, SegmentName

JobStatus = Literal[JOB_STATUSES]
CanaryStatus = Literal[CANARY_STATUSES]


class CalibrationCreate(RequestModel):

    since: AwareDatetime | None = Field(
        default=None, description="start of the shadow-sample window (default: lookback)")
    until: AwareDatetime | None = Field(
        default=None, description="end of the window (default: when the job runs)")
    reason: str = Field(default="", max_length=2000)
    segment: SegmentName | None = Field(
        default=None, description="recalibrate this traffic segment alone (its shadow tokens, "
                                  "its map); none: the whole deployment")


class Decision(RequestModel):

    reason: str = Field(min_length=1, max_length=2000)


class CanaryCreate(RequestModel):
    """A checked canary of a published version, on the deployment's canary fraction."""


    version: int = Field(ge=1, le=INT32, description=(
        "the published threshold set version the canary runtimes apply (not the active one)"))
    reason: str = Field(default="", max_length=2000,
                        description="why (added to the audit log's own reason)")
    canary_fraction: float | None = Field(default=None, gt=0, le=1, description=(
        "set the deployment's canary fraction in the same transaction (nothing changes when "
        "the start is refused); absent: the deployment's own"))


class CalibrationJobRead(BaseModel):
    """A job without its curve and per-layer match curves (see CalibrationJobDetail)."""

    model_config = ConfigDict(from_attributes=True)

    id: int
    trigger: str
    alert_id: int | None
    requested_by: str
    reason: str
    since: datetime
    until: datetime | None
    segment: str | None = None
    status: JobStatus
    status_reason: str
    attempts: int
    summary: dict
    result_version: int | None
    promotion: str | None
    decided_by: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    updated_at: datetime


class CalibrationJobDetail(CalibrationJobRead):
    """Per layer: threshold, empirical risk, bound, p-value, expected exit rate; the curve."""

    layers: list[dict]
    curve: list[dict]


class CalibrationRequested(BaseModel):
    job: CalibrationJobRead
    created: bool = Field(description="false: a job was already open and is returned instead")


class CanaryRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    version: int
    baseline_version: int
    job_id: int | None
    status: CanaryStatus
    status_reason: str
    clean_windows: int
    failed_checks: int
    inconclusive_windows: int
    next_window_start: datetime
    checks: list[dict]
    started_at: datetime
    finished_at: datetime | None
