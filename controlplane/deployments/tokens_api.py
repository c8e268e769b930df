"""Thin routes for API tokens (admin only). The tokens are the auth domain's; the routes sit
here, above it, because a runtime token names its one deployment, which they look up by name."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, status
from sqlalchemy import select

from controlplane.auth import service
from controlplane.auth.deps import AdminPrincipal
from controlplane.auth.schemas import TokenCreate, TokenCreated, TokenRead
from controlplane.db import SessionDep
from controlplane.deployments.models import Deployment
from controlplane.deployments.service import get_deployment

router = APIRouter(prefix="/v1/tokens", tags=["auth"])


def _reads(session, tokens) -> list[TokenRead]:
    """The tokens as the API shows them, each with its deployment's name."""
    ids = {token.deployment_id for token in tokens} - {None}
    names = dict(session.execute(select(Deployment.id, Deployment.name)
                                 .where(Deployment.id.in_(ids))).all()) if ids else {}
    return [TokenRead.model_validate(token).model_copy(
        update={"deployment": names.get(token.deployment_id)}) for token in tokens]


@router.post("", status_code=status.HTTP_201_CREATED, response_model=TokenCreated)
def create_token(spec: TokenCreate, session: SessionDep,
                 principal: AdminPrincipal) -> TokenCreated:
    """Create an API token; the secret is in this answer only (a runtime token names its one
    deployment)."""
    deployment = get_deployment(session=session, name=spec.deployment) if spec.deployment else None
    token, secret = service.create_token(session=session, name=spec.name, scope=spec.scope,
                                         deployment=deployment, actor=principal.actor,
                                         reason=spec.reason)
    return TokenCreated(**_reads(session, [token])[0].model_dump(), token=secret)


@router.get("", response_model=list[TokenRead])
def list_tokens(session: SessionDep, principal: AdminPrincipal) -> list[TokenRead]:
    """Every API token (never its secret): scope, deployment, created and revoked times."""
    return _reads(session, service.list_tokens(session=session))


@router.delete("/{token_id}", response_model=TokenRead)
def revoke_token(token_id: int, session: SessionDep, principal: AdminPrincipal,
                 reason: Annotated[str, Query(max_length=2000,
                                              description="why, for the audit log")] = ""
                 ) -> TokenRead:
    """Revoke a token: every API process refuses it within seconds."""
    token = service.revoke_token(session=session, token_id=token_id,
                                 actor=principal.actor, reason=reason)
    return _reads(session, [token])[0]
