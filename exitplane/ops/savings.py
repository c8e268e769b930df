"""`exitplane savings`: what early exit saved, measured against full depth and net of exit
checks and shadow tokens, for one deployment or the fleet (GET /v1/deployments/{name}/savings,
GET /v1/savings)."""

from __future__ import annotations

import click

from exitplane.ops.api import ControlPlane, fail, moment, operator_command, part
from exitplane.ops.curve import window_seconds
from exitplane.ops.render import emit, record, table


def _signed(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    hours = seconds / 3600
    return f"{seconds:+.3f} s ({hours:+.4f} h)"


def _figures(report: dict) -> list:
    time = report.get("time") or {}
    cost = report.get("cost") or {}
    return [
        ("tokens", "tokens"), ("timed tokens", "timed_tokens"),
        ("shadow tokens", "shadow_tokens"), ("layers saved", "layers_saved"),
        ("full depth", lambda _: _signed(time.get("full_depth_s"))),
        ("spent", lambda _: _signed(time.get("spent_s"))),
        ("net saved", lambda _: _signed(time.get("net_saved_s"))),
        ("  by exits", lambda _: _signed(time.get("saved_by_exits_s"))),
        ("  on checks", lambda _: _signed(-time["checks_s"]) if time else "-"),
        ("  on shadow tokens", lambda _: _signed(-time["shadow_s"]) if time else "-"),
        ("  unexplained", lambda _: _signed(time.get("unexplained_s"))),
        ("speed-up", lambda row: f"{row['speedup']:.3f}x" if row.get("speedup") else "-"),
        ("pays", lambda row: {True: "yes", False: "no: a net loss", None: "-"}[row["pays"]]),
        ("cost saved", lambda _: f"{cost['net_saved']:+.6f} {cost['unit']}" if cost else "-"),
    ]


def _model(report: dict) -> str:
    model = report.get("cost_model")
    if model is None:
        return f"none: {report.get('cost_model_reason')}"
    return (f"{model['overhead_us']:.1f} us + {model['layer_us']:.2f} us/layer + "
            f"{model['check_us']:.2f} us/check ({model['tokens']} timed tokens)")


@operator_command(None, "savings")
@click.argument("deployment", required=False)
@click.option("--window", default="1h", show_default=True,
              help="the last 30m, 1h, 7d ... (at most 31 days)")
@click.option("--since", default=None,
              help="window start instead: ISO time (UTC if no offset) or an age like 6h")
@click.option("--until", default=None, help="window end, same forms (default: now)")
@click.option("--segment", default=None, help="this traffic segment's tokens only")
@click.option("--runtime", "runtime_id", default=None, metavar="ID",
              help="this runtime's tokens only")
def savings(api: ControlPlane, deployment: str | None, window: str, since: str | None,
            until: str | None, segment: str | None, runtime_id: str | None) -> None:
    """What early exit saved DEPLOYMENT (default: every deployment, and the fleet): tokens,
    layers saved, accelerator time at full depth and spent, the net saving (negative: a loss)
    net of exit checks and shadow tokens, the measured speed-up and the fitted cost model."""
    params: dict = {"segment": segment, "runtime_id": runtime_id,
                    "window_s": int(window_seconds(window))}
    try:
        if since:
            params["since"] = moment(since).isoformat()
        if until:
            params["until"] = moment(until).isoformat()
    except ValueError as error:
        fail(str(error))
    params = {key: value for key, value in params.items() if value is not None}
    if deployment is not None:
        found = api.get(f"/v1/deployments/{part(deployment)}/savings", **params)

        def one() -> None:
            record(found, [("deployment", "deployment"), ("since", "since"),
                           ("until", "until"), *_figures(found), ("cost model", _model)])

        emit(api.output, found, one)
        return
    found = api.get("/v1/savings", **params)

    def fleet() -> None:
        table(found["deployments"] + [{"deployment": "(fleet)", **found["total"]}],
              [("DEPLOYMENT", "deployment"), ("TOKENS", "tokens"),
               ("LAYERS SAVED", "layers_saved"),
               ("NET SAVED S", lambda row: f"{row['time']['net_saved_s']:+.3f}"
                if row.get("time") else "-"),
               ("SPEED-UP", lambda row: f"{row['speedup']:.3f}x" if row.get("speedup")
                else "-"),
               ("PAYS", lambda row: {True: "yes", False: "no", None: "-"}[row["pays"]])])

    emit(api.output, found, fleet)
