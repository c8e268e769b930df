"""ORM for deployments, their immutable threshold sets, aliases and the audit log."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, ForeignKey, Index, String, Text, UniqueConstraint, false
from sqlalchemy.orm import Mapped, mapped_column

from controlplane.db import Base, utcnow

ALIASES = ("active", "conservative", "canary")


class Deployment(Base):
    """A named runtime fleet and the quality target its thresholds must meet."""

    __tablename__ = "deployments"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    model_ref: Mapped[str] = mapped_column(String(500))
    # Lineage the runtimes must serve ('' names none): a runtime reporting another is
    # mismatched (controlplane/runtimes/lineage.py); sets that can exit name these heads.
    head_digest: Mapped[str] = mapped_column(String(71), default="")
    model_revision: Mapped[str] = mapped_column(String(128), default="", server_default="")
    num_layers: Mapped[int]
    exit_layers: Mapped[list] = mapped_column()
    signal: Mapped[str] = mapped_column(String(20))
    delta: Mapped[float]
    epsilon: Mapped[float]
    policy: Mapped[str] = mapped_column(String(20), default="auto")
    canary_fraction: Mapped[float] = mapped_column(default=0.1)
    fallback_mode: Mapped[str] = mapped_column(String(20), default="never_exit")
    fallback_margin: Mapped[float] = mapped_column(default=0.05)
    # Recalibrate on a schedule every this many seconds (NULL: only when drift, an opportunity
    # or an operator asks); the operating-curve task queues the job when it is due.
    retune_every_s: Mapped[int | None]
    # Bumped on every alias move: config caches and long-polls compare it.
    revision: Mapped[int] = mapped_column(default=0)
    # Whether runtime telemetry may register segment names the operator did not declare
    # (controlplane/deployments/segments.py); off: such traffic is stored as `default`.
    auto_segments: Mapped[bool] = mapped_column(default=False, server_default=false())
    # The shadow rate runtimes apply (controlplane/deployments/shadow_rate.py): the operator's
    # bounds (equal: a fixed rate), and what the control plane decided within them, when and
    # why (NULL: nothing decided yet; runtimes apply their own rate meanwhile).
    shadow_rate_min: Mapped[float] = mapped_column(default=0.01, server_default="0.01")
    shadow_rate_max: Mapped[float] = mapped_column(default=0.2, server_default="0.2")
    shadow_rate: Mapped[float | None]
    shadow_rate_reason: Mapped[str] = mapped_column(Text, default="", server_default="")
    shadow_rate_decided_at: Mapped[datetime | None]
    # The answer target (NULL: none): calibration certifies P(answer differs from full depth)
    # <= delta_answer with probability 1 - epsilon beside the token target, on shadow requests
    # (controlplane/calibration/answers.py).
    delta_answer: Mapped[float | None]
    # Share of whole requests runtimes serve at full depth as shadow requests, sent in pulls
    # (NULL: none asked; runtimes apply their own rate).
    shadow_request_rate: Mapped[float | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class DeploymentSegment(Base):
    """A traffic segment of a deployment: declared by an operator (or by publishing a threshold
    set that maps it), or registered from runtime telemetry where the deployment opted in
    (`auto_segments`). At most EXITPLANE_MAX_SEGMENTS_PER_DEPLOYMENT are in use at once;
    traffic of any other name is stored as `default`. A removed segment keeps its row
    (`removed_at`), so its stored traffic stays readable under its name."""

    __tablename__ = "deployment_segments"

    deployment_id: Mapped[int] = mapped_column(
        ForeignKey("deployments.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # 'operator' (declared), 'threshold_set' (a published set maps it) or 'telemetry'
    # (registered from runtime traffic, `auto_segments` on)
    origin: Mapped[str] = mapped_column(String(16), default="operator",
                                        server_default="operator")
    removed_at: Mapped[datetime | None]


class ThresholdSet(Base):
    """One immutable version of per-exit-layer thresholds."""

    __tablename__ = "threshold_sets"
    __table_args__ = (UniqueConstraint("deployment_id", "version"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"))
    version: Mapped[int]
    signal: Mapped[str] = mapped_column(String(20))
    thresholds: Mapped[dict] = mapped_column()  # {"<exit layer>": threshold}: `default`
    # {"<segment>": {"<exit layer>": threshold}} for segments with their own thresholds;
    # NULL when none has (every segment then applies `thresholds`).
    segments: Mapped[dict | None] = mapped_column()
    origin: Mapped[str] = mapped_column(String(20))
    parent_version: Mapped[int | None]
    calibration_job_id: Mapped[int | None]
    reason: Mapped[str] = mapped_column(Text, default="")
    author: Mapped[str] = mapped_column(String(200))
    expected_metrics: Mapped[dict] = mapped_column(default=dict)
    # The exit heads the set was made for (its deployment's when published); NULL: any heads
    # (a set that never exits, or a deployment naming no heads). Part of the checksum.
    head_digest: Mapped[str | None] = mapped_column(String(71))
    checksum: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    def thresholds_by_layer(self) -> dict[int, float]:
        return {int(layer): float(value) for layer, value in self.thresholds.items()}

    def segments_by_layer(self) -> dict[str, dict[int, float]] | None:
        """Per-segment thresholds with integer layers, or None for a set without segments."""
        if not self.segments:
            return None
        return {name: {int(layer): float(value) for layer, value in by_layer.items()}
                for name, by_layer in self.segments.items()}


class Alias(Base):
    """A named pointer (active, conservative, canary) from a deployment to a version."""

    __tablename__ = "aliases"

    deployment_id: Mapped[int] = mapped_column(
        ForeignKey("deployments.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(20), primary_key=True)
    version: Mapped[int]
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class AuditEvent(Base):
    """Who did what to a deployment, when, from which version to which, and why."""

    __tablename__ = "audit_events"
    __table_args__ = (Index("ix_audit_events_deployment_id_id", "deployment_id", "id"),
                      Index("ix_audit_events_created_at_id", "created_at", "id"))

    id: Mapped[int] = mapped_column(primary_key=True)
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"))
    actor: Mapped[str] = mapped_column(String(200))
    action: Mapped[str] = mapped_column(String(50))
    alias: Mapped[str | None] = mapped_column(String(20))
    from_version: Mapped[int | None]
    to_version: Mapped[int | None]
    reason: Mapped[str] = mapped_column(Text, default="")
    details: Mapped[dict] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class UndeclaredSegmentTokens(Base):
    """Per minute, deployment and runtime: tokens whose segment the deployment has not
    declared, stored as `default` (see controlplane/deployments/segments.py), and the batches
    that carried them, as telemetry ingest counts them. Tells an operator which runtimes send
    which share of such traffic without keeping the names (their cardinality is the sender's
    choice)."""

    __tablename__ = "undeclared_segment_tokens"

    deployment_id: Mapped[int] = mapped_column(primary_key=True)
    runtime_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    minute: Mapped[datetime] = mapped_column(primary_key=True)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    batches: Mapped[int] = mapped_column(BigInteger, default=0)
