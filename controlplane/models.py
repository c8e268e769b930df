"""Every ORM model, imported in one place so Alembic and tests see the whole schema."""

from controlplane.auth.models import ApiToken
from controlplane.db import Base
from controlplane.runtimes.models import Runtime
from controlplane.telemetry.models import (
    Rollup,
    RollupHistogram,
    ShadowSampleRow,
    TelemetryBatchRow,
    TokenRecordRow,
)
from controlplane.thresholds.models import Alias, AuditEvent, Deployment, ThresholdSet

__all__ = [
    "Alias", "ApiToken", "AuditEvent", "Base", "Deployment", "Rollup", "RollupHistogram",
    "Runtime", "ShadowSampleRow", "TelemetryBatchRow", "ThresholdSet", "TokenRecordRow",
]
