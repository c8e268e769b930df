"""Sign-in sessions for the admin UI: an HMAC-signed cookie, CSRF tokens and role checks.

The session cookie carries the user id, the user's session epoch (bumped when the password,
role or disabled flag changes, which ends older sessions), a CSRF token and the time it was
issued; it is HttpOnly, SameSite=Lax, and Secure unless the UI is served over plain http on a
loopback address. Anonymous visitors get a session without a user so the login form has a
CSRF token too. Every POST must echo the session's CSRF token in the `csrf_token` field and,
when the browser sends an Origin header, come from this origin.

A browser that signed in gets a device cookie naming the user (signed, long-lived): password
checks from it are not held back by failures for that user elsewhere (controlplane/auth/
passwords.py), so nobody can lock a user out by guessing from other addresses.

Behind a trusted authenticating proxy (EXITPLANE_PROXY_USER_HEADER), a request whose connection
comes from the proxy is signed in as the user the proxy names (`sign_in_from_proxy`,
controlplane/auth/proxy.py): an ordinary session like any other.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass, replace
from typing import Annotated
from urllib.parse import urlsplit

from fastapi import Depends, Request
from starlette.responses import Response

from controlplane.auth import clients, sso
from controlplane.auth.models import User
from controlplane.auth.proxy import ProxySignIn
from controlplane.auth.sso import RefusalLog, RoleMapping, SsoRefused
from controlplane.auth.users import has_role
from controlplane.db import SessionDep
from controlplane.errors import DomainError, Forbidden
from controlplane.keys import secret_key

SESSION_COOKIE = "exitplane_session"
FLASH_COOKIE = "exitplane_flash"
SESSION_MAX_AGE_S = 12 * 3600
DEVICE_COOKIE = "exitplane_device"
DEVICE_MAX_AGE_S = 180 * 86400
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}


class LoginRequired(DomainError):
    """Raised by page dependencies when nobody is signed in; the UI redirects to /login."""

    status_code = 401


class CsrfFailed(DomainError):
    status_code = 403


@dataclass(frozen=True)
class UiSession:
    csrf: str
    issued: float
    user_id: int | None = None
    epoch: int = 0


@dataclass(frozen=True)
class SignedIn:
    """Who is signed in, as the page templates see it."""

    id: int
    username: str
    role: str


def _key(request: Request, purpose: str) -> bytes:
    # Never a constant: the configured key or the one generated under var_dir.
    secret = secret_key(request.app.state.settings).encode()
    return hmac.new(secret, f"exitplane-ui:{purpose}".encode(), hashlib.sha256).digest()


def _b64(raw: bytes) -> str:
    """Unpadded base64url: cookie-safe without quoting."""
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def sign(request: Request, purpose: str, payload: dict) -> str:
    body = _b64(json.dumps(payload, separators=(",", ":")).encode())
    mac = hmac.new(_key(request, purpose), body.encode(), hashlib.sha256).digest()
    return f"{body}.{_b64(mac)}"


def unsign(request: Request, purpose: str, value: str | None) -> dict | None:
    """The payload of a value made by `sign` for `purpose`, or None when forged or garbled."""
    if not value or "." not in value:
        return None
    body, _, mac = value.rpartition(".")
    expected = _b64(hmac.new(_key(request, purpose), body.encode(), hashlib.sha256).digest())
    if not hmac.compare_digest(expected.encode(), mac.encode()):
        return None
    try:
        payload = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    except ValueError:
        return None
    return payload if isinstance(payload, dict) else None


def cookie_secure(request: Request) -> bool:
    """Secure cookies everywhere except plain http on loopback (the embedded default)."""
    return not (request.url.scheme == "http" and request.url.hostname in LOOPBACK_HOSTS)


def cookie_path(request: Request) -> str:
    return request.scope.get("root_path", "").rstrip("/") or "/"


def read_session(request: Request) -> UiSession | None:
    payload = unsign(request, "session", request.cookies.get(SESSION_COOKIE))
    if payload is None:
        return None
    try:
        session = UiSession(csrf=str(payload["c"]), issued=float(payload["t"]),
                            user_id=payload.get("u"), epoch=int(payload.get("e", 0)))
    except (KeyError, TypeError, ValueError):
        return None
    if time.time() - session.issued > SESSION_MAX_AGE_S:
        return None
    return session


def current_session(request: Request) -> UiSession:
    """This request's session; a fresh anonymous one (cookie set on the response) if none."""
    cached = getattr(request.state, "ui_session", None)
    if cached is not None:
        return cached
    session = read_session(request)
    if session is None:
        session = UiSession(csrf=secrets.token_urlsafe(32), issued=time.time())
        request.state.ui_session_new = True
    request.state.ui_session = session
    return session


