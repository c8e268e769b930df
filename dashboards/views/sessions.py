"""Sign in, sign out, and your own account."""

from __future__ import annotations

import math
from typing import Annotated

from fastapi import APIRouter, Depends, Form, Request
from fastapi.responses import Response

from controlplane.auth import users
from controlplane.auth.models import User
from controlplane.db import SessionDep
from controlplane.errors import DomainError, Invalid, RateLimited, Unauthorized
from controlplane.guards.password_checks import PasswordChecks
from dashboards.security import (
    Csrf,
    client_address,
    current_user,
    end_session,
    known_device,
    optional_user,
    remember_device,
    start_session,
)
from dashboards.templating import redirect, render, ui_root

router = APIRouter()


def _sentence(error: Exception) -> str:
    text = str(error)
    return f"{text[:1].upper()}{text[1:]}."


def _safe_next(request: Request, wanted: str | None) -> str:
    """Only paths inside the UI: never another site (open redirect)."""
    root = ui_root(request)
    if wanted and wanted.startswith(root + "/") and not wanted.startswith("//") \
            and "\\" not in wanted:
        return wanted[len(root):]
    return "/"


@router.get("/login")
def login_page(request: Request, user: Annotated[User | None, Depends(optional_user)],
               next: str = "") -> Response:
    if user is not None:
        return redirect(request, _safe_next(request, next))
    return render(request, "login.html", next=next, username="")


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
        page = render(request, "login.html", status_code=429, next=next, username=username,
                      error=_sentence(error))
        page.headers["Retry-After"] = str(max(1, math.ceil(error.retry_after)))
        return page
    except Unauthorized:
        return render(request, "login.html", status_code=401, next=next, username=username,
                      error="Wrong username or password.")
    start_session(request, user)
    response = redirect(request, _safe_next(request, next))
    remember_device(request, response, user)
    return response


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
