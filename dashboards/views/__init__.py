"""UI routes by page: sign-in, overview, deployment charts, versions and actions, admin."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Request
from fastapi.responses import RedirectResponse
from sqlalchemy.orm import Session

from controlplane.errors import DomainError
from dashboards.templating import redirect


def attempt(request: Request, session: Session, back: str,
            action: Callable[[], str]) -> RedirectResponse:
    """Run a service call for a form; redirect to `back` with its outcome as a flash message.

    A domain error (conflict, invalid input) rolls the unit of work back and is shown to the
    user on the page they came from instead of an error page."""
    try:
        message = action()
    except DomainError as error:
        session.rollback()
        return redirect(request, back, str(error), "error")
    return redirect(request, back, message)
