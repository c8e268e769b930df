"""Operator commands of the operating curve: `versions what-if` (any threshold set evaluated on
stored shadow evidence before it ships) and `deployments curve` (the curve the workers keep)."""

from __future__ import annotations

import click

from exitplane.ops.api import ControlPlane, fail, moment, operator_command, part
from exitplane.ops.deployments import deployments, layer_pairs, resolve_version, versions
from exitplane.ops.render import emit, record, table

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _path(deployment: str, *rest: str) -> str:
    return "/".join(["/v1/deployments", part(deployment), *rest])


def window_seconds(value: str) -> float:
    """'90s', '30m', '1h', '2d' or a number of seconds -> seconds."""
    number, unit = (value[:-1], value[-1]) if value[-1:] in UNITS else (value, "s")
    try:
        seconds = float(number) * UNITS[unit]
    except ValueError:
        fail(f"--window {value!r}: write a length like 30m, 1h, 2d (or seconds)")
    if seconds <= 0:
        fail(f"--window {value!r}: the window must be longer than nothing")
    return seconds


def _show_what_if(found: dict) -> None:
    record(found, [("set", "thresholds"), ("source", "source"), ("version", "version"),
                   ("shadow tokens", "tokens"), ("requests", "requests"),
                   ("witnesses", "witnesses"), ("exit rate", "exit_rate"),
                   ("exit rate by layer", "exit_rate_by_layer"),
                   ("disagreement", "disagreement"),
                   ("disagreement bound", "disagreement_bound"), ("δ", "delta"),
                   ("1-ε", lambda row: 1 - row["epsilon"]), ("certified", "certified"),
                   ("mean depth", "mean_depth"), ("speed-up", "speedup"),
                   ("net saving", "net_saving"),
                   ("cost model", lambda row: row["cost_model"] or "none fitted: layers ratio")])


@operator_command(versions, "what-if")
@click.argument("deployment")
@click.option("--version", "version", default=None,
              help="a stored version (a number, or active / conservative / canary)")
@click.option("--set", "pairs", multiple=True, metavar="LAYER=THRESHOLD",
              help="a hand-edited set, one layer each (repeatable); layers not named never "
                   "exit")
@click.option("--delta", type=click.FloatRange(0, 1, min_open=True, max_open=True),
              default=None, help="the set a calibration would choose at this δ")
@click.option("--epsilon", type=click.FloatRange(0, 1, min_open=True, max_open=True),
              default=None, help="with --delta: its ε (default: the deployment's)")
@click.option("--window", default="1h", show_default=True,
              help="the last 30m, 1h, 2d ... of shadow evidence")
@click.option("--since", default=None,
              help="window start instead: ISO time (UTC if no offset) or an age like 6h")
@click.option("--until", default=None, help="window end, same forms (default: now)")
@click.option("--segment", default=None, help="this traffic segment's evidence only")
@click.option("--runtime", "runtimes", multiple=True, metavar="ID",
              help="these runtimes' evidence only (repeatable)")
def versions_what_if(api: ControlPlane, deployment: str, version: str | None,
                     pairs: tuple[str, ...], delta: float | None, epsilon: float | None,
                     window: str, since: str | None, until: str | None,
                     segment: str | None, runtimes: tuple[str, ...]) -> None:
    """What a threshold set of DEPLOYMENT would do on stored shadow evidence: exit rates,
    disagreement and its bound at 1-ε, mean depth, predicted speed-up and net saving. Name one
    set: --version N, --set LAYER=THRESHOLD ..., or --delta D [--epsilon E]."""
    if sum([version is not None, bool(pairs), delta is not None]) != 1:
        fail("name exactly one set: --version N, --set LAYER=THRESHOLD ... or --delta D")
    if epsilon is not None and delta is None:
        fail("--epsilon goes with --delta")
    body: dict = {"segment": segment, "runtimes": list(runtimes) or None}
    if version is not None:
        body["version"] = resolve_version(api, deployment, version)
    elif pairs:
        body["thresholds"] = layer_pairs(pairs, "--set")
    else:
        body |= {"delta": delta, "epsilon": epsilon}
    try:
        if since or until:
            body |= {"since": moment(since).isoformat() if since else None,
                     "until": moment(until).isoformat() if until else None}
            if not since:
                body["window_s"] = window_seconds(window)
        else:
            body["window_s"] = window_seconds(window)
    except ValueError as error:
        fail(str(error))
    found = api.request("POST", _path(deployment, "what-if"),
                        json={key: value for key, value in body.items() if value is not None})
    emit(api.output, found, lambda: _show_what_if(found))


POINT_COLUMNS = [("STEP", "step"), ("EXIT RATE", "exit_rate"),
                 ("DISAGREEMENT", "disagreement"), ("BOUND", "disagreement_bound"),
                 ("SPEED-UP", "speedup"), ("NET SAVING", "net_saving"),
                 ("CERTIFIED", "certified"), ("CHOSEN", "chosen")]


@operator_command(deployments, "curve")
@click.argument("deployment")
@click.option("--segment", default="default", show_default=True, help="the traffic segment")
def deployments_curve(api: ControlPlane, deployment: str, segment: str) -> None:
    """The operating curve the workers last drew for DEPLOYMENT: the frontier, the sets
    marked on it, the best certified set and what is left on the table."""
    found = api.get(_path(deployment, "operating-curve"), segment=segment)

    def people() -> None:
        record(found, [("computed", "computed_at"), ("window", "window"),
                       ("evidence", "evidence"), ("best", "best"), ("left on the table", "gap"),
                       ("opportunity", "opportunity")])
        table([{"mark": name} | point for name, point in found["marks"].items()],
              [("MARK", "mark"), ("VERSION", "version"), ("EXIT RATE", "exit_rate"),
               ("DISAGREEMENT", "disagreement"), ("SPEED-UP", "speedup"),
               ("NET SAVING", "net_saving")])
        table(found["points"], POINT_COLUMNS)

    emit(api.output, found, people)
