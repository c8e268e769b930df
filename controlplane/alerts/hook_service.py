"""Alert hooks: where a deployment's alerts go. Create, change, delete, and find the hooks an
alert event goes to; URLs and credentials are checked by the guard and stored encrypted."""

from __future__ import annotations

from typing import Any

from sqlalchemy import delete, or_, select
from sqlalchemy.orm import Session

from controlplane.alerts import hooks
from controlplane.alerts.guard import HookGuard
from controlplane.alerts.kinds import NEVER_PAGES
from controlplane.alerts.models import HOOK_KINDS, SEVERITIES, Alert, AlertDelivery, AlertHook
from controlplane.auth.audit import LOCAL_ACTOR, record_admin_event
from controlplane.deployments.models import Deployment
from controlplane.errors import Invalid, NotFound
from controlplane.keys import SecretUnreadable

SEVERITY_RANK = {name: rank for rank, name in enumerate(SEVERITIES)}
# Hooks that page someone: the kinds in NEVER_PAGES are not delivered to them.
PAGERS = frozenset({"pagerduty", "alertmanager"})


def list_hooks(*, session: Session, deployment: Deployment | None = None) -> list[AlertHook]:
    query = select(AlertHook).order_by(AlertHook.id)
    if deployment is not None:
        query = query.where(or_(AlertHook.deployment_id == deployment.id,
                                AlertHook.deployment_id.is_(None)))
    return list(session.scalars(query))


def get_hook(*, session: Session, hook_id: int) -> AlertHook:
    hook = session.get(AlertHook, hook_id)
    if hook is None:
        raise NotFound(f"alert hook {hook_id} does not exist")
    return hook


# Stored encrypted: a new value is never compared with the stored one.
_SEALED = ("url", "secret", "routing_key")


def hook_guard(settings=None) -> HookGuard:
    """The allow-list and vault of `settings` (default: this process's)."""
    from controlplane.settings import get_settings

    return HookGuard.from_settings(settings or get_settings())


def create_hook(*, session: Session, name: str, kind: str, url: str, actor: str,
                deployment: Deployment | None = None, min_severity: str = "warning",
                secret: str | None = None, routing_key: str | None = None,
                enabled: bool = True, guard: HookGuard | None = None,
                reason: str = "") -> AlertHook:
    """A hook whose URL may be reached (`guard.check`); webhook hooks get a random HMAC
    secret unless one is given. URL, secret and routing key are stored encrypted. The
    creation is an audit event of `actor`, with `reason`."""
    if kind not in HOOK_KINDS:
        raise Invalid(f"unknown hook kind {kind!r}; use one of {', '.join(HOOK_KINDS)}")
    if min_severity not in SEVERITIES:
        raise Invalid(f"unknown severity {min_severity!r}; use one of {', '.join(SEVERITIES)}")
    if kind == "pagerduty" and not routing_key:
        raise Invalid("a pagerduty hook needs routing_key (the integration key of the service)")
    guard = guard or hook_guard()
    guard.check(url, kind=kind, must_resolve=False)
    if kind == "webhook" and not secret:
        secret = hooks.new_secret()
    vault = guard.vault
    hook = AlertHook(deployment_id=deployment.id if deployment else None, name=name, kind=kind,
                     url=vault.encrypt(url), secret=vault.encrypt(secret),
                     routing_key=vault.encrypt(routing_key), min_severity=min_severity,
                     enabled=enabled, created_by=actor)
    session.add(hook)
    session.flush()
    record_admin_event(session=session, actor=actor, action="hook.create",
                       target=f"hook:{hook.id}", reason=reason,
                       details={"name": name, "kind": kind, "deployment_id": hook.deployment_id,
                                "min_severity": min_severity},
                       deployment=deployment.name if deployment else None)
    return hook


def update_hook(*, session: Session, hook: AlertHook, changes: dict[str, Any],
                guard: HookGuard | None = None, actor: str = LOCAL_ACTOR,
                reason: str = "") -> AlertHook:
    """Apply `changes`; a new URL is checked like a new hook's, credentials are encrypted.
    The change is an audit event of `actor`, with `reason` (naming the fields changed, never
    their values where they are credentials or URLs); values equal to the current ones change
    nothing and record nothing."""
    guard = guard or hook_guard()
    changes = {name: value for name, value in changes.items()
               if name in _SEALED or getattr(hook, name) != value}
    if not changes:
        return hook
    for name, value in changes.items():
        if name == "min_severity" and value not in SEVERITIES:
            raise Invalid(f"unknown severity {value!r}")
        if name == "url":
            guard.check(value, kind=hook.kind, must_resolve=False)
        if name in _SEALED:
            value = guard.vault.encrypt(value)
        setattr(hook, name, value)
    if hook.kind == "pagerduty" and not hook.routing_key:
        raise Invalid("a pagerduty hook needs routing_key")
    session.flush()
    record_admin_event(session=session, actor=actor, action="hook.update",
                       target=f"hook:{hook.id}", reason=reason,
                       details={name: (value if name in ("min_severity", "enabled", "name")
                                       else "(changed)") for name, value in changes.items()})
    return hook


def hook_target(*, hook: AlertHook, guard: HookGuard) -> hooks.HookTarget:
    """The hook's URL and credentials decrypted, for one delivery (SecretUnreadable when the
    secret key changed since they were stored)."""
    vault = guard.vault
    return hooks.HookTarget(kind=hook.kind, url=vault.decrypt(hook.url),
                            secret=vault.decrypt(hook.secret),
                            routing_key=vault.decrypt(hook.routing_key))


def shown_url(*, hook: AlertHook, guard: HookGuard) -> str:
    """The hook's URL as people see it after creation: scheme, host and port only."""
    try:
        return hooks.redact_url(guard.vault.decrypt(hook.url))
    except SecretUnreadable:
        return "(unreadable with this secret key)"


def delete_hook(*, session: Session, hook: AlertHook, actor: str = LOCAL_ACTOR,
                reason: str = "") -> None:
    """Delete a hook and its delivery log (an audit event of `actor`, with `reason`)."""
    record_admin_event(session=session, actor=actor, action="hook.delete",
                       target=f"hook:{hook.id}", reason=reason, details={"name": hook.name})
    session.execute(delete(AlertDelivery).where(AlertDelivery.hook_id == hook.id))
    session.delete(hook)
    session.flush()


def hooks_for(*, session: Session, alert: Alert, event: str) -> list[AlertHook]:
    """Enabled hooks of the alert's deployment (or of all) whose severity filter it passes;
    a finding that never pages (`kinds.NEVER_PAGES`) skips the pagers."""
    rank = SEVERITY_RANK[alert.severity]
    return [hook for hook in session.scalars(
        select(AlertHook).where(AlertHook.enabled.is_(True),
                                or_(AlertHook.deployment_id == alert.deployment_id,
                                    AlertHook.deployment_id.is_(None))).order_by(AlertHook.id))
            if SEVERITY_RANK[hook.min_severity] <= rank and hooks.accepts(hook.kind, event)
            and not (alert.kind in NEVER_PAGES and hook.kind in PAGERS)]
