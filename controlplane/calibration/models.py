"""ORM for recalibration jobs, the canary runs that promote (or revert) their candidates, and
the operating curves the workers keep."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ForeignKey, Index, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from controlplane.db import Base, utcnow

JOB_STATUSES = ("queued", "running", "waiting_for_data", "succeeded", "failed")
OPEN_JOB_STATUSES = ("queued", "running", "waiting_for_data")
TRIGGERS = ("alert", "manual", "schedule", "opportunity")
# What happened to a published candidate: promoted to active (policy auto or an approval),
# sent to the canary alias, waiting for an operator, rejected, or the canary's outcome.
PROMOTIONS = ("active", "canary", "awaiting_approval", "approved", "rejected",
              "canary_promoted", "canary_reverted", "superseded")
CANARY_STATUSES = ("running", "promoted", "reverted", "paused", "aborted")


class CalibrationJob(Base):
    """One recalibration: the sample window it read, what it chose, and what became of it."""

    __tablename__ = "calibration_jobs"
    __table_args__ = (Index("ix_calibration_jobs_deployment_id_id", "deployment_id", "id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"))
    trigger: Mapped[str] = mapped_column(String(20))
    # The alert that queued this job (alerts live in another domain: no foreign key).
    alert_id: Mapped[int | None]
    requested_by: Mapped[str] = mapped_column(String(200))
    reason: Mapped[str] = mapped_column(Text, default="")
    since: Mapped[datetime]
    until: Mapped[datetime | None]
    # The one traffic segment this job recalibrates (its shadow tokens only, replacing only its
    # map); None: the whole deployment.
    segment: Mapped[str | None] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(20), default="queued")
    status_reason: Mapped[str] = mapped_column(Text, default="")
    attempts: Mapped[int] = mapped_column(default=0)
    # Per exit layer: threshold, empirical risk, bound, p-value, expected exit rate, samples.
    layers: Mapped[list] = mapped_column(default=list)
    # The quality-vs-expected-speed curve along the threshold path.
    curve: Mapped[list] = mapped_column(default=list)
    # Whole-policy figures: risk, bound, p-value, exit rate, speed-up, holdout, sample counts.
    summary: Mapped[dict] = mapped_column(default=dict)
    result_version: Mapped[int | None]
    promotion: Mapped[str | None] = mapped_column(String(20))
    decided_by: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class CanaryRun(Base):
    """A candidate served to a hash-sticky fraction of runtimes and checked window by window."""

    __tablename__ = "canary_runs"
    __table_args__ = (Index("ix_canary_runs_deployment_id_id", "deployment_id", "id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"))
    version: Mapped[int]
    baseline_version: Mapped[int]
    job_id: Mapped[int | None] = mapped_column(
        ForeignKey("calibration_jobs.id", ondelete="SET NULL"))
    status: Mapped[str] = mapped_column(String(20), default="running")
    status_reason: Mapped[str] = mapped_column(Text, default="")
    clean_windows: Mapped[int] = mapped_column(default=0)
    failed_checks: Mapped[int] = mapped_column(default=0)
    inconclusive_windows: Mapped[int] = mapped_column(default=0)
    # Start of the next window to evaluate (whole minutes: rollups are per minute).
    next_window_start: Mapped[datetime]
    # Every evaluated window: its verdict and the figures behind it.
    checks: Mapped[list] = mapped_column(default=list)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]


class OperatingCurve(Base):
    """The latest operating curve of a deployment's traffic segment (`calibration.curve`):
    the frontier of its recent shadow evidence, the sets marked on it, the best certified set
    and the gap to the active one. The workers write it; the API and the UI only read it."""

    __tablename__ = "operating_curves"
    __table_args__ = (UniqueConstraint("deployment_id", "segment"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"))
    segment: Mapped[str] = mapped_column(String(64))
    computed_at: Mapped[datetime] = mapped_column(default=utcnow)
    window_since: Mapped[datetime]
    window_until: Mapped[datetime]
    # Shadow tokens, requests and witnesses the curve was drawn from, the cost model used
    # (null: the layers ratio), the shadow share, and why nothing was drawn when it was not.
    evidence: Mapped[dict] = mapped_column(default=dict)
    points: Mapped[list] = mapped_column(default=list)
    marks: Mapped[dict] = mapped_column(default=dict)
    best: Mapped[dict | None]
    gap: Mapped[dict | None]
    opportunity: Mapped[dict | None]
