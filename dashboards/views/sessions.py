"""Sign in (a password, or single sign-on through an OpenID Connect provider), sign out, and
your own account."""

from __future__ import annotations

import math
import re
import time
from typing import Annotated

from fastapi import APIRouter, Depends, Form, Query, Request
from fastapi.responses import RedirectResponse, Response

from controlplane.auth import sso, users
from controlplane.auth.models import User
from controlplane.auth.oidc import OidcClient, SignInRefused, client_for
from controlplane.auth.sso import RoleMapping, SsoIdentity, SsoRefused
from controlplane.db import SessionDep
from controlplane.errors import (
    DomainError,
    Invalid,
    NotFound,
    RateLimited,
    Unauthorized,
    Unavailable,
)
from controlplane.guards.password_checks import PasswordChecks
from dashboards.security import (
    Csrf,
    client_address,
    cookie_path,
    cookie_secure,
    current_user,
    end_session,
    known_device,
    optional_user,
    remember_device,
    sign,
    start_session,
    unsign,
)
from dashboards.templating import redirect, render, ui_root

router = APIRouter()

# The browser's half of an OpenID Connect sign-in under way: state, nonce, PKCE verifier,
# redirect URI and where to go after, in a signed HttpOnly cookie that the callback consumes.
FLOW_COOKIE = "exitplane_oidc"
FLOW_MAX_AGE_S = 600
# The name single sign-on callbacks are throttled under, with the client's address.
SSO_THROTTLE_NAME = "sso:oidc"
ERROR_CODE = re.compile(r"[a-z_]{1,40}")


def _sentence(error: Exception) -> str:
    text = str(error)
    return f"{text[:1].upper()}{text[1:]}."


def _safe_next(request: Request, wanted: str | None) -> str:
    """Only paths inside the UI: never another site (open redirect), and nothing a browser
    would rewrite (backslashes, whitespace or control characters, which browsers drop)."""
    root = ui_root(request)
    if wanted and wanted.startswith(root + "/") and not wanted.startswith("//") \
            and "\\" not in wanted and not any(c <= " " or c == "\x7f" for c in wanted):
        return wanted[len(root):]
    return "/"


def _oidc(request: Request) -> OidcClient | None:
    return client_for(request.app.state.settings)


def _login_page(request: Request, *, status_code: int = 200, next: str = "",
                username: str = "", error: str | None = None) -> Response:
    oidc = _oidc(request)
    return render(request, "login.html", status_code=status_code, next=next,
                  username=username, error=error,
                  sso_name=oidc.config.display_name if oidc else None)


@router.get("/login")
def login_page(request: Request, user: Annotated[User | None, Depends(optional_user)],
               next: str = "") -> Response:
    if user is not None:
        return redirect(request, _safe_next(request, next))
    return _login_page(request, next=next)


@router.post("/login", dependencies=[Csrf])
def login(request: Request, username: Annotated[str, Form(max_length=200)],
          password: Annotated[str, Form(max_length=1024)],
          next: Annotated[str, Form()] = "") -> Response:
    # No request-long store session: the password check runs outside any transaction.
    checks: PasswordChecks = request.app.state.password_checks
    try:
        user = checks.sign_in(username=username, password=password,
                              address=client_address(request),
                              per_user=not known_device(request, username))
    except RateLimited as error:
        page = _login_page(request, status_code=429, next=next, username=username,
                           error=_sentence(error))
        page.headers["Retry-After"] = str(max(1, math.ceil(error.retry_after)))
        return page
    except Unauthorized:
        return _login_page(request, status_code=401, next=next, username=username,
                           error="Wrong username or password.")
    start_session(request, user)
    response = redirect(request, _safe_next(request, next))
    remember_device(request, response, user)
    return response


def _redirect_uri(request: Request) -> str:
    """Where the provider sends the browser back: under EXITPLANE_PUBLIC_URL when set (what is
    registered at the provider), else under the address this request came to."""
    base = request.app.state.settings.public_url.rstrip("/") \
        or f"{request.url.scheme}://{request.url.netloc}"
    return f"{base}{ui_root(request)}/login/oidc/callback"


def _drop_flow(request: Request, response: Response) -> Response:
    response.delete_cookie(FLOW_COOKIE, path=cookie_path(request), httponly=True,
                           samesite="lax", secure=cookie_secure(request))
    return response


@router.get("/login/oidc")
def oidc_sign_in(request: Request, next: Annotated[str, Query(max_length=2000)] = ""
                 ) -> Response:
    """Start a single sign-on: to the provider, with this browser's flow in a signed cookie."""
    oidc = _oidc(request)
    if oidc is None:
        raise NotFound("single sign-on is not configured here (EXITPLANE_OIDC_ISSUER)")
    redirect_uri = _redirect_uri(request)
    started = oidc.start(redirect_uri=redirect_uri)
    response = RedirectResponse(started.url, status_code=303,
                                headers={"Cache-Control": "no-store"})
    response.set_cookie(FLOW_COOKIE, sign(request, "oidc", {
        "s": started.state, "n": started.nonce, "v": started.code_verifier, "r": redirect_uri,
        "x": next, "t": time.time()}), max_age=FLOW_MAX_AGE_S, path=cookie_path(request),
        httponly=True, samesite="lax", secure=cookie_secure(request))
    return response


