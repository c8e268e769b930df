"""Operator commands for recalibration jobs, alerts, the runtime fleet and API tokens, over
the HTTP API."""

from __future__ import annotations

import sys
import time

import click

from exitplane.ops.api import (
    REFUSED,
    ControlPlane,
    fail,
    moment,
    new_token_options,
    operator_command,
    part,
    write_token_file,
)
from exitplane.ops.render import emit, record, table

REASON = click.option("--reason", required=True, help="why (written to the audit log)")


def _deployment(name: str, *rest: str | int) -> str:
    return "/".join(["/v1/deployments", part(name), *(part(item) for item in rest)])


# -- calibrations ----------------------------------------------------------------------------

@click.group()
def calibrations() -> None:
    """Recalibration jobs over the API: start, list, show, approve or reject a candidate."""


JOB_COLUMNS = [("ID", "id"), ("STATUS", "status"), ("TRIGGER", "trigger"),
               ("SEGMENT", "segment"), ("VERSION", "result_version"), ("PROMOTION", "promotion"),
               ("BY", "requested_by"), ("CREATED", "created_at"), ("WHY", "status_reason")]
JOB_FIELDS = [(key, key) for key in (
    "id", "status", "status_reason", "trigger", "alert_id", "requested_by", "reason", "since",
    "until", "segment", "attempts", "result_version", "promotion", "decided_by", "created_at",
    "started_at", "finished_at")]


def _iso(value: str | None, option: str) -> str | None:
    if value is None:
        return None
    try:
        return moment(value).isoformat()
    except ValueError as error:
        fail(f"{option}: {error}")


OPEN_JOB = ("queued", "running", "waiting_for_data")
WAIT_POLL_S = 2.0


def _await_job(api: ControlPlane, deployment: str, job: dict, wait_s: float) -> dict:
    """Job `job` once a worker finished it (succeeded or failed), asking every WAIT_POLL_S;
    a job still open after `wait_s` ends the command."""
    deadline = time.monotonic() + wait_s
    with click.progressbar(length=1, label=f"calibration job {job['id']}", file=sys.stderr,
                           item_show_func=lambda status: status) as bar:
        while job["status"] in OPEN_JOB:
            bar.update(0, job["status"])
            if time.monotonic() >= deadline:
                fail(f"calibration job {job['id']} is still {job['status']} after {wait_s:g} s"
                     f" ({job.get('status_reason') or 'no reason given'}); follow it with "
                     f"`exitplane calibrations show {deployment} {job['id']}`", REFUSED)
            time.sleep(WAIT_POLL_S)
            job = api.get(_deployment(deployment, "calibrations", job["id"]))
        bar.update(1, job["status"])
    return job


@operator_command(calibrations, "start")
@click.argument("deployment")
@click.option("--since", default=None,
              help="window start: ISO time (UTC if no offset) or an age like 30m, 6h, 2d "
                   "(default: the control plane's lookback)")
@click.option("--until", default=None, help="window end, same forms (default: when it runs)")
@click.option("--reason", default="", help="why (written to the audit log)")
@click.option("--segment", default=None,
              help="recalibrate this traffic segment alone (default: the whole deployment)")
@click.option("--wait", is_flag=True,
              help="wait until a worker has run the job, then show it (exit 1 if it failed)")
@click.option("--wait-timeout", type=click.FloatRange(min=1), default=600.0, show_default=True,
              help="with --wait: seconds to wait before giving up (the job goes on)")
def calibrations_start(api: ControlPlane, deployment: str, since: str | None,
                       until: str | None, reason: str, segment: str | None, wait: bool,
                       wait_timeout: float) -> None:
    """Queue a recalibration of DEPLOYMENT on its shadow samples (a worker runs it); an open
    job is returned instead of a second one. --wait follows it to its end."""
    body = {"since": _iso(since, "--since"), "until": _iso(until, "--until"),
            "reason": reason, "segment": segment}
    answer = api.request("POST", _deployment(deployment, "calibrations"),
                         json={key: value for key, value in body.items() if value})
    job = answer["job"]
    if wait:
        job = _await_job(api, deployment, job, wait_timeout)
        emit(api.output, job, lambda: _show_job(job))
        if job["status"] == "failed":
            fail(f"calibration job {job['id']} failed: {job['status_reason']}", REFUSED)
        return
    emit(api.output, answer, lambda: click.echo(
        f"{deployment}: calibration job {job['id']} {job['status']}"
        + ("" if answer["created"] else " (already open)")),
        names=lambda found: [found["job"]["id"]])


