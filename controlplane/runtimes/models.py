"""ORM for the runtimes that report heartbeats: what they apply and when they were last seen."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ForeignKey, Index, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from controlplane.db import Base, utcnow


class Runtime(Base):
    __tablename__ = "runtimes"
    __table_args__ = (UniqueConstraint("deployment_id", "runtime_id"),
                      Index("ix_runtimes_deployment_id_token_id", "deployment_id", "token_id"))

    id: Mapped[int] = mapped_column(primary_key=True)
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"))
    runtime_id: Mapped[str] = mapped_column(String(128))
    applied_version: Mapped[int | None]
    applied_checksum: Mapped[str | None] = mapped_column(String(64))
    ready: Mapped[bool] = mapped_column(default=False)
    error: Mapped[str | None] = mapped_column(Text)
    # The version of the threshold set the runtime refused last, while that refusal stands
    # (its last heartbeat said so; `error` says why). NULL: it refuses none.
    refused_version: Mapped[int | None]
    spooled_batches: Mapped[int] = mapped_column(default=0)
    dropped_records: Mapped[int] = mapped_column(default=0)
    first_seen: Mapped[datetime] = mapped_column(default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(default=utcnow)
    # The token whose heartbeat registered the runtime: it counts against that token's cap
    # (NULL: registered without one, or the token is gone).
    token_id: Mapped[int | None] = mapped_column(
        ForeignKey("api_tokens.id", ondelete="SET NULL"))
    # Lineage (controlplane/runtimes/lineage.py): what the last heartbeat said the runtime
    # serves (NULL: unknown), and when and what it last reported that differed from its
    # deployment's (heartbeat or telemetry batch).
    model_revision: Mapped[str | None] = mapped_column(String(128))
    head_digest: Mapped[str | None] = mapped_column(String(71))
    lineage_mismatch_at: Mapped[datetime | None]
    mismatch_model_revision: Mapped[str | None] = mapped_column(String(128))
    mismatch_head_digest: Mapped[str | None] = mapped_column(String(71))


class RuntimeVersion(Base):
    """A threshold version a runtime's heartbeat said it applied. A runtime token's shadow
    tokens stamped with a version their runtime never applied (nor 0, the built-in set every
    runtime starts on) are stored and shown but never count as evidence."""

    __tablename__ = "runtime_versions"

    deployment_id: Mapped[int] = mapped_column(
        ForeignKey("deployments.id", ondelete="CASCADE"), primary_key=True)
    runtime_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    version: Mapped[int] = mapped_column(primary_key=True)
    first_at: Mapped[datetime] = mapped_column(default=utcnow)


class RuntimeOutlier(Base):
    """A runtime whose shadow evidence differed from the rest of its fleet beyond chance: set
    aside (its samples feed no calibration, drift test or canary verdict) until an operator
    clears it.

    `open_runtime` equals `runtime_id` while the runtime is set aside and is NULL once cleared:
    the unique constraint on it keeps one open record per runtime, even between workers."""

    __tablename__ = "runtime_outliers"
    __table_args__ = (UniqueConstraint("deployment_id", "open_runtime"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"),
                                               index=True)
    runtime_id: Mapped[str] = mapped_column(String(128))
    # The witness set aside (controlplane/runtimes/witnesses.py): every runtime id of that
    # credential is set aside with it. NULL: the runtime id alone.
    witness: Mapped[str | None] = mapped_column(String(140))
    open_runtime: Mapped[str | None] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(16), default="set_aside")  # or 'cleared'
    version: Mapped[int]  # the threshold version both sides served when it was found
    segment: Mapped[str] = mapped_column(String(64))
    summary: Mapped[str] = mapped_column(Text)
    evidence: Mapped[dict] = mapped_column(default=dict)
    alert_id: Mapped[int | None] = mapped_column(ForeignKey("alerts.id", ondelete="SET NULL"))
    detected_at: Mapped[datetime] = mapped_column(default=utcnow)
    cleared_at: Mapped[datetime | None]
    cleared_by: Mapped[str | None] = mapped_column(String(200))
    clear_reason: Mapped[str] = mapped_column(Text, default="")
