"""What the system does by itself when an alert fires, or is seen again: alert kind ->
reactions and rechecks.

The alerts domain and the detectors only fire and observe; the flows that answer register here
(the automatic fallback: `controlplane.flows.fallback.install`). Every process that fires
alerts installs its reactions when it starts: `create_api` for the API, `workers.app` for the
Celery worker and beat. The arrow therefore goes from the flows to alerts, never back, and the
safety path (quality at risk -> conservative set) shows in the import graph instead of hiding
in a function-level import.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from sqlalchemy.orm import Session

from controlplane.alerts.kinds import AlertKind
from controlplane.alerts.models import Alert

log = logging.getLogger("exitplane.alerts")

# Called as reaction(session=..., alert=...) inside the transaction that fired the alert; it
# records what it did in `alert.action_taken` and must not raise (the alert fires regardless).
Reaction = Callable[..., object]

_registry: dict[AlertKind, list[Reaction]] = {}
# Called as recheck(session=..., alert=..., **evidence) when a check sees an open alert's
# condition again; `evidence` is what that check measured this time.
_rechecks: dict[AlertKind, list[Reaction]] = {}


def register(reaction: Reaction, *, kinds: Iterable[AlertKind | str]) -> None:
    """Run `reaction` when an alert of one of `kinds` fires (once, however often registered)."""
    for kind in kinds:
        registered = _registry.setdefault(AlertKind(kind), [])
        if reaction not in registered:
            registered.append(reaction)


def reactions_for(kind: AlertKind | str) -> list[Reaction]:
    """The reactions registered for `kind`, in registration order."""
    return list(_registry.get(AlertKind(kind), ()))


def register_recheck(recheck: Reaction, *, kinds: Iterable[AlertKind | str]) -> None:
    """Run `recheck` when a check sees an open alert of one of `kinds` again (once, however
    often registered)."""
    for kind in kinds:
        registered = _rechecks.setdefault(AlertKind(kind), [])
        if recheck not in registered:
            registered.append(recheck)


def rechecks_for(kind: AlertKind | str) -> list[Reaction]:
    """The rechecks registered for `kind`, in registration order."""
    return list(_rechecks.get(AlertKind(kind), ()))


def clear() -> None:
    """Forget every registration (a test that checks what a process start installs)."""
    _registry.clear()
    _rechecks.clear()


def react(*, session: Session, alert: Alert) -> None:
    """Run the reactions registered for the alert's kind."""
    if not _registry:
        # Firing still works, but nothing protects quality: say so loudly, once per alert.
        log.error("alert %s fired in a process that installed no reactions (no automatic "
                  "fallback): build the API with create_api or the worker with workers.app",
                  alert.dedup_key)
    for reaction in reactions_for(alert.kind):
        reaction(session=session, alert=alert)


def recheck(*, session: Session, alert: Alert, **evidence) -> None:
    """Run the rechecks registered for the alert's kind on an open alert seen again, with what
    the check measured this time."""
    for reaction in rechecks_for(alert.kind):
        reaction(session=session, alert=alert, **evidence)
