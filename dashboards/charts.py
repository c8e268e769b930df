"""Pictures of a deployment's exit behaviour: Plotly figure dicts and inline SVG sparklines.

Everything here reads through `controlplane.telemetry.service` (the per-minute rollups) and
the threshold audit log; nothing recomputes what the services already provide.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from markupsafe import Markup, escape
from sqlalchemy.orm import Session

from controlplane.alerts import service as alerts
from controlplane.db import utcnow
from controlplane.deployments import service as thresholds
from controlplane.deployments.models import Deployment
from controlplane.telemetry import reads
from controlplane.telemetry import service as telemetry
from controlplane.telemetry.models import HISTOGRAM_BINS
from controlplane.telemetry.tables import ROLLUP_COUNTERS

WINDOWS = {"15m": 15, "1h": 60, "6h": 360, "24h": 1440}
# Okabe-Ito: distinguishable with the common colour-vision deficiencies.
PALETTE = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000",
           "#F0E442"]
DANGER = "#B3261E"
MARKER_ACTIONS = {"alias.move", "alias.rollback", "alias.clear"}


@dataclass(frozen=True)
class Marker:
    """A moment worth a vertical line on the time charts: a version change or an alert."""

    at: datetime
    label: str
    kind: str  # "version" or "alert"


@dataclass
class MinuteSummary(reads.RollupFigures):
    """One minute of the deployment's (or one segment's) rollups."""

    minute: datetime = field(kw_only=True)


def since_for(minutes: int) -> datetime:
    now = utcnow().replace(second=0, microsecond=0)
    return now - timedelta(minutes=minutes - 1)


def per_minute(*, session: Session, deployment: Deployment, since: datetime,
               rates: list[dict] | None = None,
               segment: str | None = None) -> list[MinuteSummary]:
    """Tokens, early exits, depth and shadow disagreement per minute (oldest first), of one
    traffic segment when `segment` is given; `rates`: what `telemetry.exit_rates` gave for
    the same window, if the caller has it (its rows carry every rollup counter)."""
    if rates is None:
        rates = telemetry.exit_rates(session=session, deployment=deployment, since=since,
                                     segment=segment)
    first = deployment.exit_layers[0]
    minutes: dict[datetime, MinuteSummary] = {}
    for row in rates:
        summary = minutes.setdefault(row["minute"], MinuteSummary(minute=row["minute"]))
        summary.add(layer=row["layer"], first=first, num_layers=deployment.num_layers,
                    counts={name: row[name] for name in ROLLUP_COUNTERS})
    return [minutes[key] for key in sorted(minutes)]


def totals(deployment: Deployment, minutes: list[MinuteSummary]) -> dict:
    """Window totals for the stat cards."""
    window = reads.RollupFigures.total(minutes)
    depth = window.mean_depth
    return {
        "tokens": window.tokens,
        "early_exit_rate": window.exit_rate,
        "shadow_tokens": window.shadow_tokens,
        "disagreement": window.disagreement,
        "delta": deployment.delta,
        "mean_depth": depth,
        "speedup": deployment.num_layers / depth if depth else None,
        "num_layers": deployment.num_layers,
    }


def version_markers(*, session: Session, deployment: Deployment,
                    since: datetime) -> list[Marker]:
    markers = []
    for event in thresholds.audit_log(session=session, deployment=deployment, limit=500):
        if event.created_at < since:
            break
        if event.action in MARKER_ACTIONS and event.alias in ("active", "canary"):
            target = f"v{event.to_version}" if event.to_version else "cleared"
            verb = "rollback" if event.action == "alias.rollback" else event.alias
            markers.append(Marker(event.created_at, f"{verb} → {target}", "version"))
    return markers


def alert_markers(*, session: Session, deployment: Deployment, since: datetime) -> list[Marker]:
    """Where alerts fired, from the alerts domain."""
    found = alerts.list_alerts(session=session, deployment=deployment, limit=200)
    return [Marker(a.fired_at, f"⚠ {a.kind}" + (f" L{a.layer}" if a.layer is not None else ""),
                   "alert") for a in found if a.fired_at >= since]


def markers_for(*, session: Session, deployment: Deployment, since: datetime) -> list[Marker]:
    return (version_markers(session=session, deployment=deployment, since=since)
            + alert_markers(session=session, deployment=deployment, since=since))


def _layout(title: str, y_title: str, **extra) -> dict:
    layout = {
        "title": {"text": title, "x": 0, "xanchor": "left", "font": {"size": 15}},
        "margin": {"l": 56, "r": 16, "t": 40, "b": 40},
        "height": 300,
        "paper_bgcolor": "#ffffff",
        "plot_bgcolor": "#ffffff",
        "font": {"family": "system-ui, -apple-system, Segoe UI, Roboto, sans-serif",
                 "color": "#1f2328", "size": 12},
        "legend": {"orientation": "h", "y": -0.2, "x": 0},
        "yaxis": {"title": {"text": y_title}, "gridcolor": "#e6e8eb", "zeroline": False},
        "xaxis": {"gridcolor": "#e6e8eb"},
        "hovermode": "x unified",
    }
    layout.update(extra)
    return layout


def _with_markers(layout: dict, markers: list[Marker]) -> dict:
    shapes, notes = [], []
    for marker in markers:
        color = DANGER if marker.kind == "alert" else "#57606a"
        when = marker.at.isoformat()
        shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": when, "x1": when,
                       "y0": 0, "y1": 1, "line": {"color": color, "width": 1.5,
                                                  "dash": "dot"}})
        notes.append({"x": when, "xref": "x", "yref": "paper", "y": 1, "yanchor": "bottom",
                      "text": escape(marker.label), "showarrow": False,
                      "font": {"size": 10, "color": color}, "textangle": 0})
    layout["shapes"] = layout.get("shapes", []) + shapes
    layout["annotations"] = layout.get("annotations", []) + notes
    return layout


def _x_range(since: datetime) -> list[str]:
    return [since.isoformat(), (utcnow() + timedelta(seconds=30)).isoformat()]


def deployment_figures(*, session: Session, deployment: Deployment, minutes: int,
                       markers: list[Marker], segment: str | None = None) -> dict:
    """Everything the deployment page draws, as JSON-ready Plotly figures plus totals; the
    deployment-wide figures and totals of one traffic segment when `segment` is given."""
    since = since_for(minutes)
    rates = telemetry.exit_rates(session=session, deployment=deployment, since=since,
                                 segment=segment)
    summary = per_minute(session=session, deployment=deployment, since=since, rates=rates,
                         segment=segment)
    markers = [m for m in markers if m.at >= since]
    x_axis = {"type": "date", "range": _x_range(since), "gridcolor": "#e6e8eb"}
    layers = [*deployment.exit_layers, deployment.num_layers]
    colour = {layer: PALETTE[i % len(PALETTE)] for i, layer in enumerate(layers)}

    by_layer: dict[int, list[dict]] = defaultdict(list)
    exits_by_layer: dict[int, int] = dict.fromkeys(layers, 0)
    for row in rates:
        by_layer[row["layer"]].append(row)
        exits_by_layer[row["layer"]] = exits_by_layer.get(row["layer"], 0) + row["exits"]
    exit_traces = [{
        "type": "scatter", "mode": "lines+markers", "name": f"layer {layer}",
        "x": [r["minute"].isoformat() for r in by_layer[layer]],
        "y": [r["exit_rate"] for r in by_layer[layer]],
        "line": {"color": colour[layer], "width": 2}, "marker": {"size": 4},
        "hovertemplate": "%{y:.1%}",
    } for layer in deployment.exit_layers]
    exit_rate = {"data": exit_traces, "layout": _with_markers(_layout(
        "Exit rate by layer", "exits / tokens reaching the layer",
        xaxis=x_axis, yaxis={"title": {"text": "exit rate"}, "tickformat": ".0%",
                             "rangemode": "tozero", "gridcolor": "#e6e8eb"}), markers)}

    delta = deployment.delta
    disagreement = {"data": [
        {"type": "scatter", "mode": "lines+markers", "name": "shadow disagreement",
         "x": [m.minute.isoformat() for m in summary if m.shadow_tokens],
         "y": [m.disagreement for m in summary if m.shadow_tokens],
         "customdata": [[m.policy_mismatches, m.shadow_tokens] for m in summary
                        if m.shadow_tokens],
         "hovertemplate": "%{y:.2%} (%{customdata[0]} of %{customdata[1]})",
         "line": {"color": PALETTE[0], "width": 2}, "marker": {"size": 4}},
        {"type": "scatter", "mode": "lines", "name": f"δ = {delta:g}",
         "x": _x_range(since), "y": [delta, delta], "hoverinfo": "skip",
         "line": {"color": DANGER, "width": 2, "dash": "dash"}},
    ], "layout": _with_markers(_layout(
        "Shadow disagreement vs δ", "disagreement", xaxis=x_axis,
        yaxis={"title": {"text": "disagreement"}, "tickformat": ".1%", "rangemode": "tozero",
               "gridcolor": "#e6e8eb"}), markers)}

    with_tokens = [m for m in summary if m.tokens]
    depth = {"data": [
        {"type": "scatter", "mode": "lines+markers", "name": "mean exit depth",
         "x": [m.minute.isoformat() for m in with_tokens],
         "y": [round(m.mean_depth, 3) for m in with_tokens],
         "line": {"color": PALETTE[0], "width": 2}, "marker": {"size": 4}},
        {"type": "scatter", "mode": "lines", "name": "estimated speed-up", "yaxis": "y2",
         "x": [m.minute.isoformat() for m in with_tokens],
         "y": [round(deployment.num_layers / m.mean_depth, 3) for m in with_tokens],
         "line": {"color": PALETTE[1], "width": 2, "dash": "dot"},
         "hovertemplate": "%{y:.2f}×"},
    ], "layout": _with_markers(_layout(
        "Mean exit depth and estimated speed-up", "layers run", xaxis=x_axis,
        yaxis={"title": {"text": "layers run"}, "range": [0, deployment.num_layers + 0.5],
               "gridcolor": "#e6e8eb"},
        yaxis2={"title": {"text": "speed-up (layers)"}, "overlaying": "y", "side": "right",
                "rangemode": "tozero", "showgrid": False, "ticksuffix": "×"},
        margin={"l": 56, "r": 56, "t": 40, "b": 40}), markers)}

    total = sum(exits_by_layer.values())
    histogram = {"data": [{
        "type": "bar", "name": "tokens",
        "x": [f"L{layer}" if layer < deployment.num_layers else f"full ({layer})"
              for layer in layers],
        "y": [exits_by_layer[layer] for layer in layers],
        "text": [f"{exits_by_layer[layer] / total:.0%}" if total else "" for layer in layers],
        "textposition": "outside", "cliponaxis": False,
        "marker": {"color": [colour[layer] for layer in layers]},
        "hovertemplate": "%{x}: %{y} tokens<extra></extra>",
    }], "layout": _layout("Where tokens exit", "tokens", hovermode="closest",
                          xaxis={"type": "category", "title": {"text": "exit layer"}},
                          showlegend=False)}

    hist = telemetry.signal_histogram(session=session, deployment=deployment, since=since,
                                      segment=segment)
    centers = [(i + 0.5) / HISTOGRAM_BINS for i in range(HISTOGRAM_BINS)]
    signal_traces = []
    for layer, counts in hist.items():
        n = sum(counts)
        if not n:
            continue
        name = f"layer {layer}" if layer < deployment.num_layers else "full depth"
        signal_traces.append({
            "type": "scatter", "mode": "lines", "name": name, "x": centers,
            "y": [c / n for c in counts], "line": {"shape": "hvh", "width": 2,
                                                   "color": colour.get(layer, "#57606a")},
            "hovertemplate": "%{y:.1%}"})
    signal = {"data": signal_traces, "layout": _layout(
        f"Signal at exit ({deployment.signal})", "share of the layer's tokens",
        hovermode="closest", xaxis={"range": [0, 1], "title": {"text": "signal value"},
                                    "gridcolor": "#e6e8eb"},
        legend={"orientation": "h", "y": -0.3, "x": 0},
        margin={"l": 56, "r": 16, "t": 40, "b": 64},
        yaxis={"title": {"text": "share"}, "tickformat": ".0%", "rangemode": "tozero",
               "gridcolor": "#e6e8eb"})}

    figures = {"exit_rate": exit_rate, "disagreement": disagreement, "depth": depth,
               "histogram": histogram, "signal": signal}
    per_segment = segment_figures(session=session, deployment=deployment, since=since,
                                  markers=markers)
    if per_segment is not None:
        figures.update(per_segment["figures"])
    return {"figures": figures, "totals": totals(deployment, summary),
            "segments": per_segment["totals"] if per_segment else [],
            "updated": utcnow().isoformat(timespec="seconds")}


def segment_figures(*, session: Session, deployment: Deployment, since: datetime,
                    markers: list[Marker]) -> dict | None:
    """Early-exit rate and shadow disagreement over time, one line per traffic segment, and
    each segment's window totals; None for a deployment that knows no segment."""
    by_segment = reads.segment_minutes(session=session, deployment=deployment, since=since)
    if len(by_segment) < 2:  # only `default`: the deployment-wide charts say it all
        return None
    x_axis = {"type": "date", "range": _x_range(since), "gridcolor": "#e6e8eb"}
    colour = {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(by_segment)}
    rates, quality = [], []
    for name, minutes in by_segment.items():
        with_tokens = [(minute, f) for minute, f in minutes if f.tokens]
        rates.append({
            "type": "scatter", "mode": "lines+markers", "name": name,
            "x": [minute.isoformat() for minute, _ in with_tokens],
            "y": [f.exit_rate for _, f in with_tokens],
            "customdata": [[f.early_exits, f.tokens] for _, f in with_tokens],
            "hovertemplate": "%{y:.1%} (%{customdata[0]} of %{customdata[1]})",
            "line": {"color": colour[name], "width": 2}, "marker": {"size": 4}})
        with_shadow = [(minute, f) for minute, f in minutes if f.shadow_tokens]
        quality.append({
            "type": "scatter", "mode": "lines+markers", "name": name,
            "x": [minute.isoformat() for minute, _ in with_shadow],
            "y": [f.disagreement for _, f in with_shadow],
            "customdata": [[f.policy_mismatches, f.shadow_tokens] for _, f in with_shadow],
            "hovertemplate": "%{y:.2%} (%{customdata[0]} of %{customdata[1]})",
            "line": {"color": colour[name], "width": 2}, "marker": {"size": 4}})
    delta = deployment.delta
    quality.append({"type": "scatter", "mode": "lines", "name": f"δ = {delta:g}",
                    "x": _x_range(since), "y": [delta, delta], "hoverinfo": "skip",
                    "line": {"color": DANGER, "width": 2, "dash": "dash"}})
    exit_rate = {"data": rates, "layout": _with_markers(_layout(
        "Early-exit rate by segment", "tokens leaving before full depth", xaxis=x_axis,
        yaxis={"title": {"text": "early-exit rate"}, "tickformat": ".0%",
               "rangemode": "tozero", "gridcolor": "#e6e8eb"}), markers)}
    disagreement = {"data": quality, "layout": _with_markers(_layout(
        "Shadow disagreement by segment vs δ", "disagreement", xaxis=x_axis,
        yaxis={"title": {"text": "disagreement"}, "tickformat": ".1%", "rangemode": "tozero",
               "gridcolor": "#e6e8eb"}), markers)}
    return {"figures": {"segment_exit_rate": exit_rate, "segment_disagreement": disagreement},
            "totals": [segment_totals(name, [f for _, f in minutes])
                       for name, minutes in by_segment.items()]}


