"""API shapes for tokens."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from controlplane.auth.models import SCOPES
from controlplane.request_models import RequestModel

Scope = Literal[SCOPES]


class TokenCreate(RequestModel):

    name: str = Field(min_length=1, max_length=200)
    scope: Scope
    deployment: str | None = None
    reason: str = Field(default="", max_length=2000, description="why, for the audit log")


class TokenRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    scope: Scope
    deployment_id: int | None
    deployment: str | None = Field(default=None,
                                   description="the name of the deployment a runtime token serves")
    prefix: str
    created_at: datetime
    revoked_at: datetime | None


class TokenCreated(TokenRead):
    token: str = Field(description="shown once; store it now")
