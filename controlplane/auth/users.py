"""People who sign in to the admin UI: argon2-hashed passwords and roles viewer/operator/admin.

Plain keyword-only functions that flush, never commit. Changing a user's password, role or
disabled flag bumps `session_epoch`, which invalidates every session cookie issued before.
"""

from __future__ import annotations

import re

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controlplane.auth.models import ROLES, User
from controlplane.db import utcnow
from controlplane.errors import Conflict, Forbidden, Invalid, NotFound, Unauthorized

ROLE_RANK = {"viewer": 0, "operator": 1, "admin": 2}
USERNAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_.@-]{0,63}$")
MIN_PASSWORD_LENGTH = 12

_hasher = PasswordHasher()
# Verified against when the username is unknown, so a miss costs as much as a wrong password.
_DUMMY_HASH = _hasher.hash("exitplane-no-such-user")


def has_role(user: User, role: str) -> bool:
    """Whether `user` holds `role` or a stronger one (viewer < operator < admin)."""
    return ROLE_RANK[user.role] >= ROLE_RANK[role]


def require_role(user: User, role: str) -> None:
    if not has_role(user, role):
        raise Forbidden(f"this needs the {role} role; {user.username!r} is a {user.role}")


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise Invalid(f"unknown role {role!r}; use one of {', '.join(ROLES)}")


def _check_password(password: str) -> None:
    if len(password) < MIN_PASSWORD_LENGTH:
        raise Invalid(f"passwords need at least {MIN_PASSWORD_LENGTH} characters")
    if len(password) > 1024:
        raise Invalid("passwords are limited to 1024 characters")


def create_user(*, session: Session, username: str, password: str, role: str) -> User:
    """Create a user; the username is stored lowercase."""
    username = username.strip().lower()
    if not USERNAME_PATTERN.match(username):
        raise Invalid("usernames are 1-64 characters: lowercase letters, digits, _ . @ -, "
                      "starting with a letter or digit")
    _check_role(role)
    _check_password(password)
    if session.scalar(select(User.id).where(User.username == username)) is not None:
        raise Conflict(f"user {username!r} already exists")
    user = User(username=username, password_hash=_hasher.hash(password), role=role)
    session.add(user)
    session.flush()
    return user


def authenticate_user(*, session: Session, username: str, password: str) -> User:
    """The enabled user with this username and password, or Unauthorized (same message for all
    failures, so the form does not reveal which usernames exist)."""
    user = session.scalars(select(User).where(
        User.username == username.strip().lower())).one_or_none()
    try:
        _hasher.verify(user.password_hash if user else _DUMMY_HASH, password)
    except (VerifyMismatchError, VerificationError, InvalidHashError):
        user = None
    else:
        if user is not None and user.disabled:
            user = None
    if user is None:
        raise Unauthorized("wrong username or password")
    if _hasher.check_needs_rehash(user.password_hash):
        user.password_hash = _hasher.hash(password)
    user.last_login_at = utcnow()
    session.flush()
    return user


def get_user(*, session: Session, user_id: int) -> User:
    user = session.get(User, user_id)
    if user is None:
        raise NotFound(f"user {user_id} does not exist")
    return user


def list_users(*, session: Session) -> list[User]:
    return list(session.scalars(select(User).order_by(User.username)))


def _admins_left(session: Session, without: User) -> int:
    return session.scalar(select(func.count()).select_from(User).where(
        User.role == "admin", User.disabled.is_(False), User.id != without.id)) or 0


def set_role(*, session: Session, user: User, role: str) -> User:
    """Change a user's role; the last enabled admin cannot be demoted."""
    _check_role(role)
    if user.role == "admin" and role != "admin" and _admins_left(session, user) == 0:
        raise Conflict("this is the last enabled admin; make another admin first")
    if role != user.role:
        user.role = role
        user.session_epoch += 1
    session.flush()
    return user


def set_disabled(*, session: Session, user: User, disabled: bool) -> User:
    """Disable (sign out everywhere, refuse sign-in) or re-enable a user."""
    if disabled and user.role == "admin" and not user.disabled \
            and _admins_left(session, user) == 0:
        raise Conflict("this is the last enabled admin; make another admin first")
    if disabled != user.disabled:
        user.disabled = disabled
        user.session_epoch += 1
    session.flush()
    return user


def set_password(*, session: Session, user: User, password: str) -> User:
    """Replace the password; sessions signed in with the old one end."""
    _check_password(password)
    user.password_hash = _hasher.hash(password)
    user.session_epoch += 1
    session.flush()
    return user


def change_own_password(*, session: Session, user: User, current: str, new: str) -> User:
    """A user replacing their own password: the current one must be right."""
    try:
        _hasher.verify(user.password_hash, current)
    except (VerifyMismatchError, VerificationError, InvalidHashError):
        raise Unauthorized("the current password is wrong") from None
    if new == current:
        raise Invalid("the new password is the same as the current one")
    return set_password(session=session, user=user, password=new)


def end_sessions(*, session: Session, user: User) -> User:
    """Invalidate every session cookie issued to `user` (sign-out everywhere)."""
    user.session_epoch += 1
    session.flush()
    return user
