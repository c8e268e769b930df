"""Admin pages: API tokens (created once, listed, revoked) and the people who sign in."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import Response
from sqlalchemy.orm import Session

from controlplane.auth import service as tokens
from controlplane.auth import users
from controlplane.auth.audit import record_admin_event
from controlplane.auth.models import ROLES, SCOPES
from controlplane.db import SessionDep
from controlplane.deployments import service as thresholds
from controlplane.errors import DomainError, Invalid
from controlplane.guards.password_checks import PasswordChecks
from dashboards.security import Admin, Csrf, actor
from dashboards.templating import render
from dashboards.views import attempt

router = APIRouter()


def _tokens_page(request: Request, session, status_code: int = 200, **extra) -> Response:
    deployments = thresholds.list_deployments(session=session)
    names = {d.id: d.name for d in deployments}
    return render(request, "tokens.html", status_code=status_code,
                  tokens=tokens.list_tokens(session=session), scopes=SCOPES,
                  deployments=deployments, deployment_names=names, **extra)


@router.get("/tokens")
def tokens_page(request: Request, session: SessionDep, _user: Admin) -> Response:
    return _tokens_page(request, session)


@router.post("/tokens", dependencies=[Csrf])
def create_token(request: Request, session: SessionDep, _user: Admin,
                 name: Annotated[str, Form(max_length=200)],
                 scope: Annotated[str, Form()],
                 deployment: Annotated[str, Form()] = "") -> Response:
    """Create a token and show its secret on this one response (never stored in clear)."""
    try:
        if not name.strip():
            raise Invalid("give the token a name: who or what will hold it")
        target = (thresholds.get_deployment(session=session, name=deployment)
                  if deployment else None)
        token, secret = tokens.create_token(session=session, name=name.strip(), scope=scope,
                                            deployment=target, actor=actor(_user))
    except DomainError as error:
        session.rollback()
        return _tokens_page(request, session, status_code=error.status_code,
                            error=str(error))
    return _tokens_page(request, session, status_code=201, created=token, secret=secret)


@router.post("/tokens/{token_id}/revoke", dependencies=[Csrf])
def revoke_token(token_id: int, request: Request, session: SessionDep, _user: Admin) -> Response:
    def perform() -> str:
        token = tokens.revoke_token(session=session, token_id=token_id, actor=actor(_user))
        return f"Token {token.name!r} ({token.prefix}…) is revoked."

    return attempt(request, session, "/tokens", perform)


@router.get("/users")
def users_page(request: Request, session: SessionDep, user: Admin) -> Response:
    return render(request, "users.html", users=users.list_users(session=session), roles=ROLES,
                  min_password=users.MIN_PASSWORD_LENGTH)


def _hashed_outside_transaction(request: Request, session: Session, password: str) -> str:
    """The hash of a new password, made after this request's transaction so far (the
    signed-in admin's lookup, reads only) has ended: on SQLite a transaction holds the store's
    write lock, which heartbeats and token lookups would wait for while the hash runs."""
    session.commit()
    checks: PasswordChecks = request.app.state.password_checks
    return checks.new_hash(password)


@router.post("/users", dependencies=[Csrf])
def create_user(request: Request, session: SessionDep, _user: Admin,
                username: Annotated[str, Form(max_length=64)],
                password: Annotated[str, Form(max_length=1024)],
                role: Annotated[str, Form()]) -> Response:
    def perform() -> str:
        password_hash = _hashed_outside_transaction(request, session, password)
        created = users.create_user(session=session, username=username, role=role,
                                    actor=actor(_user),
                                    password_hash=password_hash)
        return f"User {created.username!r} created as {created.role}."

    return attempt(request, session, "/users", perform)


@router.post("/users/{user_id}/role", dependencies=[Csrf])
def set_role(user_id: int, request: Request, session: SessionDep, _user: Admin,
             role: Annotated[str, Form()]) -> Response:
    def perform() -> str:
        target = users.set_role(session=session, user=users.get_user(session=session,
                                                                     user_id=user_id), role=role,
                                actor=actor(_user))
        return f"{target.username!r} is now {target.role}."

    return attempt(request, session, "/users", perform)


@router.post("/users/{user_id}/disabled", dependencies=[Csrf])
def set_disabled(user_id: int, request: Request, session: SessionDep, _user: Admin,
                 disabled: Annotated[str, Form()]) -> Response:
    def perform() -> str:
        target = users.set_disabled(session=session,
                                    user=users.get_user(session=session, user_id=user_id),
                                    disabled=disabled == "true", actor=actor(_user))
        state = "disabled and signed out" if target.disabled else "enabled"
        return f"{target.username!r} is {state}."

    return attempt(request, session, "/users", perform)


@router.post("/users/{user_id}/password", dependencies=[Csrf])
def set_password(user_id: int, request: Request, session: SessionDep, _user: Admin,
                 password: Annotated[str, Form(max_length=1024)]) -> Response:
    def perform() -> str:
        password_hash = _hashed_outside_transaction(request, session, password)
        target = users.set_password(session=session,
                                    user=users.get_user(session=session, user_id=user_id),
                                    password_hash=password_hash)
        record_admin_event(session=session, actor=actor(_user), action="user.password",
                           target=f"user:{target.username}")
        return f"Password of {target.username!r} changed; their sessions ended."

    return attempt(request, session, "/users", perform)
