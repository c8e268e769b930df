"""API shapes for telemetry reads."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field


class IngestAck(BaseModel):
    batch_id: str
    accepted: int
    duplicate: bool
    queued: bool = False


class ExitRatePoint(BaseModel):
    minute: datetime
    layer: int
    tokens: int
    exits: int
    exit_rate: float | None
    shadow_total: int
    shadow_matches: int
    policy_exits: int
    policy_mismatches: int


class DisagreementPoint(BaseModel):
    minute: datetime
    shadow_tokens: int
    mismatches: int
    disagreement: float | None


class TelemetryCounts(BaseModel):
    records: int
    batches: int
    shadow_samples: int
    tokens: int = Field(description="tokens counted in the rollups (records and aggregates)")
    aggregate_batches: int = 0
    records_sampled: bool = Field(False, description=(
        "true when runtimes aggregate at the edge: per-token records then exist only for "
        "shadow tokens and a sampled share (raw_sample_rate) of the others; rollups, exit "
        "rates and histograms still count every token"))
    raw_sample_rate: float | None = Field(None, description=(
        "the share of non-shadow tokens shipped as records, from the latest aggregate batch "
        "of the last hour"))
