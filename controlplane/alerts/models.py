"""ORM for alerts on a deployment's exit behaviour, the hooks that page on them, and the log of
every delivery attempt."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ForeignKey, Index, LargeBinary, String, Text, UniqueConstraint, false
from sqlalchemy.orm import Mapped, mapped_column

from controlplane.alerts.kinds import AlertKind
from controlplane.db import Base, utcnow
from exitplane.wire import DEFAULT_SEGMENT

KINDS = tuple(kind.value for kind in AlertKind)
SEVERITIES = ("info", "warning", "critical")
STATUSES = ("firing", "acknowledged", "resolved")
HOOK_KINDS = ("webhook", "alertmanager", "pagerduty", "slack")
# Encrypted values are longer than what was encrypted: unbounded text on PostgreSQL (migration
# 0006); SQLite never enforces a VARCHAR length, and keeping its declared type there spares a
# table rebuild that would cascade-delete the delivery log.
SEALED_URL = String(2000).with_variant(Text(), "postgresql")
SEALED = String(200).with_variant(Text(), "postgresql")


class Alert(Base):
    """One occurrence of a condition on a deployment, from firing to resolved.

    `open_key` equals `dedup_key` while the alert is open and is NULL once resolved: the unique
    constraint on it makes "one open alert per key" hold even between concurrent workers."""

    __tablename__ = "alerts"
    __table_args__ = (UniqueConstraint("deployment_id", "open_key"),
                      Index("ix_alerts_deployment_id_id", "deployment_id", "id"))

    id: Mapped[int] = mapped_column(primary_key=True)
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(32))
    layer: Mapped[int | None]
    # The traffic segment the condition was observed on; 'default' also for alerts
    # about the whole deployment (stale runtimes, canaries).
    segment: Mapped[str] = mapped_column(String(64), default=DEFAULT_SEGMENT,
                                         server_default=DEFAULT_SEGMENT)
    severity: Mapped[str] = mapped_column(String(16))
    dedup_key: Mapped[str] = mapped_column(String(255))
    open_key: Mapped[str | None] = mapped_column(String(255))
    status: Mapped[str] = mapped_column(String(16), default="firing", index=True)
    summary: Mapped[str] = mapped_column(Text)
    evidence: Mapped[dict] = mapped_column(default=dict)
    # Whether its Evidently report is stored (`AlertReport`); cleared when retention drops it.
    has_report: Mapped[bool] = mapped_column(default=False, server_default=false())
    # What the system did about it (fallback engaged, recalibration queued ...), for the page.
    action_taken: Mapped[str] = mapped_column(Text, default="")
    fired_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_seen_at: Mapped[datetime] = mapped_column(default=utcnow)
    # When the condition was first seen cleared (None while it holds); auto-resolve after a while.
    clear_since: Mapped[datetime | None]
    acknowledged_at: Mapped[datetime | None]
    acknowledged_by: Mapped[str | None] = mapped_column(String(200))
    resolved_at: Mapped[datetime | None]
    resolved_by: Mapped[str | None] = mapped_column(String(200))
    resolution: Mapped[str] = mapped_column(Text, default="")


class AlertHook(Base):
    """Where a deployment's alerts go (all deployments when `deployment_id` is NULL)."""

    __tablename__ = "alert_hooks"

    id: Mapped[int] = mapped_column(primary_key=True)
    deployment_id: Mapped[int | None] = mapped_column(
        ForeignKey("deployments.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(20))
    # URL, HMAC key (webhooks) and routing key (PagerDuty) are credentials: stored encrypted
    # with a key derived from the secret key (controlplane/keys.py), decrypted only
    # to deliver; every delivery signs with the HMAC key, so it cannot be a one-way hash.
    url: Mapped[str] = mapped_column(SEALED_URL)
    secret: Mapped[str | None] = mapped_column(SEALED)
    routing_key: Mapped[str | None] = mapped_column(SEALED)
    min_severity: Mapped[str] = mapped_column(String(16), default="warning")
    enabled: Mapped[bool] = mapped_column(default=True)
    created_by: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class AlertDelivery(Base):
    """One attempt to deliver one event of an alert (or a test alert) to one hook."""

    __tablename__ = "alert_deliveries"
    __table_args__ = (Index("ix_alert_deliveries_hook_id_id", "hook_id", "id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    hook_id: Mapped[int] = mapped_column(ForeignKey("alert_hooks.id", ondelete="CASCADE"))
    alert_id: Mapped[int | None] = mapped_column(
        ForeignKey("alerts.id", ondelete="CASCADE"), index=True)
    event: Mapped[str] = mapped_column(String(20))  # firing, acknowledged, resolved, test
    attempt: Mapped[int]
    ok: Mapped[bool]
    status_code: Mapped[int | None]
    error: Mapped[str | None] = mapped_column(Text)
    duration_ms: Mapped[float]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class AlertReport(Base):
    """The Evidently HTML report of an alert, gzip-compressed, in the store that every API
    replica reads (never a process's own disk)."""

    __tablename__ = "alert_reports"

    alert_id: Mapped[int] = mapped_column(ForeignKey("alerts.id", ondelete="CASCADE"),
                                          primary_key=True)
    html_gzip: Mapped[bytes] = mapped_column(LargeBinary)
    html_bytes: Mapped[int]  # uncompressed size
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
