"""Threshold-set versions: history, side-by-side diff, and the actions that move aliases.

Every action goes through a confirmation page that shows what changes (a diff against the
active version) and asks for a reason; the POST calls the thresholds services, which write
the audit log.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Depends, Form, Request
from fastapi.responses import Response
from pydantic import ValidationError
from sqlalchemy.orm import Session
from starlette.datastructures import FormData

from controlplane.db import SessionDep
from controlplane.deployments import service as thresholds
from controlplane.deployments.models import Deployment, ThresholdSet
from controlplane.deployments.schemas import DeploymentUpdate
from controlplane.errors import DomainError, Invalid, NotFound
from controlplane.flows import canary as canary_service
from controlplane.flows.canary import running_canary
from dashboards.security import Csrf, Operator, Viewer, actor
from dashboards.segments import (
    SegmentDiff,
    diff_segments,
    rows_for,
    rows_from_form,
    segment_maps,
    segments_from_rows,
)
from dashboards.templating import redirect, render
from dashboards.views import attempt
from exitplane.wire import NEVER_EXIT

router = APIRouter()


@dataclass(frozen=True)
class Action:
    key: str
    title: str
    button: str
    explain: str
    needs_version: bool
    asks_reason: bool = True


ACTIONS = {a.key: a for a in (
    Action("activate", "Activate a version", "Activate",
           "Runtimes switch to this version on their next pull (seconds).", True),
    Action("rollback", "Roll back", "Roll back",
           "Moves `active` back; without a version, to the one active before the current.",
           False),
    Action("canary", "Start a canary", "Start canary",
           "A hash-sticky fraction of runtimes (the deployment's canary fraction) applies "
           "this version; the others keep the active one. The canary monitor compares its "
           "windows with the expected metrics and promotes or reverts it; the audit log "
           "records the version, the fraction and the stable version.", True,
           asks_reason=False),
    Action("canary-stop", "Stop the canary", "Stop canary",
           "Every runtime returns to the active version.", False),
    Action("promote", "Promote the canary", "Promote canary",
           "The canary version becomes active for every runtime and the canary ends.", False),
)}


def _flatten(metrics: dict, prefix: str = "") -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


@dataclass
class Diff:
    a: ThresholdSet
    b: ThresholdSet
    layers: list[tuple[int, float | None, float | None]]
    metrics: list[tuple[str, object, object]]
    segments: list[SegmentDiff]


def diff(deployment: Deployment, a: ThresholdSet, b: ThresholdSet) -> Diff:
    ta, tb = a.thresholds_by_layer(), b.thresholds_by_layer()
    layers = [(layer, ta.get(layer), tb.get(layer))
              for layer in sorted(set(ta) | set(tb) | set(deployment.exit_layers))]
    ma, mb = _flatten(a.expected_metrics or {}), _flatten(b.expected_metrics or {})
    metrics = [(key, ma.get(key), mb.get(key)) for key in sorted(set(ma) | set(mb))]
    return Diff(a=a, b=b, layers=layers, metrics=metrics,
                segments=diff_segments(a, b, deployment.exit_layers))


def _history(session: Session, deployment: Deployment) -> tuple[list[ThresholdSet], set[int]]:
    """Every version (newest first) and the versions that were ever active."""
    sets = thresholds.list_threshold_sets(session=session, deployment=deployment, limit=500)
    events = thresholds.audit_log(session=session, deployment=deployment, limit=1000)
    ever_active = {e.to_version for e in events if e.alias == "active" and e.to_version}
    return sets, ever_active


@router.get("/deployments/{name}/versions")
def versions_page(name: str, request: Request, session: SessionDep, _user: Viewer) -> Response:
    deployment = thresholds.get_deployment(session=session, name=name)
    aliases = thresholds.aliases_of(session=session, deployment=deployment)
    sets, ever_active = _history(session, deployment)
    return render(request, "versions.html", deployment=deployment, aliases=aliases, sets=sets,
                  ever_active=ever_active, never_exit=NEVER_EXIT, segment_maps=segment_maps,
                  canary=running_canary(session=session, deployment=deployment))


@router.get("/deployments/{name}/diff")
def diff_page(name: str, request: Request, session: SessionDep, _user: Viewer,
              a: int, b: int) -> Response:
    deployment = thresholds.get_deployment(session=session, name=name)
    aliases = thresholds.aliases_of(session=session, deployment=deployment)
    left = thresholds.get_threshold_set(session=session, deployment=deployment, version=a)
    right = thresholds.get_threshold_set(session=session, deployment=deployment, version=b)
    sets, _ = _history(session, deployment)
    return render(request, "diff.html", deployment=deployment, aliases=aliases,
                  diff=diff(deployment, left, right), sets=sets)


def _target(session: Session, deployment: Deployment, action: Action,
            version: int | None) -> ThresholdSet | None:
    """The version an action would make active or canary (None: the service decides)."""
    aliases = thresholds.aliases_of(session=session, deployment=deployment)
    if action.key in ("promote", "canary-stop"):
        if "canary" not in aliases:
            raise NotFound(f"deployment {deployment.name!r} has no canary running")
        return thresholds.get_threshold_set(session=session, deployment=deployment,
                                            version=aliases["canary"])
    if version is None:
        if action.needs_version:
            raise Invalid(f"{action.button} needs a version")
        return None
    return thresholds.get_threshold_set(session=session, deployment=deployment,
                                        version=version)


def _action(key: str) -> Action:
    if key not in ACTIONS:
        raise NotFound(f"unknown action {key!r}; use one of {', '.join(ACTIONS)}")
    return ACTIONS[key]


@router.get("/deployments/{name}/act/{key}")
def confirm_page(name: str, key: str, request: Request, session: SessionDep, _user: Operator,
                 version: int | None = None) -> Response:
    action = _action(key)
    deployment = thresholds.get_deployment(session=session, name=name)
    aliases = thresholds.aliases_of(session=session, deployment=deployment)
    active = thresholds.get_threshold_set(session=session, deployment=deployment,
                                          version=aliases["active"])
    target = _target(session, deployment, action, version)
    return render(request, "confirm.html", deployment=deployment, aliases=aliases,
                  action=action, target=target, version=version,
                  diff=diff(deployment, active, target) if target else None)


def _perform(*, session: Session, deployment: Deployment, action: Action, version: int | None,
             who: str, reason: str) -> str:
    """Call the thresholds services for `action`; returns what happened, in words."""
    if action.key == "activate":
        thresholds.move_alias(session=session, deployment=deployment, alias="active",
                              version=version, actor=who, reason=reason)
        return f"Version {version} is now active."
    if action.key == "rollback":
        event = thresholds.rollback(session=session, deployment=deployment, actor=who,
                                    reason=reason, to_version=version)
        return f"Rolled back: version {event.to_version} is active again."
    if action.key == "canary":
        # The canary service writes its own audit reason (version, fraction, baseline).
        canary_service.start_canary(session=session, deployment=deployment, version=version,
                                    actor=who)
        return (f"Canary started: {deployment.canary_fraction:.0%} of runtimes apply "
                f"version {version}.")
    run = running_canary(session=session, deployment=deployment, lock=True)
    if run is not None and run.status in ("running", "paused"):
        # A canary the calibration domain is watching: its services settle the run and job.
        if action.key == "promote":
            canary_service.promote_canary(session=session, deployment=deployment, run=run,
                                          actor=who, reason=reason)
            return f"Canary promoted: version {run.version} is active for every runtime."
        canary_service.revert_canary(session=session, deployment=deployment, run=run,
                                     actor=who, reason=reason, fire_alert=False)
        return "Canary stopped: every runtime applies the active version."
    canary = thresholds.aliases_of(session=session, deployment=deployment).get("canary")
    if canary is None:
        raise NotFound(f"deployment {deployment.name!r} has no canary running")
    if action.key == "promote":
        thresholds.move_alias(session=session, deployment=deployment, alias="active",
                              version=canary, actor=who, reason=reason)
    thresholds.clear_alias(session=session, deployment=deployment, alias="canary", actor=who,
                           reason=reason)
    if action.key == "promote":
        return f"Canary promoted: version {canary} is active for every runtime."
    return "Canary stopped: every runtime applies the active version."


@router.post("/deployments/{name}/act/{key}", dependencies=[Csrf])
def act(name: str, key: str, request: Request, session: SessionDep, user: Operator,
        reason: Annotated[str, Form(max_length=2000)] = "",
        version: Annotated[str, Form()] = "") -> Response:
    action = _action(key)
    deployment = thresholds.get_deployment(session=session, name=name, lock=True)

    def perform() -> str:
        if action.asks_reason and not reason.strip():
            raise Invalid("give a reason: it goes into the audit log")
        target = int(version) if version.strip().isdigit() else None
        if action.needs_version and target is None:
            raise Invalid(f"{action.button} needs a version number")
        return _perform(session=session, deployment=deployment, action=action,
                        version=target, who=actor(user), reason=reason.strip())

    return attempt(request, session, f"/deployments/{name}/versions", perform)


# Blank segment rows the new-version form offers, each a copy of the default map to rename.
BLANK_SEGMENT_ROWS = 2


def _max_segments(request: Request) -> int:
    return request.app.state.settings.max_segments_per_deployment


def _new_version_form(request: Request, session: Session, deployment: Deployment, *,
                      status_code: int = 200, error: str | None = None,
                      typed: FormData | None = None) -> Response:
    """The form, from the active version or (after a refusal) from what was typed."""
    aliases = thresholds.aliases_of(session=session, deployment=deployment)
    active = thresholds.get_threshold_set(session=session, deployment=deployment,
                                          version=aliases["active"])
    limit = _max_segments(request)
    if typed is None:
        rows = rows_for(active, deployment.exit_layers, blank=min(
            BLANK_SEGMENT_ROWS, max(0, limit - len(active.segments_by_layer() or {}))))
        current: dict[int, object] = active.thresholds_by_layer()
        reason, activate = "", False
    else:
        rows = rows_from_form(typed, deployment.exit_layers)
        current = {layer: str(typed.get(f"layer_{layer}", "")) for layer in deployment.exit_layers}
        reason, activate = str(typed.get("reason", "")), typed.get("activate") == "on"
    return render(request, "new_version.html", status_code=status_code, deployment=deployment,
                  aliases=aliases, active=active, current=current, segment_rows=rows,
                  max_segments=limit, error=error, reason=reason, activate=activate)


@router.get("/deployments/{name}/versions/new")
def new_version_page(name: str, request: Request, session: SessionDep,
                     _user: Operator) -> Response:
    deployment = thresholds.get_deployment(session=session, name=name)
    return _new_version_form(request, session, deployment)


async def _form(request: Request) -> FormData:
    return await request.form()


@router.post("/deployments/{name}/versions", dependencies=[Csrf])
def publish(name: str, request: Request, session: SessionDep, user: Operator,
            form: Annotated[FormData, Depends(_form)]) -> Response:
    """Publish a manual version (with any segment rows); a refusal re-shows the form as typed,
    with the service's message, and stores nothing."""
    deployment = thresholds.get_deployment(session=session, name=name, lock=True)
    try:
        reason = str(form.get("reason", "")).strip()
        if not reason:
            raise Invalid("give a reason: it goes into the audit log")
        values: dict[int, float] = {}
        for layer in deployment.exit_layers:
            raw = str(form.get(f"layer_{layer}", "")).strip()
            try:
                values[layer] = float(raw)
            except ValueError:
                raise Invalid(f"threshold for layer {layer} must be a number in [0, 1], "
                              f"got {raw!r}") from None
        segments = segments_from_rows(rows_from_form(form, deployment.exit_layers))
        created = thresholds.publish(session=session, deployment=deployment, thresholds=values,
                                     reason=reason, actor=actor(user), segments=segments,
                                     max_segments=_max_segments(request))
        if form.get("activate") == "on":
            thresholds.move_alias(session=session, deployment=deployment, alias="active",
                                  version=created.version, actor=actor(user), reason=reason)
            message = f"Version {created.version} published and active."
        else:
            message = f"Version {created.version} published (not active)."
    except DomainError as error:
        session.rollback()
        return _new_version_form(request, session, deployment, status_code=error.status_code,
                                 error=str(error), typed=form)
    return redirect(request, f"/deployments/{name}/versions", message)