def _flow_under_way(request: Request) -> dict | None:
    """The sign-in this browser started (oidc_sign_in's signed cookie) while it is fresh and
    whole, else None."""
    flow = unsign(request, "oidc", request.cookies.get(FLOW_COOKIE))
    if not isinstance(flow, dict):
        return None
    started = flow.get("t")
    if not isinstance(started, int | float) or time.time() - started > FLOW_MAX_AGE_S \
            or not all(isinstance(flow.get(key), str) for key in "snvrx"):
        return None
    return flow


@router.get("/login/oidc/callback")
def oidc_callback(request: Request,
                  code: Annotated[str, Query(max_length=4096)] = "",
                  state: Annotated[str, Query(max_length=512)] = "",
                  error: Annotated[str, Query(max_length=200)] = "") -> Response:
    """The provider's answer: verified, the user signed in with their mapped role (and created
    at their first sign-in); refused, the login page says why and no session starts. Only the
    answer to a sign-in this browser started (its signed flow cookie) is looked at: any other
    request here is refused at once (400), neither counted by the sign-in throttle nor
    recorded, so a page elsewhere cannot lock single sign-on for an address by sending
    browsers here. An answer that is looked at counts against the throttle from the client's
    address until one succeeds."""
    oidc = _oidc(request)
    if oidc is None:
        raise NotFound("single sign-on is not configured here (EXITPLANE_OIDC_ISSUER)")
    flow = _flow_under_way(request)
    if flow is None:
        return _drop_flow(request, _login_page(
            request, status_code=400,
            error="Single sign-on refused: this browser has no single sign-on under way (it "
                  f"took longer than {FLOW_MAX_AGE_S // 60} minutes, began in another browser, "
                  "or was answered already). Start again with the sign-in button."))
    address = client_address(request)
    checks: PasswordChecks = request.app.state.password_checks
    attempt = checks.throttle.attempt(SSO_THROTTLE_NAME, address, per_user=False)
    if attempt.wait > 0:
        page = _login_page(request, status_code=429, error="Too many refused single sign-ons "
                           f"from your address; try again in {math.ceil(attempt.wait)} s.")
        page.headers["Retry-After"] = str(max(1, math.ceil(attempt.wait)))
        return _drop_flow(request, page)
    factory = request.app.state.session_factory
    identity: SsoIdentity | None = None
    try:
        if error:
            # Only the standard error code: the description is free text anyone can put in
            # a link to this page.
            raise SignInRefused("the identity provider did not sign you in ("
                                f"{error if ERROR_CODE.fullmatch(error) else 'an error'})")
        verified = oidc.finish(code=code, state=state, expected_state=flow["s"],
                               nonce=flow["n"], code_verifier=flow["v"],
                               redirect_uri=flow["r"])
        identity = SsoIdentity(username=verified.username, groups=verified.groups,
                               method="oidc",
                               subject=f"{oidc.config.issuer} {verified.subject}")
        with factory() as session:
            user = sso.sign_in(session=session, identity=identity,
                               mapping=RoleMapping.from_settings(request.app.state.settings),
                               address=address)
            session.commit()
    except Unavailable:
        # Not the client's doing: the attempt counted above is given back.
        checks.throttle.succeeded(SSO_THROTTLE_NAME, address, per_user=False)
        raise
    except (SignInRefused, SsoRefused) as refused:
        with factory() as session:
            sso.record_refusal(session=session, identity=identity, method="oidc",
                               address=address, reason=str(refused))
            session.commit()
        return _drop_flow(request, _login_page(
            request, status_code=refused.status_code,
            error=f"Single sign-on refused: {refused}."))
    checks.throttle.succeeded(SSO_THROTTLE_NAME, address, per_user=False)
    start_session(request, user)
    return _drop_flow(request, redirect(request, _safe_next(request, flow.get("x"))))


@router.post("/logout", dependencies=[Csrf])
def logout(request: Request, session: SessionDep,
           user: Annotated[User, Depends(current_user)]) -> Response:
    """Sign out; a copy of the cookie taken earlier stops working too (on every device)."""
    users.end_sessions(session=session, user=user)
    end_session(request)
    return redirect(request, "/login", "You are signed out.")


@router.get("/account")
def account_page(request: Request, user: Annotated[User, Depends(current_user)]) -> Response:
    return render(request, "account.html", account=user,
                  min_password=users.MIN_PASSWORD_LENGTH)


@router.post("/account/password", dependencies=[Csrf])
def change_password(request: Request, session: SessionDep,
                    user: Annotated[User, Depends(current_user)],
                    current: Annotated[str, Form(max_length=1024)] = "",
                    new: Annotated[str, Form(max_length=1024)] = "",
                    confirm: Annotated[str, Form(max_length=1024)] = "") -> Response:
    """Change your own password; your other sessions end, this one continues."""
    session.commit()  # ends the transaction that found `user`: none spans the check
    checks: PasswordChecks = request.app.state.password_checks
    try:
        if new != confirm:
            raise Invalid("the two new passwords differ")
        changed = checks.change_password(user_id=user.id, current=current, new=new,
                                         address=client_address(request),
                                         per_user=not known_device(request, user.username))
    except RateLimited as error:
        page = render(request, "account.html", status_code=429, account=user,
                      min_password=users.MIN_PASSWORD_LENGTH,
                      error=_sentence(error))
        page.headers["Retry-After"] = str(max(1, math.ceil(error.retry_after)))
        return page
    except DomainError as error:
        return redirect(request, "/account", str(error), "error")
    start_session(request, changed)
    return redirect(request, "/account", "Password changed; your other sessions are signed out.")
