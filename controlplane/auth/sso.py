"""Users who sign in through single sign-on: an OpenID Connect provider (controlplane/auth/
oidc.py) or a trusted authenticating proxy (controlplane/auth/proxy.py).

Their role comes from their groups through EXITPLANE_SSO_ROLE_MAPPING (the strongest mapped
role wins; none mapped: EXITPLANE_SSO_DEFAULT_ROLE, else refused) and is applied at every
sign-in. A user is created at their first sign-in with origin `sso`; no password works for them
(their hash is of a random secret nobody holds, and an admin cannot set one). A local user's
name is never taken over by a single sign-on: local users stay the break-glass way in. An
OpenID Connect user is bound to the provider's issuer and subject at their first sign-in, so a
renamed account at the provider cannot sign in as another user whose name it now carries. A
single sign-on user belongs to the method that created them: a user bound to a provider's
subject is refused through the proxy, and one the proxy created (bound to no subject) is refused
through OpenID Connect. A username is taken only as ASCII (checked before it is lowercased: the
Kelvin sign "\u212a" lowercases to "k").

Every sign-in and every refusal is an administrative audit event of the user it names
(`user.sso_sign_in`, `user.sso_refused`); a refusal is recorded in a transaction of its own,
since the refused request's unit of work rolls back.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from controlplane.auth import users
from controlplane.auth.audit import record_admin_event
from controlplane.auth.models import User
from controlplane.db import utcnow
from controlplane.errors import Conflict, Forbidden

SSO_ORIGIN = "sso"
# Groups kept in an audit event's details (a directory may put hundreds in a token).
AUDITED_GROUPS = 20
UNVERIFIED_ACTOR = "sso:unverified"


@dataclass(frozen=True)
class SsoIdentity:
    """Who a provider or proxy says signed in: a username as given (checked here), their
    groups, how (`oidc` or `proxy`) and, from a provider, the issuer and subject the ID token
    was signed for ("<iss> <sub>": the identity that stays when a username is renamed)."""

    username: str
    groups: tuple[str, ...]
    method: str
    subject: str | None = None


@dataclass(frozen=True)
class RoleMapping:
    """EXITPLANE_SSO_ROLE_MAPPING and EXITPLANE_SSO_DEFAULT_ROLE."""

    groups: dict[str, str]
    default_role: str = ""

    @classmethod
    def from_settings(cls, settings) -> RoleMapping:
        return cls(groups=dict(settings.sso_role_mapping), default_role=settings.sso_default_role)

    def role_of(self, groups: Iterable[str]) -> str | None:
        """The strongest role `groups` map to, the default role, or None."""
        roles = [self.groups[group] for group in groups if group in self.groups]
        if roles:
            return max(roles, key=users.ROLE_RANK.__getitem__)
        return self.default_role or None


class SsoRefused(Forbidden):
    """A single sign-on refused for who the user is (no role, a local user's name, disabled)."""


@cache
def _unusable_hash() -> str:
    """An argon2id hash of a random secret no one holds, made once per process: checking a
    password against it costs what any check costs and never matches."""
    return users.hash_password(secrets.token_urlsafe(32))


def username_of(raw: str) -> str | None:
    """The exitplane username a provider or proxy name stands for (lowercased), or None when
    it cannot be one: only an ASCII name is lowercased, since some other characters lowercase
    to ASCII letters and would take another user's name."""
    name = raw.strip()
    if not name.isascii() or not users.USERNAME_PATTERN.fullmatch(name.lower()):
        return None
    return name.lower()


def actor_of(username: str) -> str:
    """How a user appears in the audit log (as the admin UI writes it)."""
    return f"user:{username}"


def _audited(identity: SsoIdentity, address: str) -> dict:
    return {"method": identity.method, "address": address,
            "groups": list(identity.groups[:AUDITED_GROUPS])}


def sign_in(*, session: Session, identity: SsoIdentity, mapping: RoleMapping,
            address: str) -> User:
    """The user `identity` names, created (origin `sso`) or brought up to date (role from the
    mapping), with the sign-in recorded; SsoRefused when they may not sign in (a name that
    cannot be an exitplane username included). Flushes; the caller commits."""
    username = username_of(identity.username)
    if username is None:
        raise SsoRefused(f"{identity.username.strip()[:80]!r} cannot be an exitplane username "
                         "(1-64 of a-z 0-9 _ . @ -, ASCII only); ask an admin to choose another "
                         "claim or header")
    user = session.scalar(select(User).where(User.username == username))
    if user is not None and user.origin != SSO_ORIGIN:
        raise SsoRefused(f"{username!r} is a local exitplane user, who signs in with a password; "
                         "single sign-on does not sign in as them")
    if user is not None:
        _check_method(user=user, identity=identity)
    role = mapping.role_of(identity.groups)
    if role is None:
        raise SsoRefused(f"none of your groups ({', '.join(identity.groups[:10]) or 'none'}) is"
                         " given a role in exitplane; ask an admin to map one "
                         "(EXITPLANE_SSO_ROLE_MAPPING)")
    actor = actor_of(username)
    if user is None:
        user = _provision(session=session, username=username, role=role, actor=actor,
                          identity=identity)
    if identity.subject is not None:
        if user.sso_subject is None:
            user.sso_subject = identity.subject
        elif user.sso_subject != identity.subject:
            raise SsoRefused(f"{username!r} belongs to another account at the identity "
                             "provider (not the one this user first signed in with); ask an "
                             "admin")
    if user.disabled:
        raise SsoRefused(f"{username!r} is disabled in exitplane; ask an admin")
    if user.role != role:
        try:
            users.set_role(session=session, user=user, role=role, actor=actor)
        except Conflict as error:
            raise SsoRefused(f"your groups now give the {role} role, but {error}") from None
    user.last_login_at = utcnow()
    record_admin_event(session=session, actor=actor, action="user.sso_sign_in",
                       target=f"user:{username}",
                       details={**_audited(identity, address), "role": role})
    session.flush()
    return user


def _check_method(*, user: User, identity: SsoIdentity) -> None:
    """A single sign-on user signs in only by the method that created them: a provider's
    subject is bound at the first OpenID Connect sign-in, and the proxy binds none."""
    if identity.method == "proxy" and user.sso_subject is not None:
        raise SsoRefused(f"{user.username!r} signs in through the OpenID Connect provider, "
                         "which vouched for them first; the authenticating proxy does not sign "
                         "in as them")
    if identity.method == "oidc" and user.sso_subject is None:
        raise SsoRefused(f"{user.username!r} signs in through the authenticating proxy, which "
                         "created them; OpenID Connect does not sign in as them (ask an admin)")


def _provision(*, session: Session, username: str, role: str, actor: str,
               identity: SsoIdentity) -> User:
    """A new single sign-on user; when a concurrent first sign-in of the same person created
    them first, that user (still checked: a single sign-on user of `identity`'s method)."""
    try:
        with session.begin_nested():
            user = users.create_user(session=session, username=username, role=role,
                                     password_hash=_unusable_hash(), actor=actor)
            user.origin = SSO_ORIGIN
            session.flush()
            return user
    except (IntegrityError, Conflict):
        user = session.scalar(select(User).where(User.username == username))
        if user is None or user.origin != SSO_ORIGIN:
            raise SsoRefused(f"{username!r} is a local exitplane user, who signs in with a "
                             "password; single sign-on does not sign in as them") from None
        _check_method(user=user, identity=identity)
        return user


def record_refusal(*, session: Session, identity: SsoIdentity | None, method: str,
                   address: str, reason: str) -> None:
    """Record a refused single sign-on (in the caller's transaction, which must be one of its
    own). `identity` None: nothing verified names a user (a forged or expired token)."""
    username = username_of(identity.username) if identity else None
    details = _audited(identity, address) if identity else {"method": method,
                                                            "address": address}
    if identity and username is None:  # a name no user can have: kept as given, in details
        details["username"] = identity.username.strip()[:80]
    actor = actor_of(username) if username else UNVERIFIED_ACTOR
    record_admin_event(session=session, actor=actor, action="user.sso_refused",
                       target=actor if username else f"address:{address}",
                       reason=reason[:500], details=details)


class RefusalLog:
    """Refusals recorded at most once per (username, reason) and `every_s` seconds in this
    process: a proxy-authenticated user without a role is refused on every request."""

    def __init__(self, every_s: float = 60.0, capacity: int = 10_000) -> None:
        self.every_s, self.capacity = every_s, capacity
        self._last: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def due(self, username: str, reason: str, now: float) -> bool:
        key = (username, reason)
        with self._lock:
            if now - self._last.get(key, float("-inf")) < self.every_s:
                return False
            if len(self._last) >= self.capacity:
                self._last = {k: t for k, t in self._last.items() if now - t < self.every_s}
            self._last[key] = now
            return True