SETTINGS_FIELDS = ("delta", "epsilon", "policy", "canary_fraction", "fallback_mode",
                   "fallback_margin")


@router.post("/deployments/{name}/settings", dependencies=[Csrf])
def update_settings(name: str, request: Request, session: SessionDep, user: Operator,
                    form: Annotated[FormData, Depends(_form)]) -> Response:
    """Change the quality target and promotion policy (the service audits before/after)."""
    deployment = thresholds.get_deployment(session=session, name=name, lock=True)

    def perform() -> str:
        wanted = {key: str(form.get(key, "")).strip() for key in SETTINGS_FIELDS}
        try:
            spec = DeploymentUpdate(**{k: v for k, v in wanted.items() if v})
        except ValidationError as error:
            problem = error.errors()[0]
            raise Invalid(f"{'.'.join(str(p) for p in problem['loc'])}: "
                          f"{problem['msg']}") from None
        changes = {key: value for key, value in spec.model_dump(exclude_none=True).items()
                   if getattr(deployment, key) != value}
        if not changes:
            return "Nothing changed."
        thresholds.update_deployment(session=session, deployment=deployment,
                                     spec=DeploymentUpdate(**changes), actor=actor(user))
        return "Settings saved: " + ", ".join(f"{k} = {v}" for k, v in changes.items()) + "."

    return attempt(request, session, f"/deployments/{name}/versions", perform)
