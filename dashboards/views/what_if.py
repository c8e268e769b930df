"""What-if: an operator evaluates a threshold set (a version, hand-edited thresholds, or what
calibration would choose at another δ or ε) on the stored shadow evidence of a window, segment
and runtimes, sees its point on the operating curve, and may publish it as a manual version
through the versions page's publish route (same permission, CSRF check and audit record).

The evaluation is the what-if flow's (`controlplane.flows.what_if`); it runs only when the
form is submitted (a GET: evaluating stores nothing). The curve drawn behind the point is
the stored one, never recomputed here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import Response
from sqlalchemy.orm import Session
from starlette.datastructures import QueryParams

from controlplane.calibration.what_if import WhatIf
from controlplane.db import SessionDep
from controlplane.deployments import service as thresholds
from controlplane.deployments.models import Deployment, ThresholdSet
from controlplane.deployments.segment_sets import thresholds_for
from controlplane.deployments.segments import known_segments
from controlplane.errors import DomainError, Invalid
from controlplane.flows.what_if import what_if
from controlplane.runtimes.service import list_runtimes
from dashboards import curve_chart
from dashboards.curve_panel import curve_panel
from dashboards.security import Operator
from dashboards.templating import render
from exitplane.wire import DEFAULT_SEGMENT, NEVER_EXIT

router = APIRouter()

WINDOWS = {"1h": 3600, "6h": 6 * 3600, "24h": 86400, "72h": 3 * 86400}
BASES = ("thresholds", "version", "calibration")


@dataclass
class WhatIfForm:
    """The form as typed (kept to re-show it with the result or a refusal)."""

    base: str = "thresholds"
    version: int | None = None
    thresholds: dict[int, str] = field(default_factory=dict)
    delta: str = ""
    epsilon: str = ""
    window: str = "1h"
    segment: str = ""
    runtimes: list[str] = field(default_factory=list)


def _initial_form(deployment: Deployment, active_version: int, active: ThresholdSet,
                  segment: str) -> WhatIfForm:
    """The active version's thresholds (those `segment` applies) and the deployment's δ, ε."""
    applied = thresholds_for(active, segment or DEFAULT_SEGMENT)
    return WhatIfForm(version=active_version, segment=segment,
                      thresholds={layer: f"{value:g}" for layer, value in applied.items()},
                      delta=f"{deployment.delta:g}", epsilon=f"{deployment.epsilon:g}")


def _typed(form: QueryParams, deployment: Deployment) -> WhatIfForm:
    version = str(form.get("version", "")).strip()
    return WhatIfForm(
        base=str(form.get("base", "thresholds")),
        version=int(version) if version.isdigit() else None,
        thresholds={layer: str(form.get(f"layer_{layer}", "")).strip()
                    for layer in deployment.exit_layers},
        delta=str(form.get("delta", "")).strip(), epsilon=str(form.get("epsilon", "")).strip(),
        window=str(form.get("window", "1h")), segment=str(form.get("segment", "")).strip(),
        runtimes=[str(r) for r in form.getlist("runtime")])


def _number(raw: str, what: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise Invalid(f"{what} must be a number, got {raw!r}") from None


def _run(session: Session, deployment: Deployment, typed: WhatIfForm) -> WhatIf:
    """The what-if flow's answer for the form; Invalid says what to correct."""
    if typed.base not in BASES:
        raise Invalid(f"choose what to evaluate: one of {', '.join(BASES)}")
    if typed.window not in WINDOWS:
        raise Invalid(f"choose a window of {', '.join(WINDOWS)}")
    chosen: dict = {}
    if typed.base == "version":
        if typed.version is None:
            raise Invalid("choose a version to evaluate")
        chosen["version"] = typed.version
    elif typed.base == "calibration":
        chosen["delta"] = _number(typed.delta, "δ")
        chosen["epsilon"] = _number(typed.epsilon, "ε")
    else:
        chosen["thresholds"] = {
            layer: _number(raw, f"the threshold of layer {layer}")
            for layer, raw in typed.thresholds.items() if raw}
    return what_if(session=session, deployment=deployment, window_s=WINDOWS[typed.window],
                   segment=typed.segment or None, runtimes=typed.runtimes or None, **chosen)


