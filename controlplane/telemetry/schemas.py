"""API shapes for telemetry reads."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel


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
