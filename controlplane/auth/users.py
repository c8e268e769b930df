"""People who sign in to the admin UI: argon2-hashed passwords and roles viewer/operator/admin.

Plain keyword-only functions that flush, never commit. Changing a user's password, role or
disabled flag bumps `session_epoch`, which invalidates every session cookie issued before.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controlplane.auth.audit import LOCAL_ACTOR, record_admin_event
from controlplane.auth.models import ROLES, User
from controlplane.db import utcnow
from controlplane.errors import Conflict, Forbidden, Invalid, NotFound, Unauthorized

ROLE_RANK = {"viewer": 0, "operator": 1, "admin": 2}
USERNAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_.@-]{0,63}$")
MIN_PASSWORD_LENGTH = 12

# argon2id at OWASP's recommended minimum (19 MiB, 2 passes, 1 lane): an API process runs
# EXITPLANE_PASSWORD_CHECKS_MAX_CONCURRENT checks at once, so a sign-in flood grows it by that
# many times 19 MiB at most (with argon2-cffi's default, 64 MiB, two checks alone were 128 MiB).
# A hash made with other parameters still verifies, and is replaced at its next sign-in
# (`rehashed`).
PASSWORD_HASH_MEMORY_MIB = 19
_hasher = PasswordHasher(time_cost=2, memory_cost=PASSWORD_HASH_MEMORY_MIB * 1024,
                         parallelism=1)
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


def create_user(*, session: Session, username: str, role: str, password: str | None = None,
                password_hash: str | None = None, actor: str = LOCAL_ACTOR) -> User:
    """Create a user; the username is stored lowercase. Give `password_hash` (from
    `new_password_hash`, made before the caller's transaction began), or `password`: it is
    then hashed here before this function's first statement, so a caller that holds no
    transaction yet (a fresh session) holds none while it is hashed."""
    username = username.strip().lower()
    if not USERNAME_PATTERN.match(username):
        raise Invalid("usernames are 1-64 characters: lowercase letters, digits, _ . @ -, "
                      "starting with a letter or digit")
    _check_role(role)
    if password_hash is None:
        password_hash = new_password_hash(password or "")
    if session.scalar(select(User.id).where(User.username == username)) is not None:
        raise Conflict(f"user {username!r} already exists")
    user = User(username=username, password_hash=password_hash, role=role)
    session.add(user)
    session.flush()
    record_admin_event(session=session, actor=actor, action="user.create",
                       target=f"user:{user.username}", details={"role": user.role})
    return user


@dataclass(frozen=True)
class Credentials:
    """What checking a user's password needs, read in a transaction that ends before the check
    (controlplane/guards/password_checks.py: on SQLite a transaction holds the store's write
    lock)."""

    user_id: int
    username: str
    password_hash: str
    disabled: bool


def find_credentials(*, session: Session, username: str | None = None,
                     user_id: int | None = None) -> Credentials | None:
    """The credentials of the user with this username (any case) or id, or None."""
    query = select(User.id, User.username, User.password_hash, User.disabled)
    query = (query.where(User.id == user_id) if user_id is not None
             else query.where(User.username == (username or "").strip().lower()))
    row = session.execute(query).one_or_none()
    return Credentials(user_id=row.id, username=row.username, password_hash=row.password_hash,
                       disabled=row.disabled) if row else None


def password_matches(password_hash: str | None, password: str) -> bool:
    """Whether `password` matches `password_hash` (an argon2id verify: 19 MiB and tens of ms,
    so never inside a transaction). Without a hash (no such user) a dummy one is checked, so a
    miss costs as much as a wrong password."""
    try:
        return _hasher.verify(password_hash or _DUMMY_HASH, password) and bool(password_hash)
    except (VerifyMismatchError, VerificationError, InvalidHashError):
        return False


def hash_password(password: str) -> str:
    """A new argon2id hash of `password` (as costly as a check)."""
    return _hasher.hash(password)


def new_password_hash(password: str) -> str:
    """The hash of a new `password` once its length is checked (Invalid): an argon2id hash,
    19 MiB and tens of ms, so never inside a transaction (on SQLite one holds the store's
    write lock); the admin UI takes it through `PasswordChecks.new_hash`, which bounds how
    many run at once."""
    _check_password(password)
    return hash_password(password)


def rehashed(password_hash: str, password: str) -> str | None:
    """A new hash of the (right) `password` when `password_hash` was made with older
    parameters, else None."""
    return _hasher.hash(password) if _hasher.check_needs_rehash(password_hash) else None


def record_sign_in(*, session: Session, credentials: Credentials,
                   new_hash: str | None = None) -> User:
    """Record the sign-in of the user whose password `credentials` matched: Unauthorized if
    that user was disabled, or changed password, since they were read."""
    user = session.get(User, credentials.user_id)
    if user is None or user.disabled or user.password_hash != credentials.password_hash:
        raise Unauthorized("wrong username or password")
    if new_hash is not None:
        user.password_hash = new_hash
    user.last_login_at = utcnow()
    session.flush()
    return user


def authenticate_user(*, session: Session, username: str, password: str) -> User:
    """The enabled user with this username and password, or Unauthorized (same message for all
    failures, so the form does not reveal which usernames exist). In one transaction: the
    admin UI runs the same steps with the check outside any
    (controlplane/guards/password_checks.py)."""
    credentials = find_credentials(session=session, username=username)
    if not password_matches(credentials.password_hash if credentials else None, password) \
            or credentials is None or credentials.disabled:
        raise Unauthorized("wrong username or password")
    return record_sign_in(session=session, credentials=credentials,
                          new_hash=rehashed(credentials.password_hash, password))


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


def set_role(*, session: Session, user: User, role: str, actor: str = LOCAL_ACTOR) -> User:
    """Change a user's role (an audit event of `actor`); the last enabled admin cannot be
    demoted."""
    _check_role(role)
    if user.role == "admin" and role != "admin" and _admins_left(session, user) == 0:
        raise Conflict("this is the last enabled admin; make another admin first")
    if role != user.role:
        record_admin_event(session=session, actor=actor, action="user.role",
                           target=f"user:{user.username}",
                           details={"from": user.role, "to": role})
        user.role = role
        user.session_epoch += 1
    session.flush()
    return user


def set_disabled(*, session: Session, user: User, disabled: bool,
                 actor: str = LOCAL_ACTOR) -> User:
    """Disable (sign out everywhere, refuse sign-in) or re-enable a user (an audit event of
    `actor`)."""
    if disabled and user.role == "admin" and not user.disabled \
            and _admins_left(session, user) == 0:
        raise Conflict("this is the last enabled admin; make another admin first")
    if disabled != user.disabled:
        record_admin_event(session=session, actor=actor,
                           action="user.disable" if disabled else "user.enable",
                           target=f"user:{user.username}")
        user.disabled = disabled
        user.session_epoch += 1
    session.flush()
    return user


def set_password(*, session: Session, user: User, password_hash: str) -> User:
    """Replace the password with one hashed by `new_password_hash` (outside any transaction);
    sessions signed in with the old one end. Invalid for a single sign-on user (origin `sso`),
    whom no password signs in."""
    if user.origin != "local":
        raise Invalid(f"{user.username!r} signs in through single sign-on and has no password "
                      "here; create a local user for break-glass access")
    return _replace_hash(session=session, user=user, new_hash=password_hash)


def _replace_hash(*, session: Session, user: User, new_hash: str) -> User:
    user.password_hash = new_hash
    user.session_epoch += 1
    session.flush()
    return user


def check_new_password(*, current: str, new: str) -> None:
    """Invalid when `new` may not replace `current` (too short or long, or the same)."""
    _check_password(new)
    if new == current:
        raise Invalid("the new password is the same as the current one")


def replace_checked_password(*, session: Session, credentials: Credentials,
                             new_hash: str) -> User:
    """Store `new_hash` for the user whose current password `credentials` matched; Conflict if
    the password changed since it was read. Sessions signed in with the old one end."""
    user = session.get(User, credentials.user_id)
    if user is None or user.password_hash != credentials.password_hash:
        raise Conflict("the password was changed meanwhile; sign in again")
    return _replace_hash(session=session, user=user, new_hash=new_hash)


def change_own_password(*, session: Session, user: User, current: str, new: str) -> User:
    """A user replacing their own password: the current one must be right. In one
    transaction: the admin UI runs the same steps with the check outside any."""
    if not password_matches(user.password_hash, current):
        raise Unauthorized("the current password is wrong")
    check_new_password(current=current, new=new)
    return _replace_hash(session=session, user=user, new_hash=hash_password(new))


def end_sessions(*, session: Session, user: User) -> User:
    """Invalidate every session cookie issued to `user` (sign-out everywhere)."""
    user.session_epoch += 1
    session.flush()
    return user
