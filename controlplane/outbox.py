"""The after-commit task outbox: a service asks for a Celery task inside its transaction, and
the task is handed to the broker only once that transaction commits (dropped on rollback), so a
worker never reads a row that is not there yet (STYLE.md 5).

The two session listeners are global (every `Session`): they are registered when this module is
imported, which every service that enqueues does.
"""

from __future__ import annotations

import logging

from sqlalchemy import event
from sqlalchemy.orm import Session

from exitplane.kit import tracing

log = logging.getLogger("exitplane.outbox")

OUTBOX = "exitplane_outbox"


def enqueue_task(session: Session, name: str, args: list) -> None:
    """Send Celery task `name` once the session's transaction commits (dropped on rollback)."""
    session.info.setdefault(OUTBOX, []).append((name, args, tracing.current_context()))


def send_task(name: str, args: list) -> None:
    """Hand a task to the broker of this process's settings."""
    # Imported when first sent: building the app reads the settings and makes the broker's
    # directory, which importing a service must not do.
    from controlplane.celery_app import app

    app.send_task(name, args=args)


@event.listens_for(Session, "after_commit")
def _send_outbox(session: Session) -> None:
    if session.in_nested_transaction():  # a savepoint released; the transaction goes on
        return
    for name, args, trace_context in session.info.pop(OUTBOX, []):
        try:
            with tracing.attached(trace_context):  # the task's trace parent: who asked for it
                send_task(name, args)
        except Exception as error:  # the broker being away must not fail a committed request
            log.error("could not enqueue %s%s: %s", name, tuple(args), error)


@event.listens_for(Session, "after_transaction_end")
def _drop_outbox(session: Session, transaction) -> None:
    # After a commit the outbox was already sent; whatever is left was rolled back.
    if transaction.parent is None:
        session.info.pop(OUTBOX, None)
