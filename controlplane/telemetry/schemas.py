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


# -- per traffic segment --------------------------------------------------------------

class SegmentLayerRate(BaseModel):
    layer: int
    tokens: int = Field(description="tokens whose check at this layer ran")
    exits: int
    exit_rate: float | None


class SegmentFiguresRead(BaseModel):
    segment: str
    tokens: int
    early_exits: int = Field(description="tokens that left before full depth")
    exit_rate: float | None = Field(description="early_exits / tokens")
    mean_depth: float | None = Field(description="layers run per token on average")
    shadow_tokens: int
    policy_exits: int = Field(description="shadow tokens the applied policy would have let "
                                          "out early")
    policy_mismatches: int = Field(description="of those, the ones whose answer differs from "
                                               "full depth")
    disagreement: float | None = Field(description=(
        "policy_mismatches / shadow_tokens: the disagreement δ bounds"))
    exit_disagreement: float | None = Field(description="policy_mismatches / policy_exits")
    layers: list[SegmentLayerRate]


class SegmentReport(BaseModel):
    deployment: str
    since: datetime
    delta: float = Field(description="the deployment's maximum disagreement δ")
    segments: list[SegmentFiguresRead] = Field(description=(
        "`default` first, then each registered segment (also those without traffic in the "
        "window); at most EXITPLANE_MAX_SEGMENTS_PER_DEPLOYMENT + 1 rows"))
    records_sampled: bool = Field(False, description=(
        "true when runtimes aggregate at the edge: per-token records then exist only for "
        "shadow tokens and a sampled share of the others; these figures count every token"))
    raw_sample_rate: float | None = None
