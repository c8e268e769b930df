"""API shapes for alerts, alert hooks and deliveries."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, HttpUrl

from controlplane.alerts.models import HOOK_KINDS, KINDS, SEVERITIES, STATUSES
from controlplane.request_models import RequestModel

HookKind = Literal[HOOK_KINDS]
Severity = Literal[SEVERITIES]
AlertStatus = Literal[STATUSES]
AlertKindName = Literal[KINDS]


class AlertRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    deployment: str = ""
    kind: AlertKindName
    layer: int | None
    segment: str = "default"
    severity: Severity
    dedup_key: str
    status: AlertStatus
    summary: str
    evidence: dict
    action_taken: str
    report_url: str | None = None
    fired_at: datetime
    last_seen_at: datetime
    clear_since: datetime | None
    acknowledged_at: datetime | None
    acknowledged_by: str | None
    resolved_at: datetime | None
    resolved_by: str | None
    resolution: str


class AlertAck(RequestModel):
    note: str = Field(default="", max_length=2000)


class AlertResolve(RequestModel):
    reason: str = Field(min_length=1, max_length=2000)


class HookCreate(RequestModel):
    name: str = Field(min_length=1, max_length=200)
    kind: HookKind
    url: HttpUrl
    deployment: str | None = Field(default=None, description="none: every deployment")
    min_severity: Severity = "warning"
    secret: str | None = Field(default=None, min_length=16, max_length=200,
                               description="webhook HMAC key; generated when omitted")
    routing_key: str | None = Field(default=None, min_length=1, max_length=200,
                                    description="PagerDuty integration key (required there)")
    enabled: bool = True
    reason: str = Field(default="", max_length=2000, description="why, for the audit log")


class HookUpdate(RequestModel):
    name: str | None = Field(default=None, min_length=1, max_length=200)
    url: HttpUrl | None = None
    min_severity: Severity | None = None
    secret: str | None = Field(default=None, min_length=16, max_length=200)
    routing_key: str | None = Field(default=None, min_length=1, max_length=200)
    enabled: bool | None = None
    reason: str = Field(default="", max_length=2000, description="why, for the audit log")


class HookRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    kind: HookKind
    url: str
    deployment: str | None = None
    min_severity: Severity
    enabled: bool
    has_secret: bool = False
    has_routing_key: bool = False
    created_by: str
    created_at: datetime


class HookCreated(HookRead):
    secret: str | None = Field(default=None, description=(
        "the webhook HMAC key generated for the hook, shown once (null when the request gave "
        "one)"))


class DeliveryRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    hook_id: int
    alert_id: int | None
    event: str
    attempt: int
    ok: bool
    status_code: int | None
    error: str | None
    duration_ms: float
    created_at: datetime
