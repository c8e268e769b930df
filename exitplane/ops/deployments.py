"""Operator commands for deployments (list, show, create, update, delete), their threshold set
versions, rollback, the canary and declared traffic segments, over the HTTP API."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from exitplane.ops.api import REFUSED, ControlPlane, fail, operator_command, part
from exitplane.ops.render import cell, emit, record, table
from exitplane.wire import DEFAULT_EXIT_LAYERS_RULE, Signal

ALIASES = ("active", "conservative", "canary")
REASON = click.option("--reason", required=True, help="why (written to the audit log)")


def _path(deployment: str, *rest: str | int) -> str:
    return "/".join(["/v1/deployments", part(deployment), *(part(item) for item in rest)])


# -- deployments -----------------------------------------------------------------------------

@click.group()
def deployments() -> None:
    """Deployments (a named runtime fleet, its quality target and its aliases) over the API."""


DEPLOYMENT_COLUMNS = [
    ("NAME", "name"), ("MODEL", "model_ref"), ("EXIT LAYERS", "exit_layers"),
    ("SIGNAL", "signal"), ("DELTA", "delta"), ("POLICY", "policy"),
    ("ACTIVE", lambda d: d["aliases"].get("active")),
    ("CONSERVATIVE", lambda d: d["aliases"].get("conservative")),
    ("CANARY", lambda d: d["aliases"].get("canary")),
]


@operator_command(deployments, "list")
def deployments_list(api: ControlPlane) -> None:
    """One line per deployment: model, exit layers, signal, target and alias versions."""
    found = api.get("/v1/deployments")
    emit(api.output, found, lambda: table(found, DEPLOYMENT_COLUMNS))


@operator_command(deployments, "show")
@click.argument("name")
def deployments_show(api: ControlPlane, name: str) -> None:
    """Every setting of deployment NAME and where its aliases point."""
    found = api.get(_path(name))
    fields = [(key, key) for key in found if key != "aliases"]
    fields += [(f"alias {alias}", lambda d, a=alias: d["aliases"].get(a)) for alias in ALIASES]
    emit(api.output, found, lambda: record(found, fields))


def field_values(values: tuple[str, ...]) -> dict[str, Any]:
    """FIELD=VALUE options -> {field: value}: a value is read as JSON (numbers, true, false,
    null, lists), else kept as text."""
    fields: dict[str, Any] = {}
    for value in values:
        key, sep, raw = value.partition("=")
        if not sep or not key.strip():
            fail(f"--set {value!r}: write FIELD=VALUE, e.g. policy=canary")
        try:
            fields[key.strip()] = json.loads(raw)
        except ValueError:
            fields[key.strip()] = raw
    return fields


def _layers(value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(layer) for layer in value.split(",")]
    except ValueError:
        fail(f"--exit-layers {value!r}: write comma-separated layer numbers, e.g. 6,12,18")


SET_OPTION = click.option(
    "--set", "extra", multiple=True, metavar="FIELD=VALUE",
    help="any other field of the deployment (repeatable; the value is read as JSON, else as "
         "text), e.g. --set fallback_mode=last_good")
# The settings `create` and `update` both take: option name -> (field, type, help).
SHARED_SETTINGS = {
    "--delta": ("delta", float, "max disagreement with the full model (δ)"),
    "--epsilon": ("epsilon", float, "1 - confidence of the disagreement bound (ε)"),
    "--policy": ("policy", str, "how a calibrated set is promoted: auto, canary or approval"),
    "--canary-fraction": ("canary_fraction", float,
                          "the share of runtimes a canary serves, in (0, 1]"),
    "--head-digest": ("head_digest", str, "digest of the exit heads the runtimes must serve"),
    "--model-revision": ("model_revision", str, "the model revision the runtimes must serve"),
}


def _settings_options(command):
    for flag, (field, kind, help_text) in reversed(SHARED_SETTINGS.items()):
        command = click.option(flag, field, type=kind, default=None, help=help_text)(command)
    return command


def _settings(given: dict[str, Any], extra: tuple[str, ...]) -> dict[str, Any]:
    chosen = {field: given[field] for field, _, _ in SHARED_SETTINGS.values()
              if given.get(field) is not None}
    return chosen | field_values(extra)


@operator_command(deployments, "create")
@click.argument("name")
@click.option("--model-ref", required=True, help="the model the runtimes serve")
@click.option("--num-layers", type=click.IntRange(min=2), required=True,
              help="decoder layers of that model")
@click.option("--exit-layers", default=None,
              help=f"comma-separated exit layers, as the runtime's heads were trained "
                   f"(default: {DEFAULT_EXIT_LAYERS_RULE})")
@click.option("--signal", type=click.Choice([s.value for s in Signal]), default=None,
              help="the exit signal thresholds apply to (default: learned)")
@_settings_options
@SET_OPTION
def deployments_create(api: ControlPlane, name: str, model_ref: str, num_layers: int,
                       exit_layers: str | None, signal: str | None, extra: tuple[str, ...],
                       **given: Any) -> None:
    """Create deployment NAME: its conservative set (never exit) is version 1 and active."""
    spec = {"name": name, "model_ref": model_ref, "num_layers": num_layers,
            "exit_layers": _layers(exit_layers), "signal": signal} | _settings(given, extra)
    made = api.request("POST", "/v1/deployments",
                       json={key: value for key, value in spec.items() if value is not None})
    emit(api.output, made, lambda: click.echo(
        f"deployment {made['name']} created (exit layers {cell(made['exit_layers'])}, "
        f"active: version {made['aliases'].get('active')})"))


@operator_command(deployments, "update")
@click.argument("name")
@_settings_options
@click.option("--auto-segments/--no-auto-segments", default=None,
              help="register segment names that runtime telemetry carries (or only declared "
                   "ones)")
@SET_OPTION
def deployments_update(api: ControlPlane, name: str, auto_segments: bool | None,
                       extra: tuple[str, ...], **given: Any) -> None:
    """Change settings of deployment NAME (quality target, policy, canary fraction, lineage,
    ...); the settings not given keep their values. The shadow rate's bounds: `exitplane
    deployments shadow-rate`."""
    changes = _settings(given, extra)
    if auto_segments is not None:
        changes["auto_segments"] = auto_segments
    if not changes:
        fail("give a setting to change, e.g. --delta 0.02 or --set fallback_mode=last_good")
    found = api.request("PATCH", _path(name), json=changes)
    applied = {key: value for key, value in changes.items() if key not in api.ignored}
    if not applied:
        fail(f"deployment {name} not updated: the control plane knows none of "
             f"{', '.join(changes)}", REFUSED)
    emit(api.output, found, lambda: click.echo(
        f"deployment {name} updated: " + ", ".join(
            f"{key}={found.get(key, value)}" for key, value in applied.items())))


@operator_command(deployments, "delete")
@click.argument("name")
@REASON
@click.option("--force", is_flag=True,
              help="delete even while runtimes of it are live (they lose their thresholds "
                   "and tokens)")
@click.option("--yes", is_flag=True, help="do not ask for confirmation")
def deployments_delete(api: ControlPlane, name: str, reason: str, force: bool,
                       yes: bool) -> None:
    """Delete deployment NAME with its versions, aliases, alert hooks, runtimes, calibrations,
    canaries, alerts and telemetry; its runtime tokens are revoked (admin token). Refused
    while runtimes of it are live, unless --force."""
    if not yes:
        try:
            confirmed = click.confirm(
                f"delete deployment {name!r} and everything stored under it?", err=True)
        except click.Abort:
            confirmed = False
        if not confirmed:
            fail("nothing deleted (--yes deletes without asking)", REFUSED)
    gone = api.request("DELETE", _path(name),
                       params={"reason": reason, "force": "true" if force else None})
    emit(api.output, gone, lambda: click.echo(
        f"deployment {gone['name']} deleted ({gone['threshold_sets']} threshold set(s), "
        f"{len(gone['revoked_tokens'])} runtime token(s) revoked, "
        f"{len(gone.get('deleted_hooks', []))} alert hook(s) deleted)"))


SHADOW_FIELDS = [("deployment", "name"), ("shadow rate", "shadow_rate"),
                 ("why", "shadow_rate_reason"), ("decided at", "shadow_rate_decided_at"),
                 ("minimum", "shadow_rate_min"), ("maximum", "shadow_rate_max")]


@operator_command(deployments, "shadow-rate")
@click.argument("name")
@click.option("--min", "low", type=click.FloatRange(0, 1), default=None,
              help="the lowest shadow rate the control plane may set")
@click.option("--max", "high", type=click.FloatRange(0, 1), default=None,
              help="the highest shadow rate the control plane may set")
@click.option("--fixed", type=click.FloatRange(0, 1), default=None,
              help="fix the rate (both bounds at this value)")
def deployments_shadow_rate(api: ControlPlane, name: str, low: float | None,
                            high: float | None, fixed: float | None) -> None:
    """The shadow rate the control plane asks NAME's runtimes for, and why; with --min, --max
    or --fixed, set the bounds it decides within first."""
    if fixed is not None and (low is not None or high is not None):
        fail("give --fixed, or --min and/or --max, not both")
    bounds = {"shadow_rate_min": fixed if fixed is not None else low,
              "shadow_rate_max": fixed if fixed is not None else high}
    bounds = {key: value for key, value in bounds.items() if value is not None}
    found = api.request("PATCH", _path(name), json=bounds) if bounds else api.get(_path(name))
    emit(api.output, found, lambda: record(found, SHADOW_FIELDS))


AUDIT_COLUMNS = [("ID", "id"), ("WHEN", "created_at"), ("ACTOR", "actor"), ("ACTION", "action"),
                 ("ALIAS", "alias"), ("FROM", "from_version"), ("TO", "to_version"),
                 ("REASON", "reason")]


@operator_command(deployments, "audit")
@click.argument("name")
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True,
              help="newest events to show")
def deployments_audit(api: ControlPlane, name: str, limit: int) -> None:
    """Who moved which alias of NAME, when, from which version to which, and why."""
    events = api.get(_path(name, "audit"), limit=limit)
    emit(api.output, events, lambda: table(events, AUDIT_COLUMNS))


def _moved(event: dict, deployment: str) -> str:
    """An alias move in words."""
    alias = event.get("alias") or "alias"
    was = event.get("from_version")
    to = event.get("to_version")
    moved = f"{was} -> {to}" if was is not None else f"-> {to}" if to is not None else "cleared"
    return (f"{deployment}: {alias} {moved} (audit event {event['id']}, "
            f"by {event['actor']})")


# -- versions --------------------------------------------------------------------------------

@click.group()
def versions() -> None:
    """A deployment's threshold set versions: list, show, diff, publish, activate."""


VERSION_COLUMNS = [("VERSION", "version"), ("ALIASES", "aliases"), ("ORIGIN", "origin"),
                   ("SIGNAL", "signal"), ("THRESHOLDS", "thresholds"), ("AUTHOR", "author"),
                   ("CREATED", "created_at"), ("REASON", "reason")]


@operator_command(versions, "list")
@click.argument("deployment")
@click.option("--limit", type=click.IntRange(1, 500), default=20, show_default=True,
              help="newest versions to show")
def versions_list(api: ControlPlane, deployment: str, limit: int) -> None:
    """One line per threshold set of DEPLOYMENT, newest first, with the aliases on it."""
    found = api.get(_path(deployment, "threshold-sets"), limit=limit)
    emit(api.output, found, lambda: table(found, VERSION_COLUMNS))


def resolve_version(api: ControlPlane, deployment: str, ref: str) -> int:
    """A version number, or the one an alias (active, conservative, canary) points at."""
    if ref.isdigit():
        return int(ref)
    if ref not in ALIASES:
        fail(f"version {ref!r} is neither a number nor one of {', '.join(ALIASES)}")
    aliases = api.get(_path(deployment))["aliases"]
    if ref not in aliases:
        fail(f"deployment {deployment!r} has no {ref} alias", 1)
    return aliases[ref]


def _show_set(threshold_set: dict) -> None:
    fields = [(key, key) for key in ("version", "aliases", "signal", "thresholds", "origin",
                                     "parent_version", "calibration_job_id", "author",
                                     "reason", "created_at", "checksum", "head_digest",
                                     "expected_metrics")]
    record(threshold_set, fields)
    for segment, by_layer in (threshold_set.get("segments") or {}).items():
        record({"map": by_layer}, [(f"segment {segment}", "map")])


@operator_command(versions, "show")
@click.argument("deployment")
@click.argument("version")
def versions_show(api: ControlPlane, deployment: str, version: str) -> None:
    """Threshold set VERSION of DEPLOYMENT (a number, or active / conservative / canary)."""
    number = resolve_version(api, deployment, version)
    found = api.get(_path(deployment, "threshold-sets", number))
    emit(api.output, found, lambda: _show_set(found))


def _layer_changes(old: dict, new: dict) -> list[dict]:
    layers = sorted({int(layer) for layer in [*old, *new]})
    changes = []
    for layer in layers:
        was, now = old.get(str(layer)), new.get(str(layer))
        change = round(now - was, 6) if was is not None and now is not None else None
        changes.append({"layer": layer, "from": was, "to": now, "change": change})
    return changes


def threshold_diff(deployment: str, old: dict, new: dict) -> dict:
    """Per exit layer (and per segment), the thresholds of two sets and the change."""
    old_segments, new_segments = old.get("segments") or {}, new.get("segments") or {}
    return {
        "deployment": deployment,
        "from": {key: old.get(key) for key in ("version", "signal", "checksum", "aliases")},
        "to": {key: new.get(key) for key in ("version", "signal", "checksum", "aliases")},
        "thresholds": _layer_changes(old["thresholds"], new["thresholds"]),
        "segments": {name: _layer_changes(old_segments.get(name, {}),
                                          new_segments.get(name, {}))
                     for name in sorted({*old_segments, *new_segments})},
    }


def _show_diff(diff: dict) -> None:
    old, new = diff["from"], diff["to"]
    click.echo(f"{diff['deployment']}: version {old['version']} -> {new['version']}")
    if old["signal"] != new["signal"]:
        click.echo(f"signal: {old['signal']} -> {new['signal']}")
    columns = [("LAYER", "layer"), (f"V{old['version']}", "from"), (f"V{new['version']}", "to"),
               ("CHANGE", lambda row: "=" if row["change"] == 0 else
                f"{row['change']:+.4g}" if row["change"] is not None else "-")]
    table(diff["thresholds"], columns)
    for name, rows in diff["segments"].items():
        click.echo(f"segment {name}:")
        table(rows, columns)


@operator_command(versions, "diff")
@click.argument("deployment")
@click.argument("old")
@click.argument("new", default="active")
def versions_diff(api: ControlPlane, deployment: str, old: str, new: str) -> None:
    """Per exit layer, how the thresholds of version OLD and version NEW (default: active)
    differ; each is a number or an alias."""
    sets = [api.get(_path(deployment, "threshold-sets", resolve_version(api, deployment, ref)))
            for ref in (old, new)]
    diff = threshold_diff(deployment, *sets)
    emit(api.output, diff, lambda: _show_diff(diff))


def _layer_map(raw: Any, where: str) -> dict[str, float]:
    if not isinstance(raw, dict) or not raw:
        fail(f"{where} must be a non-empty object {{layer: threshold}}")
    try:
        return {str(int(layer)): float(value) for layer, value in raw.items()}
    except (TypeError, ValueError):
        fail(f"{where} must map whole layer numbers to numbers")


def read_set_file(path: str) -> dict:
    """A threshold set file: {signal, thresholds, segments, expected_metrics} or a set as
    runtimes pull it (its version, checksum and deployment are not sent)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as error:
        fail(f"cannot read {path}: {error.strerror or error}")
    except ValueError as error:
        fail(f"{path} is not JSON: {error}")
    if not isinstance(data, dict) or "thresholds" not in data:
        fail(f"{path} needs a 'thresholds' object: {{layer: threshold}}")
    spec: dict[str, Any] = {"thresholds": _layer_map(data["thresholds"], f"{path}: thresholds")}
    if data.get("segments"):
        if not isinstance(data["segments"], dict):
            fail(f"{path}: segments must be an object {{segment: {{layer: threshold}}}}")
        spec["segments"] = {name: _layer_map(by_layer, f"{path}: segment {name!r}")
                            for name, by_layer in data["segments"].items()}
    if data.get("signal") is not None:
        spec["signal"] = data["signal"]
    if data.get("expected_metrics"):
        spec["expected_metrics"] = data["expected_metrics"]
    return spec


def layer_pairs(values: tuple[str, ...], option: str = "--threshold") -> dict[str, float]:
    """LAYER=VALUE options -> {layer: threshold}; a malformed one ends the command."""
    pairs = {}
    for value in values:
        layer, _, threshold = value.partition("=")
        try:
            pairs[str(int(layer))] = float(threshold)
        except ValueError:
            fail(f"{option} {value!r}: write LAYER=VALUE, e.g. 12=0.9")
    return pairs


@operator_command(versions, "publish")
@click.argument("deployment")
@click.option("--file", "set_file", default=None, metavar="FILE",
              help="JSON file: {signal, thresholds: {layer: value}, segments, "
                   "expected_metrics}, or a set as runtimes pull it")
@click.option("--threshold", "pairs", multiple=True, metavar="LAYER=VALUE",
              help="a layer's threshold (repeatable; overrides the file's)")
@click.option("--signal", type=click.Choice([s.value for s in Signal]), default=None,
              help="the signal the thresholds apply to (default: the file's, else the "
                   "deployment's)")
@REASON
@click.option("--activate", is_flag=True, help="also point `active` at the new version")
def versions_publish(api: ControlPlane, deployment: str, set_file: str | None,
                     pairs: tuple[str, ...], signal: str | None, reason: str,
                     activate: bool) -> None:
    """Publish a new threshold set version of DEPLOYMENT (immutable; --activate to serve it)."""
    if not set_file and not pairs:
        fail("give the thresholds: --file FILE or --threshold LAYER=VALUE")
    spec = read_set_file(set_file) if set_file else {"thresholds": {}}
    spec["thresholds"] = {**spec["thresholds"], **layer_pairs(pairs)}
    if signal:
        spec["signal"] = signal
    spec |= {"reason": reason, "activate": activate}
    made = api.request("POST", _path(deployment, "threshold-sets"), json=spec)
    emit(api.output, made, lambda: click.echo(
        f"{deployment}: published version {made['version']}"
        + (" (active)" if "active" in made["aliases"] else "")))


@operator_command(versions, "activate")
@click.argument("deployment")
@click.argument("version", type=click.IntRange(min=1))
@REASON
def versions_activate(api: ControlPlane, deployment: str, version: int, reason: str) -> None:
    """Point DEPLOYMENT's `active` alias at VERSION; runtimes pick it up by ETag."""
    event = api.request("PUT", _path(deployment, "aliases", "active"),
                        json={"version": version, "reason": reason})
    emit(api.output, event, lambda: click.echo(_moved(event, deployment)))


@operator_command(None, "rollback")
@click.argument("deployment")
@click.option("--to", "to_version", type=click.IntRange(min=1), default=None,
              help="the version to make active (default: the one active before this one)")
@REASON
def rollback(api: ControlPlane, deployment: str, to_version: int | None, reason: str) -> None:
    """Move DEPLOYMENT's `active` alias back to the version it pointed at before (or --to)."""
    event = api.request("POST", _path(deployment, "rollback"),
                        json={"to_version": to_version, "reason": reason})
    emit(api.output, event, lambda: click.echo(_moved(event, deployment)))


# -- canary ----------------------------------------------------------------------------------

@click.group()
def canary() -> None:
    """A deployment's canary: start one, its verdicts, promote it, revert it. A canary also
    starts from a calibration under the `canary` policy, or on the admin UI's versions page."""


CANARY_FIELDS = [(key, key) for key in (
    "id", "version", "baseline_version", "status", "status_reason", "job_id", "clean_windows",
    "failed_checks", "inconclusive_windows", "next_window_start", "started_at", "finished_at")]
CHECK_COLUMNS = [("WINDOW", lambda check: check["window"][0]), ("VERDICT", "verdict"),
                 ("REASON", "reason")]


def _show_canary(run: dict) -> None:
    record(run, CANARY_FIELDS)
    if run["checks"]:
        click.echo("")
        table(run["checks"], CHECK_COLUMNS, width=90)


def _warn(answer: dict) -> None:
    """The control plane's warnings about an answer, one line each on stderr."""
    for warning in answer.get("warnings") or ():
        click.echo(f"exitplane: warning: {' '.join(str(warning).split())}", err=True)


def _set_fraction(api: ControlPlane, deployment: str, fraction: float) -> dict:
    return api.request("PATCH", _path(deployment), json={"canary_fraction": fraction})


FRACTION = click.FloatRange(0, 1, min_open=True)


@operator_command(canary, "start")
@click.argument("deployment")
@click.argument("version", type=click.IntRange(min=1))
@click.option("--reason", default="", help="why (added to the audit log)")
@click.option("--fraction", type=FRACTION, default=None,
              help="set the deployment's canary fraction (the share of runtimes that apply "
                   "VERSION) with the start; unchanged if the start is refused")
def canary_start(api: ControlPlane, deployment: str, version: int, reason: str,
                 fraction: float | None) -> None:
    """Serve VERSION to DEPLOYMENT's canary fraction of runtimes (the deployment's
    canary_fraction, or --fraction) beside the active version; the canary monitor judges its
    windows and promotes or reverts it. Refused while another canary runs or is paused; a
    warning when no live runtime falls into the canary."""
    body = {"version": version, "reason": reason}
    if fraction is not None:
        body["canary_fraction"] = fraction
    run = api.request("POST", _path(deployment, "canary"), json=body)
    _warn(run)
    emit(api.output, run, lambda: click.echo(
        f"{deployment}: canary of version {run['version']} {run['status']} "
        f"(stable: version {run['baseline_version']})"))


@operator_command(canary, "status")
@click.argument("deployment")
def canary_status(api: ControlPlane, deployment: str) -> None:
    """DEPLOYMENT's newest canary run and every window's verdict."""
    run = api.get(_path(deployment, "canary"))
    _warn(run)
    emit(api.output, run, lambda: _show_canary(run))


MEMBER_COLUMNS = [("RUNTIME", "runtime_id"), ("VERSION", "applied_version"),
                  ("LAST SEEN", "last_seen")]


@operator_command(canary, "members")
@click.argument("deployment")
def canary_members(api: ControlPlane, deployment: str) -> None:
    """The live runtimes of DEPLOYMENT that fall into its canary fraction (hash-sticky by
    runtime id): the ones that apply the canary version."""
    run = api.get(_path(deployment, "canary"))
    _warn(run)

    def people() -> None:
        click.echo(f"{deployment}: {len(run['members'])} of {run['live_runtimes']} live "
                   f"runtime(s) in the canary of version {run['version']} ({run['status']}, "
                   f"fraction {run['canary_fraction']:g})", err=True)
        table(run["members"], MEMBER_COLUMNS)

    emit(api.output, run["members"], people)


@operator_command(canary, "fraction")
@click.argument("deployment")
@click.argument("fraction", type=FRACTION)
def canary_fraction(api: ControlPlane, deployment: str, fraction: float) -> None:
    """Set the share of DEPLOYMENT's runtimes a canary serves, a running one included
    (runtimes pick the change up on their next pull)."""
    found = _set_fraction(api, deployment, fraction)
    if "canary" in found["aliases"]:
        _warn(api.get(_path(deployment, "canary")))
    emit(api.output, found, lambda: click.echo(
        f"{deployment}: canary fraction {found['canary_fraction']:g}"))


@operator_command(canary, "promote")
@click.argument("deployment")
@REASON
def canary_promote(api: ControlPlane, deployment: str, reason: str) -> None:
    """Make DEPLOYMENT's running (or paused) canary version active for every runtime."""
    run = api.request("POST", _path(deployment, "canary", "promote"), json={"reason": reason})
    emit(api.output, run, lambda: click.echo(
        f"{deployment}: canary of version {run['version']} {run['status']}"))


@operator_command(canary, "revert")
@click.argument("deployment")
@REASON
def canary_revert(api: ControlPlane, deployment: str, reason: str) -> None:
    """Stop DEPLOYMENT's running (or paused) canary: every runtime applies `active` again."""
    run = api.request("POST", _path(deployment, "canary", "revert"), json={"reason": reason})
    emit(api.output, run, lambda: click.echo(
        f"{deployment}: canary of version {run['version']} {run['status']}"))


# -- segments --------------------------------------------------------------------------------

@click.group()
def segments() -> None:
    """A deployment's declared traffic segments over the API: list, declare, remove."""


SEGMENT_COLUMNS = [("NAME", "name"),
                   ("STATE", lambda s: "removed" if s["removed_at"] else "in use"),
                   ("ORIGIN", "origin"), ("SINCE", lambda s: s["removed_at"] or s["created_at"])]


def _show_registry(registry: dict) -> None:
    table(registry["segments"], SEGMENT_COLUMNS)
    click.echo(f"telemetry registers new names: {'yes' if registry['auto_segments'] else 'no'}"
               f" (auto_segments); at most {registry['max_segments']} segments", err=True)
    for item in registry["undeclared_by_runtime"]:
        click.echo(f"undeclared: {item['tokens']} tokens in {item['batches']} batches from "
                   f"runtime {item['runtime_id']}", err=True)


@operator_command(segments, "list")
@click.argument("deployment")
@click.option("--window", "window_s", type=click.IntRange(60, 31 * 86400), default=86400,
              show_default=True, help="seconds of undeclared traffic to count, ending now")
def segments_list(api: ControlPlane, deployment: str, window_s: int) -> None:
    """DEPLOYMENT's segments (in use and removed), then per runtime the tokens stored as
    `default` because their segment was not in use."""
    registry = api.get(_path(deployment, "declared-segments"), window_s=window_s)
    emit(api.output, registry, lambda: _show_registry(registry),
         names=lambda found: found["segments"])


@operator_command(segments, "declare")
@click.argument("deployment")
@click.argument("name")
@click.option("--reason", default="", help="why (written to the audit log)")
def segments_declare(api: ControlPlane, deployment: str, name: str, reason: str) -> None:
    """Put segment NAME in use: DEPLOYMENT's traffic of NAME is stored under its name."""
    row = api.request("PUT", _path(deployment, "declared-segments", name),
                      json={"reason": reason})
    emit(api.output, row, lambda: click.echo(f"{deployment}: segment {row['name']} in use"))


@operator_command(segments, "remove")
@click.argument("deployment")
@click.argument("name")
@click.option("--reason", default="", help="why (written to the audit log)")
def segments_remove(api: ControlPlane, deployment: str, name: str, reason: str) -> None:
    """Take segment NAME out of use: its traffic is stored as `default` from now on."""
    row = api.request("DELETE", _path(deployment, "declared-segments", name),
                      params={"reason": reason or None})
    emit(api.output, row, lambda: click.echo(f"{deployment}: segment {row['name']} removed"))
