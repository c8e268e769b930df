"""API shapes for runtimes."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict


class RuntimeRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    runtime_id: str
    applied_version: int | None
    applied_checksum: str | None
    ready: bool
    error: str | None
    spooled_batches: int
    dropped_records: int
    first_seen: datetime
    last_seen: datetime
