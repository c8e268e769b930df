"""API tokens: created once in clear, stored as sha256, looked up by digest in constant time."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Protocol

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.auth.audit import LOCAL_ACTOR, record_admin_event
from controlplane.auth.models import SCOPES, ApiToken
from controlplane.coordination.bus import notify_after_commit
from controlplane.db import utcnow
from controlplane.errors import Forbidden, Invalid, NotFound, Unauthorized

TOKEN_PREFIX = "ept_"
SCOPE_RANK = {"runtime": 0, "operator": 1, "admin": 2}


class DeploymentRef(Protocol):
    """What a token needs of the deployment it belongs to: its id, and its name for the audit
    log. The caller looks the deployment up (auth sits below the deployments domain)."""

    id: int
    name: str


@dataclass(frozen=True)
class Principal:
    """Who is calling: a token's identity, scope and (for runtime tokens) its one deployment."""

    token_id: int
    name: str
    scope: str
    deployment_id: int | None

    @property
    def actor(self) -> str:
        return f"token:{self.name}"

    def require(self, scope: str) -> None:
        if SCOPE_RANK[self.scope] < SCOPE_RANK[scope]:
            raise Forbidden(f"this action needs a token with scope {scope!r}; "
                            f"yours has {self.scope!r}")

    def require_deployment(self, deployment_id: int) -> None:
        """Runtime tokens reach only their own deployment; operators and admins reach all."""
        if self.scope == "runtime" and self.deployment_id != deployment_id:
            raise Forbidden("this runtime token belongs to another deployment")


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def create_token(*, session: Session, name: str, scope: str,
                 deployment: DeploymentRef | None = None,
                 actor: str = LOCAL_ACTOR, reason: str = "") -> tuple[ApiToken, str]:
    """Create a token; returns the row and the secret, which is never stored or shown again.
    The creation is an audit event of `actor`, with `reason`."""
    if scope not in SCOPES:
        raise Invalid(f"unknown scope {scope!r}; use one of {', '.join(SCOPES)}")
    if scope == "runtime" and deployment is None:
        raise Invalid("a runtime token needs a deployment")
    if scope != "runtime" and deployment is not None:
        raise Invalid(f"only a runtime token serves one deployment; an {scope} token reaches "
                      "every deployment: leave the deployment out, or create a runtime token")
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    token = ApiToken(name=name, scope=scope, deployment_id=deployment.id if deployment else None,
                     prefix=secret[:12], token_hash=digest(secret))
    session.add(token)
    session.flush()
    record_admin_event(session=session, actor=actor, action="token.create",
                       target=f"token:{token.id}", reason=reason,
                       details={"name": name, "scope": scope,
                                "deployment_id": token.deployment_id},
                       deployment=deployment.name if deployment else None)
    return token, secret


def authenticate(*, session: Session, secret: str) -> Principal:
    """The principal behind `secret`, or Unauthorized."""
    wanted = digest(secret)
    token = session.scalars(select(ApiToken).where(ApiToken.token_hash == wanted)).one_or_none()
    if token is None or not hmac.compare_digest(token.token_hash, wanted):
        raise Unauthorized("unknown API token")
    if token.revoked_at is not None:
        raise Unauthorized("this API token was revoked")
    return Principal(token_id=token.id, name=token.name, scope=token.scope,
                     deployment_id=token.deployment_id)


def active_principals(*, session: Session, limit: int) -> dict[str, Principal]:
    """Digest -> principal of every token not revoked (at most `limit`, oldest first), in one
    read: the API's token cache refreshes from it (controlplane/auth/deps.py)."""
    rows = session.execute(select(ApiToken.token_hash, ApiToken.id, ApiToken.name,
                                  ApiToken.scope, ApiToken.deployment_id)
                           .where(ApiToken.revoked_at.is_(None))
                           .order_by(ApiToken.id).limit(limit))
    return {row.token_hash: Principal(token_id=row.id, name=row.name, scope=row.scope,
                                      deployment_id=row.deployment_id) for row in rows}


def list_tokens(*, session: Session) -> list[ApiToken]:
    return list(session.scalars(select(ApiToken).order_by(ApiToken.id)))


def revoke_token(*, session: Session, token_id: int, actor: str = LOCAL_ACTOR,
                 reason: str = "") -> ApiToken:
    """Revoke a token; every API process drops its cached lookup once this commits (never
    before: a lookup in between would cache the old principal again). The revocation is an
    audit event of `actor`, with `reason`."""
    token = session.get(ApiToken, token_id)
    if token is None:
        raise NotFound(f"token {token_id} does not exist")
    if token.revoked_at is None:
        token.revoked_at = utcnow()
        notify_after_commit(session=session, topic="revocation", message=token.token_hash)
        record_admin_event(session=session, actor=actor, action="token.revoke",
                           target=f"token:{token.id}", reason=reason,
                           details={"name": token.name},
                           deployment=_deployment_name(session, token.deployment_id))
    session.flush()
    return token


def _deployment_name(session: Session, deployment_id: int | None) -> str | None:
    """The name of the deployment a runtime token serves, read through the token's foreign
    key (auth sits below the deployments domain and imports none of it)."""
    if deployment_id is None:
        return None
    [key] = ApiToken.__table__.c.deployment_id.foreign_keys
    deployments = key.column.table
    return session.scalar(select(deployments.c.name).where(deployments.c.id == deployment_id))