@operator_command(calibrations, "list")
@click.argument("deployment")
@click.option("--limit", type=click.IntRange(1, 500), default=20, show_default=True,
              help="newest jobs to show")
def calibrations_list(api: ControlPlane, deployment: str, limit: int) -> None:
    """DEPLOYMENT's recalibration jobs, newest first: status, the version each made, its
    promotion."""
    jobs = api.get(_deployment(deployment, "calibrations"), limit=limit)
    emit(api.output, jobs, lambda: table(jobs, JOB_COLUMNS))


def _show_job(job: dict) -> None:
    record(job, JOB_FIELDS)
    if job["layers"]:
        click.echo("")
        keys = list(job["layers"][0])
        table(job["layers"], [(key.upper().replace("_", " "), key) for key in keys])


@operator_command(calibrations, "show")
@click.argument("deployment")
@click.argument("job_id", type=int)
def calibrations_show(api: ControlPlane, deployment: str, job_id: int) -> None:
    """Job JOB_ID of DEPLOYMENT: per exit layer the threshold, empirical risk, bound and
    p-value."""
    job = api.get(_deployment(deployment, "calibrations", job_id))
    emit(api.output, job, lambda: _show_job(job))


def _decide(api: ControlPlane, deployment: str, job_id: int, verb: str, reason: str) -> None:
    job = api.request("POST", _deployment(deployment, "calibrations", job_id, verb),
                      json={"reason": reason})
    emit(api.output, job, lambda: click.echo(
        f"{deployment}: calibration job {job['id']} {job['promotion'] or job['status']}"
        + (f" (version {job['result_version']})" if job["result_version"] else "")))


@operator_command(calibrations, "approve")
@click.argument("deployment")
@click.argument("job_id", type=int)
@REASON
def calibrations_approve(api: ControlPlane, deployment: str, job_id: int, reason: str) -> None:
    """Promote the candidate of job JOB_ID (waiting for approval, or its canary paused) to
    active."""
    _decide(api, deployment, job_id, "approve", reason)


@operator_command(calibrations, "reject")
@click.argument("deployment")
@click.argument("job_id", type=int)
@REASON
def calibrations_reject(api: ControlPlane, deployment: str, job_id: int, reason: str) -> None:
    """Refuse the candidate of job JOB_ID (or revert its canary)."""
    _decide(api, deployment, job_id, "reject", reason)


# -- alerts ----------------------------------------------------------------------------------

@click.group()
def alerts() -> None:
    """Alerts over the API: list, show, acknowledge, resolve."""


ALERT_COLUMNS = [("ID", "id"), ("DEPLOYMENT", "deployment"), ("KIND", "kind"),
                 ("LAYER", "layer"), ("SEGMENT", "segment"), ("SEVERITY", "severity"),
                 ("STATUS", "status"), ("FIRED", "fired_at"), ("SUMMARY", "summary")]
ALERT_FIELDS = [(key, key) for key in (
    "id", "deployment", "kind", "layer", "segment", "severity", "status", "summary",
    "action_taken", "fired_at", "last_seen_at", "acknowledged_at", "acknowledged_by",
    "resolved_at", "resolved_by", "resolution", "report_url", "evidence")]


@operator_command(alerts, "list")
@click.option("--deployment", default=None, help="only this deployment's alerts")
@click.option("--status", type=click.Choice(["open", "firing", "acknowledged", "resolved"]),
              default=None, help="open: firing or acknowledged (default: every status)")
@click.option("--kind", default=None, help="only this kind, e.g. quality_regression")
@click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True,
              help="newest alerts to show")
def alerts_list(api: ControlPlane, deployment: str | None, status: str | None,
                kind: str | None, limit: int) -> None:
    """Alerts, newest first."""
    found = api.get("/v1/alerts", deployment=deployment, status=status, kind=kind, limit=limit)
    emit(api.output, found, lambda: table(found, ALERT_COLUMNS))


@operator_command(alerts, "show")
@click.argument("alert_id", type=int)
def alerts_show(api: ControlPlane, alert_id: int) -> None:
    """Alert ALERT_ID with its evidence (test, statistic, windows)."""
    alert = api.get(f"/v1/alerts/{alert_id}")
    emit(api.output, alert, lambda: record(alert, ALERT_FIELDS))


def _alert_line(alert: dict) -> str:
    return f"alert {alert['id']} ({alert['kind']}, {alert['deployment']}): {alert['status']}"


