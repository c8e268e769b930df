"""Sign in, sign out, and your own account."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Form, Request
from fastapi.responses import Response

from controlplane.auth import users
from controlplane.auth.models import User
from controlplane.auth.users import authenticate_user
from controlplane.coordination.throttle import SignInThrottle
from controlplane.deps import SessionDep
from controlplane.errors import DomainError, Invalid, Unauthorized
from dashboards.security import Csrf, current_user, end_session, optional_user, start_session
from dashboards.templating import redirect, render, ui_root

router = APIRouter()

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
def login(request: Request, session: SessionDep, username: Annotated[str, Form()],
          password: Annotated[str, Form()], next: Annotated[str, Form()] = "") -> Response:
    # Keyed by name and address: guessing from one address slows that address only.
    address = request.client.host if request.client else ""
    throttle: SignInThrottle = request.app.state.login_throttle
    wait = throttle.blocked_for(username, address)
    if wait > 0:
        return render(request, "login.html", status_code=429, next=next, username=username,
                      error=f"Too many failed attempts; try again in {int(wait) + 1} s.")
    try:
        user = authenticate_user(session=session, username=username, password=password)
    except Unauthorized:
        throttle.failed(username, address)
        return render(request, "login.html", status_code=401, next=next, username=username,
                      error="Wrong username or password.")
    throttle.succeeded(username, address)
    start_session(request, user)
    return redirect(request, _safe_next(request, next))


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
                    current: Annotated[str, Form()] = "", new: Annotated[str, Form()] = "",
                    confirm: Annotated[str, Form()] = "") -> Response:
    """Change your own password; your other sessions end, this one continues."""
    try:
        if new != confirm:
            raise Invalid("the two new passwords differ")
        users.change_own_password(session=session, user=user, current=current, new=new)
    except DomainError as error:
        session.rollback()
        return redirect(request, "/account", str(error), "error")
    start_session(request, user)
    return redirect(request, "/account", "Password changed; your other sessions are signed out.")
