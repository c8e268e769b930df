"""Thin routes for the people who sign in to the admin UI (admin only): list, show, create,
and change a user's role, password or disabled state. The services (controlplane/auth/users.py)
record each change as an administrative audit event."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Path, status
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select

from controlplane.auth import users
from controlplane.auth.audit import record_admin_event
from controlplane.auth.deps import AdminPrincipal
from controlplane.auth.models import ROLES, User
from controlplane.db import SessionDep
from controlplane.errors import NotFound, error_answer
from controlplane.request_models import RequestModel

router = APIRouter(prefix="/v1/users", tags=["auth"])

Role = Literal[ROLES]
Username = Annotated[str, Path(min_length=1, max_length=64, description="the sign-in name")]
Password = Annotated[str, Field(min_length=users.MIN_PASSWORD_LENGTH, max_length=1024,
                                description=f"at least {users.MIN_PASSWORD_LENGTH} characters")]


class UserRead(BaseModel):
    """A user as an admin sees them (never the password's hash)."""

    model_config = ConfigDict(from_attributes=True)

    username: str
    role: Role
    disabled: bool
    origin: str = Field(description="how they sign in: `local` (a password here) or `sso` "
                        "(single sign-on; no password works for them)")
    created_at: datetime
    last_login_at: datetime | None


class UserCreate(RequestModel):
    username: str = Field(min_length=1, max_length=64, description=(
        "lowercase letters, digits, _ . @ -, starting with a letter or digit"))
    role: Role
    password: Password


class UserUpdate(RequestModel):
    """The fields given change; each change signs the user out everywhere."""

    role: Role | None = None
    disabled: bool | None = Field(default=None, description=(
        "true: refuse sign-in and end every session; false: let them sign in again"))
    password: Password | None = Field(default=None, description="a new password")


def _user(session, username: str) -> User:
    found = session.scalars(select(User).where(
        User.username == username.strip().lower())).one_or_none()
    if found is None:
        raise NotFound(f"user {username!r} does not exist")
    return found


@router.get("", response_model=list[UserRead])
def list_users(session: SessionDep, principal: AdminPrincipal) -> list[UserRead]:
    """Every user, by username: role, disabled or not, last sign-in."""
    return [UserRead.model_validate(user) for user in users.list_users(session=session)]


@router.get("/{username}", response_model=UserRead)
def show_user(username: Username, session: SessionDep, principal: AdminPrincipal) -> UserRead:
    """One user: role, disabled or not, how they sign in, last sign-in."""
    return UserRead.model_validate(_user(session, username))


@router.post("", status_code=status.HTTP_201_CREATED, response_model=UserRead,
             responses={409: error_answer("a user of this name exists")})
def create_user(spec: UserCreate, session: SessionDep, principal: AdminPrincipal) -> UserRead:
    """Create a user with a role and a password (the username is stored lowercase)."""
    password_hash = users.new_password_hash(spec.password)  # before the transaction's writes
    user = users.create_user(session=session, username=spec.username, role=spec.role,
                             password_hash=password_hash, actor=principal.actor)
    return UserRead.model_validate(user)


@router.patch("/{username}", response_model=UserRead,
              responses={409: error_answer("the change would leave no enabled admin")})
def update_user(username: Username, spec: UserUpdate, session: SessionDep,
                principal: AdminPrincipal) -> UserRead:
    """Change a user's role, disabled state or password; each change ends the user's
    sessions. The last enabled admin can be neither demoted nor disabled (409)."""
    password_hash = users.new_password_hash(spec.password) if spec.password else None
    user = _user(session, username)
    if spec.role is not None:
        users.set_role(session=session, user=user, role=spec.role, actor=principal.actor)
    if spec.disabled is not None:
        users.set_disabled(session=session, user=user, disabled=spec.disabled,
                           actor=principal.actor)
    if password_hash is not None:
        users.set_password(session=session, user=user, password_hash=password_hash)
        record_admin_event(session=session, actor=principal.actor, action="user.password",
                           target=f"user:{user.username}")
    return UserRead.model_validate(user)