@operator_command(alerts, "ack")
@click.argument("alert_id", type=int)
@click.option("--note", default="", help="a note for whoever looks next")
def alerts_ack(api: ControlPlane, alert_id: int, note: str) -> None:
    """Acknowledge alert ALERT_ID: someone is on it (it stays open)."""
    alert = api.request("POST", f"/v1/alerts/{alert_id}/ack", json={"note": note})
    emit(api.output, alert, lambda: click.echo(_alert_line(alert)))


@operator_command(alerts, "resolve")
@click.argument("alert_id", type=int)
@REASON
def alerts_resolve(api: ControlPlane, alert_id: int, reason: str) -> None:
    """Resolve alert ALERT_ID."""
    alert = api.request("POST", f"/v1/alerts/{alert_id}/resolve", json={"reason": reason})
    emit(api.output, alert, lambda: click.echo(_alert_line(alert)))


# -- runtimes --------------------------------------------------------------------------------

@click.group()
def runtimes() -> None:
    """A deployment's runtime fleet over the API: list, remove, outliers."""


RUNTIME_COLUMNS = [("RUNTIME", "runtime_id"), ("VERSION", "applied_version"),
                   ("READY", "ready"), ("LAST SEEN", "last_seen"),
                   ("SPOOLED", "spooled_batches"), ("DROPPED", "dropped_records"),
                   ("LINEAGE MISMATCH", "lineage_mismatch_at"),
                   ("REFUSED", "refused_version"), ("ERROR", "error")]
OUTLIER_COLUMNS = [("ID", "id"), ("RUNTIME", "runtime_id"), ("STATUS", "status"),
                   ("VERSION", "version"), ("SEGMENT", "segment"), ("DETECTED", "detected_at"),
                   ("SUMMARY", "summary")]


@operator_command(runtimes, "list")
@click.argument("deployment")
def runtimes_list(api: ControlPlane, deployment: str) -> None:
    """DEPLOYMENT's runtimes: the version each applies, readiness, last heartbeat, backlog."""
    found = api.get(_deployment(deployment, "runtimes"))
    emit(api.output, found, lambda: table(found, RUNTIME_COLUMNS))


@operator_command(runtimes, "remove")
@click.argument("deployment")
@click.argument("runtime_id", required=False)
@click.option("--token-id", type=int, default=None,
              help="remove every runtime this token registered (e.g. a revoked, leaked one)")
def runtimes_remove(api: ControlPlane, deployment: str, runtime_id: str | None,
                    token_id: int | None) -> None:
    """Remove runtime RUNTIME_ID (or every runtime of --token-id) from DEPLOYMENT's fleet view
    and caps; a runtime that beats again registers anew."""
    if (runtime_id is None) == (token_id is None):
        fail("name one runtime (RUNTIME_ID) or one token (--token-id), not both or neither")
    if runtime_id is not None:
        answer = api.request("DELETE", _deployment(deployment, "runtimes", runtime_id))
    else:
        answer = api.request("DELETE", _deployment(deployment, "runtimes"),
                             params={"token_id": token_id})
    emit(api.output, answer, lambda: click.echo(
        f"{deployment}: removed {len(answer['removed'])} runtime(s)"
        + (f": {', '.join(answer['removed'])}" if answer["removed"] else "")))


@operator_command(runtimes, "outliers")
@click.argument("deployment")
@click.option("--open-only", is_flag=True, help="only runtimes set aside now")
def runtimes_outliers(api: ControlPlane, deployment: str, open_only: bool) -> None:
    """DEPLOYMENT's runtimes whose evidence was set aside as disagreeing with the fleet."""
    found = api.get(_deployment(deployment, "runtime-outliers"),
                    open_only="true" if open_only else None)
    emit(api.output, found, lambda: table(found, OUTLIER_COLUMNS))


@operator_command(runtimes, "clear-outlier")
@click.argument("deployment")
@click.argument("outlier_id", type=int)
@REASON
def runtimes_clear_outlier(api: ControlPlane, deployment: str, outlier_id: int,
                           reason: str) -> None:
    """Let the evidence of outlier record OUTLIER_ID count again."""
    row = api.request("POST", _deployment(deployment, "runtime-outliers", outlier_id, "clear"),
                      json={"reason": reason})
    emit(api.output, row, lambda: click.echo(
        f"{deployment}: runtime {row['runtime_id']} {row['status']}"))


# -- tokens ----------------------------------------------------------------------------------

@click.group()
def tokens() -> None:
    """API tokens over the API (an admin token): list, create, revoke."""


TOKEN_COLUMNS = [("ID", "id"), ("NAME", "name"), ("SCOPE", "scope"),
                 ("DEPLOYMENT", lambda t: t.get("deployment") or t.get("deployment_id")),
                 ("PREFIX", "prefix"), ("CREATED", "created_at"), ("REVOKED", "revoked_at")]