def _publish_maps(active: ThresholdSet, evaluated: dict[int, float], segment: str
                  ) -> tuple[dict[int, float], list[tuple[str, dict[int, float]]]]:
    """The default map and segment rows a published set carries: the evaluated thresholds in
    the evaluated segment's place (the default map for all traffic), the active version's
    maps everywhere else."""
    default = active.thresholds_by_layer()
    segments = dict(active.segments_by_layer() or {})
    if segment and segment != DEFAULT_SEGMENT:
        segments[segment] = dict(evaluated)
    else:
        default = dict(evaluated)
    return default, sorted(segments.items())


def _page(request: Request, session: Session, deployment: Deployment, *,
          typed: WhatIfForm | None = None, result: WhatIf | None = None, error: str | None = None,
          status_code: int = 200, segment: str = "") -> Response:
    aliases = thresholds.aliases_of(session=session, deployment=deployment)
    active = thresholds.get_threshold_set(session=session, deployment=deployment,
                                          version=aliases["active"])
    form = typed or _initial_form(deployment, aliases["active"], active, segment)
    panel = curve_panel(session=session, deployment=deployment, segment=form.segment or None,
                        interval_s=request.app.state.settings.operating_curve_interval_s)
    context: dict = {}
    if result is not None:
        evaluated = {int(k): float(v) for k, v in result.thresholds.items()}
        point = curve_chart.Point(speedup=result.speedup, disagreement=result.disagreement,
                                  upper=result.disagreement_bound)
        context["chart"] = curve_chart.operating_curve_svg(
            frontier=panel.frontier, marks=panel.marks, delta=result.delta, what_if=point,
            what_if_base=panel.marks.get("active"),
            label="The evaluated set on the operating curve")
        context["publish_default"], context["publish_segments"] = _publish_maps(
            active, evaluated, form.segment)
        context["publish_segment"] = (form.segment if form.segment not in ("", DEFAULT_SEGMENT)
                                      else None)
        context["result_label"] = _label(result)
    return render(request, "what_if.html", status_code=status_code, deployment=deployment,
                  aliases=aliases, form=form, result=result, error=error,
                  curve_panel=panel, windows=WINDOWS, never_exit=NEVER_EXIT,
                  sets=thresholds.list_threshold_sets(session=session, deployment=deployment,
                                                      limit=100),
                  segment_names=[DEFAULT_SEGMENT, *sorted(
                      known_segments(session=session, deployment_id=deployment.id))],
                  runtimes=list_runtimes(session=session, deployment=deployment), **context)


def _label(result: WhatIf) -> str:
    if result.source == "version":
        return f"v{result.version}"
    if result.source == "calibration":
        return f"what calibration would choose at δ {result.delta:g}, ε {result.epsilon:g}"
    return "the thresholds as edited"


@router.get("/deployments/{name}/what-if")
def what_if_page(name: str, request: Request, session: SessionDep, _user: Operator) -> Response:
    """The form, starting from the active version's thresholds and the deployment's δ, ε; with
    `run` in the query, the set it names evaluated (a read: nothing is stored, so the form is
    a GET and a result can be bookmarked). A refusal re-shows the form as typed, with what to
    correct."""
    deployment = thresholds.get_deployment(session=session, name=name)
    query = request.query_params
    if "run" not in query:
        return _page(request, session, deployment, segment=query.get("segment", ""))
    typed = _typed(query, deployment)
    try:
        result = _run(session, deployment, typed)
    except DomainError as error:
        session.rollback()
        return _page(request, session, deployment, typed=typed, error=str(error),
                     status_code=error.status_code)
    return _page(request, session, deployment, typed=typed, result=result)
