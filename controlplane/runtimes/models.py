"""ORM for the runtimes that report heartbeats: what they apply and when they were last seen."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ForeignKey, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from controlplane.db import Base, utcnow


class Runtime(Base):
    __tablename__ = "runtimes"
    __table_args__ = (UniqueConstraint("deployment_id", "runtime_id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"))
    runtime_id: Mapped[str] = mapped_column(String(128))
    applied_version: Mapped[int | None]
    applied_checksum: Mapped[str | None] = mapped_column(String(64))
    ready: Mapped[bool] = mapped_column(default=False)
    error: Mapped[str | None] = mapped_column(Text)
    spooled_batches: Mapped[int] = mapped_column(default=0)
    dropped_records: Mapped[int] = mapped_column(default=0)
    first_seen: Mapped[datetime] = mapped_column(default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(default=utcnow)