@operator_command(tokens, "list")
def tokens_list(api: ControlPlane) -> None:
    """Every API token (never its secret): scope, deployment, prefix, revoked or not."""
    found = api.get("/v1/tokens")
    emit(api.output, found, lambda: table(found, TOKEN_COLUMNS),
         names=lambda tokens: [token["id"] for token in tokens])


@operator_command(tokens, "create")
@new_token_options
@click.option("--reason", default="", help="why, for the audit log")
def tokens_create(api: ControlPlane, name: str, scope: str, deployment: str | None,
                  out_file: str | None, reason: str) -> None:
    """Create a token; its secret is shown once (table: the secret alone on stdout; with
    --out FILE, `-o name` prints its id)."""
    if api.output == "name" and not out_file:
        fail("-o name would not show the token's secret, which is shown only once: give "
             "--out FILE, or use -o table, json or yaml")
    made = api.request("POST", "/v1/tokens",
                       json={"name": name, "scope": scope, "deployment": deployment,
                             **({"reason": reason} if reason else {})})
    if out_file:
        write_token_file(out_file, made["token"])
        click.echo(f"wrote the {scope} token {name!r} (id {made['id']}) to {out_file}",
                   err=True)
        made = {**made, "token": None}
        emit(api.output, made, lambda: None, names=lambda token: [token["id"]])
        return
    emit(api.output, made, lambda: click.echo(made["token"]))


@operator_command(tokens, "revoke")
@click.argument("token_id", type=int)
@click.option("--reason", default="", help="why, for the audit log")
def tokens_revoke(api: ControlPlane, token_id: int, reason: str) -> None:
    """Revoke token TOKEN_ID: every request with it is refused from now on."""
    revoked = api.request("DELETE", f"/v1/tokens/{token_id}",
                          params={"reason": reason} if reason else None)
    emit(api.output, revoked, lambda: click.echo(
        f"token {revoked['id']} ({revoked['name']}) revoked"))


AUDIT_COLUMNS = [("WHEN", "at"), ("ACTOR", "actor"), ("ACTION", "action"),
                 ("OBJECT", "target"), ("DEPLOYMENT", "deployment"), ("REASON", "reason")]
AUDIT_PAGE_MAX = 500  # the API's largest page


@operator_command(None, "audit")
@click.option("--actor", default=None,
              help="only this actor, e.g. user:alice, token:ci, system:fallback (a trailing * "
                   "matches a prefix: 'system:*')")
@click.option("--action", default=None,
              help="only this action, e.g. alias.rollback (a trailing * matches a family: "
                   "'token.*')")
@click.option("--deployment", default=None, help="only events of this deployment")
@click.option("--object-kind", default=None,
              help="only actions on this kind of object: token, user, hook, alert, "
                   "deployment, alias, threshold_set ...")
@click.option("--since", default=None,
              help="events at or after this ISO time (UTC if no offset) or age like 30m, 6h, 2d")
@click.option("--until", default=None, help="events before this moment, same forms")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 100_000),
              help="at most this many events, newest first (pages are followed)")
@click.option("--page-size", default=AUDIT_PAGE_MAX, show_default=True,
              type=click.IntRange(1, AUDIT_PAGE_MAX), help="events asked for per request")
def audit(api: ControlPlane, actor: str | None, action: str | None, deployment: str | None,
          object_kind: str | None, since: str | None, until: str | None, limit: int,
          page_size: int) -> None:
    """The fleet-wide audit log, newest first (admin token): every deployment's changes
    (alias moves, publications, rollbacks, canaries, calibration decisions, segments,
    runtimes) and administrative actions (tokens, users and roles, alert hooks, alerts), by
    people, tokens and the workers (system:...)."""
    query = {"actor": actor, "action": action, "deployment": deployment,
             "object_kind": object_kind, "since": _iso(since, "--since"),
             "until": _iso(until, "--until")}
    found: list[dict] = []
    cursor = None
    while len(found) < limit:
        wanted = min(page_size, limit - len(found))
        page = api.get("/v1/audit", **query, cursor=cursor, limit=wanted)
        found.extend(page)
        if len(page) < wanted:  # the last page
            break
        cursor = page[-1]["cursor"]
    # ids are per table: an event is named by its source and id
    emit(api.output, found, lambda: table(found, AUDIT_COLUMNS),
         names=lambda events: [f"{event['source']}:{event['id']}" for event in events])
