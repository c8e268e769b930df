"""`exitplane deployments answers`: how often whole answers equal the full-depth ones, per version
and segment, on the window's shadow requests (GET /v1/deployments/{name}/answers)."""

from __future__ import annotations

import click

from exitplane.ops.api import ControlPlane, operator_command, part
from exitplane.ops.curve import window_seconds
from exitplane.ops.deployments import deployments, resolve_version
from exitplane.ops.render import emit, record, table


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _rows(found: dict) -> list[dict]:
    """One row per (version, segment)."""
    return [{"version": version["version"], **segment} for version in found["versions"]
            for segment in version["segments"]]


COLUMNS = [
    ("VERSION", "version"), ("SEGMENT", "segment"), ("REQUESTS", "requests"),
    ("DIFFERING", "differing"), ("IDENTICAL", lambda row: _share(row["identical_share"])),
    ("DIFFER BOUND", lambda row: _share(row["differing_bound"])),
    ("WITHIN δ_ANSWER", lambda row: {True: "yes", False: "NO", None: "-"}[row["within_target"]]),
    ("MEDIAN DIVERGENCE", lambda row: (row["divergence_quantiles"] or {}).get("p50", "-")),
    ("MEAN TOKENS", lambda row: "-" if row["mean_tokens"] is None
     else f"{row['mean_tokens']:.1f}"),
]


@operator_command(deployments, "answers")
@click.argument("deployment")
@click.option("--window", default="1h", show_default=True,
              help="the last 30m, 1h, 2d ... of shadow requests")
@click.option("--segment", default=None, help="this traffic segment only (default: each)")
@click.option("--version", "version", default=None,
              help="this version only (a number, or active / canary / conservative; default: "
                   "each version that served shadow requests in the window)")
def deployments_answers(api: ControlPlane, deployment: str, window: str,
                        segment: str | None, version: str | None) -> None:
    """How often DEPLOYMENT's whole answers equal the full-depth answer, per version and
    segment, on the window's complete shadow requests: the identical share, the bound at
    1-ε on the share that differs against delta_answer, and where differing answers first
    diverged (median position)."""
    params: dict = {"window": int(window_seconds(window)), "segment": segment}
    if version is not None:
        params["version"] = resolve_version(api, deployment, version)
    found = api.get(f"/v1/deployments/{part(deployment)}/answers",
                    **{key: value for key, value in params.items() if value is not None})

    def people() -> None:
        target = found["delta_answer"]
        record(found, [("deployment", "deployment"), ("since", "since"), ("until", "until"),
                       ("active version", "active_version"), ("requests", "requests"),
                       ("δ_answer", lambda _: "none set" if target is None else f"{target:g}"),
                       ("1-ε", lambda row: f"{1 - row['epsilon']:g}")])
        rows = _rows(found)
        if rows:
            table(rows, COLUMNS)
        else:
            click.echo("no complete shadow request in the window (runtimes serve them when the "
                       "deployment sets a shadow_request_rate)")

    emit(api.output, found, people, names=lambda data: [
        f"{row['version']}/{row['segment']}" for row in _rows(data)])
