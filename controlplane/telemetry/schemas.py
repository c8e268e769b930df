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


class CostModelRead(BaseModel):
    """Microseconds per token: `overhead_us + layer_us * depth + check_us * checks`."""

    overhead_us: float
    layer_us: float
    check_us: float
    num_layers: int
    tokens: int = Field(description="timed tokens the fit used")
    full_depth_us: float = Field(description="one token at full depth with no exit checks")


class LineageCostModel(BaseModel):
    model_revision: str | None
    head_digest: str | None
    model: CostModelRead | None = Field(description="null: too little timed telemetry")
    reason: str | None = Field(description="why there is no model")


class SavingsTime(BaseModel):
    """Seconds of accelerator time over the modelled tokens; net_saved_s = saved_by_exits_s
    - checks_s - shadow_s + unexplained_s."""

    full_depth_s: float = Field(description="the tokens at full depth with no exit checks")
    spent_s: float = Field(description="measured where timed, modelled where not")
    net_saved_s: float = Field(description="full_depth_s - spent_s; negative: a loss")
    saved_by_exits_s: float = Field(description="layers non-shadow tokens skipped")
    checks_s: float = Field(description="spent on exit checks of non-shadow tokens")
    shadow_s: float = Field(description="spent on shadow tokens' checks (they run full depth)")
    unexplained_s: float = Field(description="measured minus modelled time")


class SavingsCost(BaseModel):
    """The time figures in accelerator-hours, and at `per_accelerator_hour` in `unit`."""

    unit: str = Field(description="EXITPLANE_ACCELERATOR_COST_UNIT")
    per_accelerator_hour: float = Field(description="EXITPLANE_ACCELERATOR_HOUR_COST")
    full_depth_hours: float
    spent_hours: float
    net_saved_hours: float = Field(description="negative: a loss")
    full_depth: float
    spent: float
    net_saved: float = Field(description="negative: a loss")


class SavingsFigures(BaseModel):
    tokens: int = Field(description="tokens served in the window")
    timed_tokens: int = Field(description="of those, tokens that reported their cost")
    shadow_tokens: int
    modelled_tokens: int = Field(description="tokens the time figures cover")
    layers_saved: int = Field(description="layer computations non-shadow tokens skipped")
    time: SavingsTime | None = Field(description="null: no cost model")
    speedup: float | None = Field(description="full_depth_s / spent_s, measured")
    pays: bool | None = Field(description="net_saved_s > 0; false: early exit cost time")
    cost: SavingsCost | None


class DeploymentSavings(SavingsFigures):
    deployment: str
    num_layers: int
    segment: str | None
    runtime_id: str | None
    layer_speedup: float | None = Field(description="num_layers / mean depth (layers only)")
    cost_model: CostModelRead | None
    cost_model_reason: str | None
    cost_models: list[LineageCostModel] = Field(description="one per lineage of the runtimes")
    since: datetime
    until: datetime


class FleetSavingsTotal(SavingsFigures):
    deployments: int


class FleetSavings(BaseModel):
    since: datetime
    until: datetime
    segment: str | None
    runtime_id: str | None
    deployments: list[DeploymentSavings]
    total: FleetSavingsTotal
