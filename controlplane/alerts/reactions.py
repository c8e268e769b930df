"""What the system does by itself when an alert fires: alert kind -> reactions.

The alerts domain only fires; the domains that answer register here (the calibration fallback:
`controlplane.calibration.fallback.install`). Every process that fires alerts installs its
reactions when it starts: `create_api` for the API, `workers.app` for the Celery worker and
beat. The arrow therefore goes from calibration to alerts, never back, and the safety path
(quality at risk -> conservative set) shows in the import graph instead of hiding in a
function-level import.
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


def register(reaction: Reaction, *, kinds: Iterable[AlertKind | str]) -> None:
    """Run `reaction` when an alert of one of `kinds` fires (once, however often registered)."""
    for kind in kinds:
        registered = _registry.setdefault(AlertKind(kind), [])
        if reaction not in registered:
            registered.append(reaction)


def reactions_for(kind: AlertKind | str) -> list[Reaction]:
    """The reactions registered for `kind`, in registration order."""
    return list(_registry.get(AlertKind(kind), ()))


def clear() -> None:
    """Forget every registration (a test that checks what a process start installs)."""
    _registry.clear()


def react(*, session: Session, alert: Alert) -> None:
    """Run the reactions registered for the alert's kind."""
    if not _registry:
        # Firing still works, but nothing protects quality: say so loudly, once per alert.
        log.error("alert %s fired in a process that installed no reactions (no automatic "
                  "fallback): build the API with create_api or the worker with workers.app",
                  alert.dedup_key)
    for reaction in reactions_for(alert.kind):
        reaction(session=session, alert=alert)
