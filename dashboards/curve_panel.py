"""The operating-curve panel's data: the stored curve of a deployment and segment (written by
the workers, read through the calibration domain), shaped for `curve_chart`: the frontier, the
marked sets, the gap to the best certified set, and when the curve was and will be computed.

Nothing is evaluated here: a page that shows the curve costs one read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from markupsafe import Markup
from sqlalchemy.orm import Session

from controlplane.deployments.models import Deployment
from controlplane.flows.operating_curve import latest_curve
from dashboards.curve_chart import Point, operating_curve_svg
from exitplane.wire import DEFAULT_SEGMENT

MARK_NAMES = ("active", "canary", "conservative", "last_good", "best")
ROW_FIGURES = ("speedup", "net_saving", "exit_rate", "disagreement", "disagreement_bound")


@dataclass
class CurvePanel:
    """What the panel shows; `curve` None when no curve is stored yet, `note` why a stored
    one holds no frontier (too few shadow samples in its window)."""

    curve: dict | None
    segment: str = DEFAULT_SEGMENT
    interval_s: float | None = None
    note: str | None = None
    frontier: list[Point] = field(default_factory=list)
    marks: dict[str, Point] = field(default_factory=dict)
    rows: list[dict] = field(default_factory=list)  # one per marked set, for the table
    gap: dict | None = None
    computed_at: datetime | None = None
    next_due: datetime | None = None
    chart: Markup | None = None


def _point(figures: dict, label: str = "") -> Point | None:
    if not isinstance(figures, dict) or figures.get("speedup") is None:
        return None
    return Point(speedup=float(figures["speedup"]),
                 disagreement=float(figures.get("disagreement") or 0.0),
                 upper=(None if figures.get("disagreement_bound") is None
                        else float(figures["disagreement_bound"])),
                 label=label)


def _when(value) -> datetime | None:
    if isinstance(value, datetime) or value is None:
        return value
    return datetime.fromisoformat(str(value))


def panel_from_curve(curve: dict | None, *, delta: float, interval_s: float | None = None,
                     segment: str = DEFAULT_SEGMENT) -> CurvePanel:
    """The panel for a stored curve (`flows.operating_curve.latest_curve`'s shape); the next
    computation is due `interval_s` after the stored one."""
    if not curve:
        return CurvePanel(curve=None, segment=segment, interval_s=interval_s)
    computed_at = _when(curve.get("computed_at"))
    evidence = curve.get("evidence") or {}
    frontier = [p for p in (_point(f) for f in curve.get("points") or []) if p is not None]
    marks, rows = {}, []
    stored = {**(curve.get("marks") or {}), "best": curve.get("best")}
    for name in MARK_NAMES:
        figures = stored.get(name)
        version = figures.get("version") if isinstance(figures, dict) else None
        point = _point(figures, f"v{version}" if version is not None else "")
        if point is None:
            continue
        marks[name] = point
        rows.append({"name": name, "version": version,
                     **{key: figures.get(key) for key in ROW_FIGURES}})
    panel = CurvePanel(
        curve=curve if frontier else None, segment=segment, interval_s=interval_s,
        note=None if frontier else evidence.get("note"), frontier=frontier, marks=marks,
        rows=rows, gap=curve.get("gap"), computed_at=computed_at,
        next_due=(computed_at + timedelta(seconds=interval_s)
                  if computed_at and interval_s else None))
    if not frontier:
        return panel
    panel.chart = operating_curve_svg(
        frontier=frontier, marks=marks, delta=float(evidence.get("delta", delta)),
        label="Operating curve: shadow disagreement against predicted speed-up, with the "
              "marked threshold sets")
    return panel


def curve_panel(*, session: Session, deployment: Deployment, segment: str | None = None,
                interval_s: float | None = None) -> CurvePanel:
    """The stored curve of `deployment`'s `segment` (None: the default segment) as a panel."""
    segment = segment or DEFAULT_SEGMENT
    return panel_from_curve(latest_curve(session, deployment, segment),
                            delta=deployment.delta, interval_s=interval_s, segment=segment)
