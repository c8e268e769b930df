"""API shapes for runtimes."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from controlplane.request_models import RequestModel


class RuntimeRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    runtime_id: str
    applied_version: int | None
    applied_checksum: str | None
    ready: bool
    error: str | None
    refused_version: int | None = Field(
        default=None, description="the version of the threshold set the runtime refused last, "
        "while that refusal stands (`error` says why); null: it refuses none")
    spooled_batches: int
    dropped_records: int
    first_seen: datetime
    last_seen: datetime
    # Lineage as the last heartbeat reported it (None: unknown), and the last report (heartbeat
    # or telemetry) that differed from the deployment's: when and what it named.
    model_revision: str | None = None
    head_digest: str | None = None
    lineage_mismatch_at: datetime | None = None
    mismatch_model_revision: str | None = None
    mismatch_head_digest: str | None = None


class RuntimesRemoved(BaseModel):
    removed: list[str] = Field(description="the runtime ids removed")


class RuntimeOutlierRead(BaseModel):
    """A runtime set aside because its shadow evidence differed from the rest of its fleet."""

    model_config = ConfigDict(from_attributes=True)

    id: int
    runtime_id: str
    status: Literal["set_aside", "cleared"] = Field(
        description="set_aside (its samples count for nothing) or cleared")
    version: int
    segment: str
    summary: str
    evidence: dict = Field(description="the test that set it aside: statistic, layer, its rate "
                                       "and the fleet's, z, p-value and level, sample sizes")
    alert_id: int | None
    detected_at: datetime
    cleared_at: datetime | None
    cleared_by: str | None
    clear_reason: str


class OutlierClear(RequestModel):
    reason: str = Field(min_length=1, max_length=2000,
                        description="why the runtime's evidence may count again (audited)")
