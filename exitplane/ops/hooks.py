"""Operator commands for alert hooks (webhook, Alertmanager, PagerDuty, Slack), over the HTTP
API (an admin token): list, show, create, update, delete, test."""

from __future__ import annotations

from pathlib import Path

import click

from exitplane.ops.api import REFUSED, ControlPlane, fail, operator_command
from exitplane.ops.render import emit, record, table

KINDS = "webhook, alertmanager, pagerduty or slack"
SEVERITY_HELP = "the lowest alert severity sent: info, warning or critical"


@click.group()
def hooks() -> None:
    """Alert hooks over the API (an admin token): list, show, create, update, delete, test."""


HOOK_COLUMNS = [("ID", "id"), ("NAME", "name"), ("KIND", "kind"),
                ("DEPLOYMENT", lambda h: h["deployment"] or "(all)"),
                ("MIN SEVERITY", "min_severity"), ("ENABLED", "enabled"), ("URL", "url")]
HOOK_FIELDS = [(key, key) for key in (
    "id", "name", "kind", "url", "deployment", "min_severity", "enabled", "has_secret",
    "has_routing_key", "created_by", "created_at")]


def _ids(found):
    return [hook["id"] for hook in (found if isinstance(found, list) else [found])]


def _secret(path: str | None, what: str) -> str | None:
    """The first line of a file that holds a secret (never an option's value: it would show
    in the process list and the shell's history)."""
    if path is None:
        return None
    try:
        value = Path(path).read_text().strip()
    except OSError as error:
        fail(f"cannot read the {what} file {path}: {error.strerror or error}")
    if not value:
        fail(f"the {what} file {path} is empty")
    return value


@operator_command(hooks, "list")
@click.option("--deployment", default=None, help="only this deployment's hooks")
def hooks_list(api: ControlPlane, deployment: str | None) -> None:
    """Alert hooks: kind, deployment (or all), severity floor, enabled, URL (without its
    secrets)."""
    found = api.get("/v1/hooks", deployment=deployment)
    emit(api.output, found, lambda: table(found, HOOK_COLUMNS, width=80), names=_ids)


@operator_command(hooks, "show")
@click.argument("hook_id", type=int)
def hooks_show(api: ControlPlane, hook_id: int) -> None:
    """Alert hook HOOK_ID."""
    found = api.get(f"/v1/hooks/{hook_id}")
    emit(api.output, found, lambda: record(found, HOOK_FIELDS), names=_ids)


@operator_command(hooks, "create")
@click.option("--name", required=True, help="what the hook is called")
@click.option("--kind", required=True, help=f"the receiver: {KINDS}")
@click.option("--endpoint", "hook_url", required=True, help="the URL alerts are sent to")
@click.option("--deployment", default=None, help="only this deployment's alerts (default: all)")
@click.option("--min-severity", default=None, help=SEVERITY_HELP + " (default: warning)")
@click.option("--secret-file", type=click.Path(dir_okay=False), default=None,
              help="a webhook's HMAC signing key, from this file (default: one is generated "
                   "and shown once)")
@click.option("--routing-key-file", type=click.Path(dir_okay=False), default=None,
              help="a PagerDuty hook's routing key, from this file")
@click.option("--disabled", is_flag=True, help="create it switched off")
@click.option("--reason", default="", help="why, for the audit log")
def hooks_create(api: ControlPlane, name: str, kind: str, hook_url: str,
                 deployment: str | None, min_severity: str | None, secret_file: str | None,
                 routing_key_file: str | None, disabled: bool, reason: str) -> None:
    """Create an alert hook; the signing secret generated for a webhook is shown once."""
    if api.output == "name" and kind == "webhook" and not secret_file:
        fail("-o name would not show the webhook's generated signing secret, which is shown "
             "only once: give --secret-file FILE, or use -o table, json or yaml")
    spec = {"name": name, "kind": kind, "url": hook_url, "deployment": deployment,
            "min_severity": min_severity, "secret": _secret(secret_file, "secret"),
            "routing_key": _secret(routing_key_file, "routing key"),
            "enabled": False if disabled else None, "reason": reason or None}
    made = api.request("POST", "/v1/hooks",
                       json={key: value for key, value in spec.items() if value is not None})
    emit(api.output, made, lambda: record(made, [*HOOK_FIELDS, ("secret (shown once)",
                                                                "secret")]), names=_ids)


@operator_command(hooks, "update")
@click.argument("hook_id", type=int)
@click.option("--name", default=None, help="a new name")
@click.option("--endpoint", "hook_url", default=None, help="a new URL to send alerts to")
@click.option("--min-severity", default=None, help=SEVERITY_HELP)
@click.option("--enable/--disable", "enabled", default=None,
              help="switch the hook on or off")
@click.option("--secret-file", type=click.Path(dir_okay=False), default=None,
              help="a new HMAC signing key, from this file")
@click.option("--routing-key-file", type=click.Path(dir_okay=False), default=None,
              help="a new PagerDuty routing key, from this file")
@click.option("--reason", default="", help="why, for the audit log")
def hooks_update(api: ControlPlane, hook_id: int, name: str | None, hook_url: str | None,
                 min_severity: str | None, enabled: bool | None, secret_file: str | None,
                 routing_key_file: str | None, reason: str) -> None:
    """Change alert hook HOOK_ID; what is not given keeps its value."""
    changes = {"name": name, "url": hook_url, "min_severity": min_severity, "enabled": enabled,
               "secret": _secret(secret_file, "secret"),
               "routing_key": _secret(routing_key_file, "routing key")}
    changes = {key: value for key, value in changes.items() if value is not None}
    if not changes:
        fail("give something to change: --name, --endpoint, --min-severity, --enable/"
             "--disable, --secret-file or --routing-key-file")
    found = api.request("PATCH", f"/v1/hooks/{hook_id}",
                        json={**changes, **({"reason": reason} if reason else {})})
    emit(api.output, found, lambda: click.echo(
        f"hook {found['id']} ({found['name']}) updated"), names=_ids)


@operator_command(hooks, "delete")
@click.argument("hook_id", type=int)
@click.option("--yes", is_flag=True, help="do not ask for confirmation")
@click.option("--reason", default="", help="why, for the audit log")
def hooks_delete(api: ControlPlane, hook_id: int, yes: bool, reason: str) -> None:
    """Delete alert hook HOOK_ID and its deliveries."""
    if not yes:
        try:
            confirmed = click.confirm(f"delete alert hook {hook_id} and its deliveries?",
                                      err=True)
        except click.Abort:
            confirmed = False
        if not confirmed:
            fail("nothing deleted (--yes deletes without asking)", REFUSED)
    api.request("DELETE", f"/v1/hooks/{hook_id}", params={"reason": reason} if reason else None)
    gone = {"id": hook_id, "deleted": True}
    emit(api.output, gone, lambda: click.echo(f"hook {hook_id} deleted"), names=_ids)


@operator_command(hooks, "test")
@click.argument("hook_id", type=int)
def hooks_test(api: ControlPlane, hook_id: int) -> None:
    """Send a test alert to hook HOOK_ID now; exit 1 when the receiver did not take it."""
    delivery = api.request("POST", f"/v1/hooks/{hook_id}/test")
    answered = (f"HTTP {delivery['status_code']}" if delivery.get("status_code") is not None
                else delivery.get("error") or "no answer")
    emit(api.output, delivery, lambda: click.echo(
        f"hook {hook_id}: test delivery {'delivered' if delivery['ok'] else 'failed'} "
        f"({answered})"))
    if not delivery["ok"]:
        fail(f"hook {hook_id}: the receiver did not take the test alert ({answered})", REFUSED)
