"""ORM for API tokens (stored as sha256 digests, never in clear), UI users, the counts of
failed password checks, and the audit log of administrative actions."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ForeignKey, Index, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from controlplane.db import Base, utcnow

SCOPES = ("runtime", "operator", "admin")


class ApiToken(Base):
    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    scope: Mapped[str] = mapped_column(String(20))
    deployment_id: Mapped[int | None] = mapped_column(
        ForeignKey("deployments.id", ondelete="CASCADE"))
    prefix: Mapped[str] = mapped_column(String(16))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None]


ROLES = ("viewer", "operator", "admin")


class User(Base):
    """A person who signs in to the admin UI; the password is stored as an argon2 hash."""

    __tablename__ = "users"

    id: Mapped[int] = mapped_column(primary_key=True)
    username: Mapped[str] = mapped_column(String(64), unique=True)
    password_hash: Mapped[str] = mapped_column(String(255))
    role: Mapped[str] = mapped_column(String(20))
    disabled: Mapped[bool] = mapped_column(default=False)
    # Bumped on password change, role change or disable: older session cookies stop working.
    session_epoch: Mapped[int] = mapped_column(default=0)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_login_at: Mapped[datetime | None]
    # How the user signs in: "local" (a password here) or "sso" (an OpenID Connect provider or
    # a trusted authenticating proxy, controlplane/auth/sso.py; no password works for them).
    origin: Mapped[str] = mapped_column(String(20), default="local", server_default="local")
    # The provider's `iss` and `sub` of an OpenID Connect user ("<issuer> <subject>"), bound at
    # their first sign-in: a later ID token must carry the same, whatever its username claim says.
    sso_subject: Mapped[str | None] = mapped_column(String(600))


class SignInFailures(Base):
    """Failed password checks counted under one throttle key (a hash of a username, a client
    address or both: controlplane/guards/signin_throttle.py), where no Redis is configured."""

    __tablename__ = "signin_failures"

    key: Mapped[str] = mapped_column(String(40), primary_key=True)
    failures: Mapped[int] = mapped_column(default=0)
    locked_until: Mapped[datetime | None]
    last_failure_at: Mapped[datetime] = mapped_column(index=True)


class AdminEvent(Base):
    """Who did what to the control plane itself, when and why: tokens, users and roles, alert
    hooks, alert acknowledgements and resolutions (controlplane/auth/audit.py). Deployment
    changes have their own table (`audit_events`); the fleet-wide log reads both
    (controlplane/deployments/audit.py)."""

    __tablename__ = "admin_events"
    __table_args__ = (Index("ix_admin_events_created_at_id", "created_at", "id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    actor: Mapped[str] = mapped_column(String(200))
    action: Mapped[str] = mapped_column(String(50), index=True)
    # What the action was on: "token:12", "user:alice", "hook:3", "alert:41".
    target: Mapped[str] = mapped_column(String(200))
    # The deployment the action concerns, by name (kept when the deployment is gone).
    deployment: Mapped[str | None] = mapped_column(String(63), index=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    details: Mapped[dict] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