def segment_totals(name: str, minutes: list[reads.SegmentFigures]) -> dict:
    """One segment's window totals for the deployment page's segment table."""
    window = reads.RollupFigures.total(minutes)
    return {"segment": name, "tokens": window.tokens, "shadow_tokens": window.shadow_tokens,
            "exit_rate": window.exit_rate, "disagreement": window.disagreement}


def sparkline(values: list[float | None], *, label: str, ceiling: float | None = None,
              limit: float | None = None, width: int = 132, height: int = 32) -> Markup:
    """A small inline SVG line of `values` (gaps for None), with an optional limit line."""
    points = [(i, v) for i, v in enumerate(values) if v is not None]
    top = max([ceiling or 0.0, *(v for _, v in points), limit or 0.0]) or 1.0
    span = max(len(values) - 1, 1)

    def xy(i: int, v: float) -> str:
        return f"{i / span * (width - 2) + 1:.1f},{height - 2 - v / top * (height - 4):.1f}"

    segments, current = [], []
    for i, v in enumerate(values):
        if v is None:
            if current:
                segments.append(current)
            current = []
        else:
            current.append(xy(i, v))
    if current:
        segments.append(current)
    paths = "".join(
        f'<polyline points="{" ".join(seg)}" fill="none" stroke="#0b5cad" stroke-width="1.6"'
        f' stroke-linejoin="round"/>' if len(seg) > 1 else
        f'<circle cx="{seg[0].split(",")[0]}" cy="{seg[0].split(",")[1]}" r="1.6" '
        f'fill="#0b5cad"/>' for seg in segments)
    if limit is not None:
        y = height - 2 - limit / top * (height - 4)
        paths += (f'<line x1="0" x2="{width}" y1="{y:.1f}" y2="{y:.1f}" stroke="{DANGER}" '
                  f'stroke-width="1" stroke-dasharray="3 2"/>')
    if not points:
        paths = (f'<text x="{width / 2}" y="{height / 2 + 4}" text-anchor="middle" '
                 f'font-size="11" fill="#57606a">no data</text>')
    return Markup(f'<svg class="spark" role="img" aria-label="{escape(label)}" '
                  f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
                  f'preserveAspectRatio="none">'
                  f'<title>{escape(label)}</title>{paths}</svg>')


