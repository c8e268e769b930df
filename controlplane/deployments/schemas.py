"""API shapes for deployments, threshold sets, aliases and the audit log."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from controlplane.request_models import RequestModel
from exitplane.wire import (
    DEFAULT_EXIT_LAYERS_RULE,
    HEAD_DIGEST_PATTERN,
    INT32,
    MODEL_REVISION_PATTERN,
    NAME_PATTERN,
    Layer,
    Origin,
    Signal,
    default_exit_layers,
)

Policy = Literal["auto", "canary", "approval"]
FallbackMode = Literal["never_exit", "last_good"]
AliasName = Literal["active", "conservative", "canary"]


# A deployment's lineage: '' names none (nothing is compared), else what runtimes report.
NamedHeadDigest = Annotated[str, Field(max_length=71, pattern=f"^$|{HEAD_DIGEST_PATTERN}",
                                       description=(
    "digest of the exit heads the runtimes must serve (e.g. the artifact's sha256); '' names "
    "none"))]
NamedModelRevision = Annotated[str, Field(max_length=128, pattern=f"^$|{MODEL_REVISION_PATTERN}",
                                          description=(
    "the model revision the runtimes must serve (a commit, a tag or the model file's sha256); "
    "'' names none"))]


RETUNE = ("recalibrate on a schedule every this many seconds, through the deployment's "
          "promotion policy; none: only on drift, an opportunity or an operator's request")
SHADOW_MIN = ("the lowest shadow rate the control plane may ask runtimes for (the share of "
              "tokens run to full depth to watch quality)")
SHADOW_MAX = "the highest shadow rate the control plane may ask for; equal to the minimum: fixed"
DELTA_ANSWER = ("the answer target: the largest share of answers that may differ from full "
                "depth, certified with probability 1 - epsilon on shadow requests; null: none")
SHADOW_REQUEST_RATE = ("the share of whole requests runtimes serve at full depth as shadow "
                       "requests (the answer target's evidence); null: runtimes apply their own")


def _check_shadow_bounds(low: float | None, high: float | None) -> None:
    """Refuse bounds whose minimum exceeds their maximum."""
    if low is not None and high is not None and low > high:
        raise ValueError(f"shadow_rate_min ({low:g}) must not exceed shadow_rate_max ({high:g})")


class DeploymentCreate(RequestModel):

    name: str = Field(pattern=NAME_PATTERN, description="lowercase letters, digits, _ . -")
    model_ref: str = Field(min_length=1, max_length=500)
    head_digest: NamedHeadDigest = ""
    model_revision: NamedModelRevision = ""
    num_layers: int = Field(ge=2, le=1024)
    exit_layers: list[Layer] | None = Field(default=None, description=(
        f"strictly increasing, in [1, num_layers - 1]; default: {DEFAULT_EXIT_LAYERS_RULE}"))
    signal: Signal = Signal.learned
    delta: float = Field(default=0.01, gt=0, lt=1)
    epsilon: float = Field(default=0.05, gt=0, lt=1)
    policy: Policy = "auto"
    canary_fraction: float = Field(default=0.1, gt=0, le=1)
    fallback_mode: FallbackMode = "never_exit"
    fallback_margin: float = Field(default=0.05, ge=0, le=1)
    retune_every_s: int | None = Field(default=None, ge=60, le=INT32, description=RETUNE)
    auto_segments: bool = Field(default=False, description=(
        "register segment names that runtime telemetry carries (up to the cap); off: only "
        "declared segments are stored as themselves, any other as 'default'"))
    shadow_rate_min: float = Field(default=0.01, ge=0, le=1, description=SHADOW_MIN)
    shadow_rate_max: float = Field(default=0.2, ge=0, le=1, description=SHADOW_MAX)
    delta_answer: float | None = Field(default=None, gt=0, lt=1, description=DELTA_ANSWER)
    shadow_request_rate: float | None = Field(default=None, ge=0, le=1,
                                              description=SHADOW_REQUEST_RATE)

    @model_validator(mode="after")
    def _shadow_bounds_ordered(self) -> DeploymentCreate:
        _check_shadow_bounds(self.shadow_rate_min, self.shadow_rate_max)
        return self

    @model_validator(mode="after")
    def _exit_layers_within_model(self) -> DeploymentCreate:
        if self.exit_layers is None:
            self.exit_layers = default_exit_layers(self.num_layers)
        layers = self.exit_layers
        if not layers:
            raise ValueError("exit_layers must name at least one layer")
        if sorted(set(layers)) != layers:
            raise ValueError("exit_layers must be strictly increasing")
        if layers[0] < 1 or layers[-1] >= self.num_layers:
            raise ValueError(f"exit_layers must lie in [1, {self.num_layers - 1}]")
        return self


class DeploymentUpdate(RequestModel):

    delta: float | None = Field(default=None, gt=0, lt=1)
    epsilon: float | None = Field(default=None, gt=0, lt=1)
    policy: Policy | None = None
    canary_fraction: float | None = Field(default=None, gt=0, le=1)
    fallback_mode: FallbackMode | None = None
    fallback_margin: float | None = Field(default=None, ge=0, le=1)
    retune_every_s: int | None = Field(default=None, ge=0, le=INT32, description=(
        f"{RETUNE}; 0 turns the schedule off"))
    auto_segments: bool | None = None
    head_digest: NamedHeadDigest | None = None
    model_revision: NamedModelRevision | None = None
    shadow_rate_min: float | None = Field(default=None, ge=0, le=1, description=SHADOW_MIN)
    shadow_rate_max: float | None = Field(default=None, ge=0, le=1, description=SHADOW_MAX)
    delta_answer: float | None = Field(default=None, gt=0, lt=1, description=(
        f"{DELTA_ANSWER}; an explicit null turns the answer target off"))
    shadow_request_rate: float | None = Field(default=None, ge=0, le=1, description=(
        f"{SHADOW_REQUEST_RATE}; an explicit null stops asking"))

    # Fields whose explicit null is a value (off), not "unchanged".
    CLEARABLE: ClassVar[tuple[str, ...]] = ("delta_answer", "shadow_request_rate")

    def changes(self) -> dict:
        """The fields the request sets: those given non-null, and the clearable ones given
        as an explicit null."""
        return self.model_dump(exclude_none=True) | {
            name: None for name in self.CLEARABLE
            if name in self.model_fields_set and getattr(self, name) is None}


class DeploymentRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    name: str
    model_ref: str
    head_digest: str
    model_revision: str
    num_layers: int
    exit_layers: list[int]
    signal: Signal
    delta: float
    epsilon: float
    policy: Policy
    canary_fraction: float
    fallback_mode: FallbackMode
    fallback_margin: float
    retune_every_s: int | None = Field(description=RETUNE)
    auto_segments: bool
    shadow_rate_min: float
    shadow_rate_max: float
    shadow_rate: float | None = Field(description=(
        "the shadow rate the control plane asks runtimes to apply (null: none yet; runtimes "
        "apply their own)"))
    shadow_rate_reason: str = Field(description="why the control plane chose that rate")
    shadow_rate_decided_at: datetime | None
    delta_answer: float | None = Field(default=None, description=DELTA_ANSWER)
    shadow_request_rate: float | None = Field(default=None, description=SHADOW_REQUEST_RATE)
    revision: int
    created_at: datetime
    aliases: dict[str, int] = {}


class ThresholdSetCreate(RequestModel):

    # Values are checked against the deployment by the service (422 names the layer).
    thresholds: dict[int, float]
    # Names, cap and layers are checked by the service too (422 names the segment).
    segments: dict[str, dict[int, float]] | None = Field(
        default=None, description="per-segment thresholds; `thresholds` is the default's")
    signal: Signal | None = None
    reason: str = Field(min_length=1, max_length=2000)
    expected_metrics: dict = Field(default_factory=dict)
    activate: bool = False


class ThresholdSetRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    version: int
    signal: Signal
    thresholds: dict[int, float]
    segments: dict[str, dict[int, float]] | None = None
    head_digest: str | None = None
    origin: Origin
    parent_version: int | None
    calibration_job_id: int | None
    reason: str
    author: str
    expected_metrics: dict
    checksum: str
    created_at: datetime
    aliases: list[str] = []


class AliasMove(RequestModel):

    version: int = Field(ge=1)
    reason: str = Field(min_length=1, max_length=2000)


class Rollback(RequestModel):

    to_version: int | None = Field(default=None, ge=1,
                                   description="default: the version active before this one")
    reason: str = Field(min_length=1, max_length=2000)


class AuditEventRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    actor: str
    action: str
    alias: str | None
    from_version: int | None
    to_version: int | None
    reason: str
    details: dict
    created_at: datetime


class SegmentChange(RequestModel):
    """Why a segment is declared or removed (for the audit log)."""


    reason: str = Field(default="", max_length=500)


class DeclaredSegmentRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    name: str
    origin: Literal["operator", "threshold_set", "telemetry"]
    created_at: datetime
    removed_at: datetime | None


class UndeclaredTraffic(BaseModel):
    """One runtime's tokens stored as `default` because their segment was not in use."""

    runtime_id: str
    tokens: int
    batches: int
    last_minute: datetime


class SegmentRegistryRead(BaseModel):
    """A deployment's segments (in use and removed), its opt-in, and the traffic of names it
    does not have in use over the window."""

    deployment: str
    auto_segments: bool
    max_segments: int
    segments: list[DeclaredSegmentRead]
    undeclared_since: datetime
    undeclared_tokens: int
    undeclared_by_runtime: list[UndeclaredTraffic]
