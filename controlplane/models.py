"""Every ORM model, imported in one place so Alembic and tests see the whole schema."""

from controlplane.alerts.models import Alert, AlertDelivery, AlertHook
from controlplane.auth.models import ApiToken, SignInFailures, User
from controlplane.calibration.models import CalibrationJob, CanaryRun
from controlplane.coordination.models import Epoch
from controlplane.db import Base
from controlplane.deployments.models import Alias, AuditEvent, Deployment, ThresholdSet
from controlplane.runtimes.models import Runtime, RuntimeOutlier
from controlplane.telemetry.models import (
    Rollup,
    RollupHistogram,
    ShadowRequestRow,
    ShadowRequestTokenRow,
    ShadowSampleRow,
    TelemetryBatchRow,
    TokenRecordRow,
)

__all__ = [
    "Alert", "AlertDelivery", "AlertHook", "Alias", "ApiToken", "AuditEvent", "Base",
    "CalibrationJob", "CanaryRun", "Deployment", "Epoch", "Rollup", "RollupHistogram", "Runtime",
    "RuntimeOutlier", "ShadowRequestRow", "ShadowRequestTokenRow", "ShadowSampleRow",
    "SignInFailures", "TelemetryBatchRow", "ThresholdSet", "TokenRecordRow", "User",
]