def minute_series(summary: list[MinuteSummary], since: datetime, minutes: int,
                  attribute: str) -> list[float | None]:
    """One value per minute of the window (None where no telemetry arrived)."""
    by_minute = {m.minute: getattr(m, attribute) for m in summary}
    return [by_minute.get(since + timedelta(minutes=i)) for i in range(minutes)]


def calibration_curve(*, job, delta: float) -> dict | None:
    """The quality-vs-expected-speed curve a calibration job walked, the chosen point marked."""
    points = job.curve or []
    if not points:
        return None
    certified = [p for p in points if p.get("certified")]
    refused = [p for p in points if not p.get("certified")]
    chosen = [p for p in points if p.get("chosen")]

    def trace(subset: list[dict], name: str, **style) -> dict:
        return {"type": "scatter", "name": name,
                "x": [p.get("speedup") for p in subset],
                "y": [p.get("risk_bound") for p in subset],
                "customdata": [[p.get("risk"), p.get("exit_rate"), p.get("level")]
                               for p in subset],
                "hovertemplate": "speed-up %{x:.2f}×<br>bound %{y:.2%}<br>"
                                 "empirical %{customdata[0]:.2%}<br>"
                                 "exit rate %{customdata[1]:.1%}<extra>" + name + "</extra>",
                **style}

    data = [
        {"type": "scatter", "mode": "lines", "name": "threshold path", "hoverinfo": "skip",
         "x": [p.get("speedup") for p in points], "y": [p.get("risk_bound") for p in points],
         "line": {"color": "#8c959f", "width": 1}},
        trace(certified, "certified", mode="markers",
              marker={"color": PALETTE[2], "size": 7}),
        trace(refused, "not certified", mode="markers",
              marker={"color": PALETTE[1], "size": 7, "symbol": "x"}),
        trace(chosen, "chosen", mode="markers+text", text=["chosen"] * len(chosen),
              textposition="top center",
              marker={"color": PALETTE[0], "size": 16, "symbol": "star",
                      "line": {"color": "#1f2328", "width": 1}}),
    ]
    speedups = [p.get("speedup") or 1.0 for p in points]
    data.append({"type": "scatter", "mode": "lines", "name": f"δ = {delta:g}",
                 "x": [min(speedups), max(speedups)], "y": [delta, delta], "hoverinfo": "skip",
                 "line": {"color": DANGER, "dash": "dash", "width": 2}})
    return {"data": data, "layout": _layout(
        "Quality vs expected speed-up", "disagreement bound", hovermode="closest",
        xaxis={"title": {"text": "expected speed-up (layers)"}, "ticksuffix": "×",
               "gridcolor": "#e6e8eb"},
        yaxis={"title": {"text": "upper bound on disagreement"}, "tickformat": ".1%",
               "rangemode": "tozero", "gridcolor": "#e6e8eb"},
        legend={"orientation": "h", "y": -0.3, "x": 0},
        margin={"l": 64, "r": 16, "t": 40, "b": 64}, height=340)}