def start_session(request: Request, user: User) -> UiSession:
    """Sign `user` in: a new session with a new CSRF token (no fixation)."""
    session = UiSession(csrf=secrets.token_urlsafe(32), issued=time.time(), user_id=user.id,
                        epoch=user.session_epoch)
    request.state.ui_session = session
    request.state.ui_session_new = True
    return session


def end_session(request: Request) -> None:
    request.state.ui_session = replace(current_session(request), user_id=None,
                                       csrf=secrets.token_urlsafe(32))
    request.state.ui_session_new = True


def save_session(request: Request, response: Response) -> None:
    """Write the session cookie when this request created or changed the session."""
    if not getattr(request.state, "ui_session_new", False):
        return
    session: UiSession = request.state.ui_session
    value = sign(request, "session", {"c": session.csrf, "t": session.issued,
                                      "u": session.user_id, "e": session.epoch})
    response.set_cookie(SESSION_COOKIE, value, max_age=SESSION_MAX_AGE_S,
                        path=cookie_path(request), httponly=True, samesite="lax",
                        secure=cookie_secure(request))


def set_flash(request: Request, response: Response, text: str, kind: str = "ok") -> None:
    """A one-shot message shown on the next page (signed so it cannot be injected)."""
    response.set_cookie(FLASH_COOKIE, sign(request, "flash", {"k": kind, "m": text[:500]}),
                        max_age=60, path=cookie_path(request), httponly=True, samesite="lax",
                        secure=cookie_secure(request))


def read_flash(request: Request) -> dict | None:
    """The flash message sent with this request (see `clear_flash`)."""
    payload = unsign(request, "flash", request.cookies.get(FLASH_COOKIE))
    if payload is None:
        return None
    return {"kind": "error" if payload.get("k") == "error" else "ok", "text": payload.get("m")}


def clear_flash(request: Request, response: Response) -> None:
    if FLASH_COOKIE in request.cookies:
        response.delete_cookie(FLASH_COOKIE, path=cookie_path(request), httponly=True,
                               samesite="lax", secure=cookie_secure(request))


def client_address(request: Request) -> str:
    """The client's address: the connection's peer, or what trusted proxies say it is."""
    return clients.client_address(request.client.host if request.client else "",
                                  request.headers.getlist("x-forwarded-for"),
                                  request.app.state.trusted_proxies)


def known_device(request: Request, username: str) -> bool:
    """Whether this browser signed in as `username` within DEVICE_MAX_AGE_S."""
    payload = unsign(request, "device", request.cookies.get(DEVICE_COOKIE))
    if payload is None or payload.get("n") != username.strip().lower():
        return False
    issued = payload.get("t")
    return isinstance(issued, int | float) and time.time() - issued < DEVICE_MAX_AGE_S


def remember_device(request: Request, response: Response, user: User) -> None:
    """Mark this browser as one `user` signed in from (see `known_device`)."""
    response.set_cookie(DEVICE_COOKIE, sign(request, "device", {"n": user.username,
                                                                "t": time.time()}),
                        max_age=DEVICE_MAX_AGE_S, path=cookie_path(request), httponly=True,
                        samesite="lax", secure=cookie_secure(request))


def _proxy_sign_in(request: Request) -> ProxySignIn | None:
    """The UI's header sign-in configuration and its refusal log (made once per
    application)."""
    state = request.app.state
    if not hasattr(state, "proxy_sign_in"):
        state.proxy_refusals = RefusalLog()
        state.proxy_sign_in = ProxySignIn.from_settings(state.settings)
    return state.proxy_sign_in


def sign_in_from_proxy(request: Request) -> None:
    """Sign in the user a trusted authenticating proxy names in its header, unless this
    browser's session already is theirs with the role their groups map to (SsoRefused when
    they may not sign in). Runs in transactions of its own, before the request's unit of work
    has begun (on SQLite that one holds the store's write lock from its first statement), and
    commits whatever the page does next: a session never names a user that was rolled back."""
    proxy = _proxy_sign_in(request)
    if proxy is None:
        return
    identity = proxy.identity(peer=request.client.host if request.client else "",
                              headers=request.headers)
    if identity is None:
        return
    ui_session = current_session(request)
    mapping = RoleMapping.from_settings(request.app.state.settings)
    address = client_address(request)
    with request.app.state.session_factory() as session:
        if ui_session.user_id is not None:
            user = session.get(User, ui_session.user_id)
            if user is not None and not user.disabled and user.origin == sso.SSO_ORIGIN \
                    and user.session_epoch == ui_session.epoch \
                    and user.username == identity.username.strip().lower() \
                    and user.role == mapping.role_of(identity.groups):
                return
        try:
            user = sso.sign_in(session=session, identity=identity, mapping=mapping,
                               address=address)
            session.commit()
        except SsoRefused as refused:
            session.rollback()
            if request.app.state.proxy_refusals.due(identity.username, str(refused),
                                                    time.monotonic()):
                sso.record_refusal(session=session, identity=identity, method="proxy",
                                   address=address, reason=str(refused))
                session.commit()
            raise
    start_session(request, user)


def optional_user(request: Request, session: SessionDep) -> User | None:
    sign_in_from_proxy(request)
    ui_session = current_session(request)
    if ui_session.user_id is None:
        return None
    user = session.get(User, ui_session.user_id)
    if user is None or user.disabled or user.session_epoch != ui_session.epoch:
        return None
    return user


def current_user(request: Request,
                 user: Annotated[User | None, Depends(optional_user)]) -> User:
    if user is None:
        raise LoginRequired("sign in to continue")
    # A detached copy for templates: an error page renders after the unit of work rolled back.
    request.state.user = SignedIn(id=user.id, username=user.username, role=user.role)
    return user


def role(name: str):
    """A dependency admitting users holding role `name` or a stronger one."""

    def dependency(user: Annotated[User, Depends(current_user)]) -> User:
        if not has_role(user, name):
            raise Forbidden(f"this needs the {name} role; you are signed in as a {user.role}")
        return user

    return dependency


async def check_csrf(request: Request) -> None:
    """Refuse a POST without the session's CSRF token or from another origin."""
    origin = request.headers.get("origin")
    if origin and origin != "null":
        parts = urlsplit(origin)
        if parts.netloc != request.headers.get("host", ""):
            raise CsrfFailed("this form was sent from another site; reload the page and retry")
    form = await request.form()
    sent = form.get("csrf_token")
    session = read_session(request)
    if session is None or not isinstance(sent, str) or \
            not hmac.compare_digest(sent.encode(), session.csrf.encode()):
        raise CsrfFailed("the form expired or was not sent from this site; "
                         "reload the page and retry")


Csrf = Depends(check_csrf)
Viewer = Annotated[User, Depends(role("viewer"))]
Operator = Annotated[User, Depends(role("operator"))]
Admin = Annotated[User, Depends(role("admin"))]


def actor(user: User) -> str:
    """How a person appears in the audit log."""
    return f"user:{user.username}"
