"""The operating curve as a server-rendered SVG: quality (shadow disagreement) against the
predicted speed-up, the frontier's confidence band, δ, the marked threshold sets, the gap to
the best certified set and, on the what-if page, the evaluated set.

It draws what it is given (the stored curve, a what-if result): no evaluation happens here.
Coordinates are plain numbers in the markup (`data-speedup`, `data-disagreement`, `cx`, `cy`)
so a page, a test or a screen reader can read them back.
"""

from __future__ import annotations

from dataclasses import dataclass

from markupsafe import Markup, escape

from dashboards.charts import DANGER, PALETTE

WIDTH, HEIGHT = 640, 320
LEFT, RIGHT, TOP, BOTTOM = 60, 20, 30, 46
BAND = "#cfe3f5"
FRONTIER = PALETTE[0]
MUTED = "#57606a"
# How each marked set is drawn: colour, shape and the label beside it.
MARK_STYLE = {
    "active": (PALETTE[0], "circle", "active"),
    "canary": (PALETTE[3], "circle", "canary"),
    "conservative": (MUTED, "square", "conservative"),
    "last_good": (PALETTE[2], "square", "last good"),
    "best": (PALETTE[2], "diamond", "best at δ"),
}
WHAT_IF = PALETTE[1]
LEGEND_ORDER = ("conservative", "last_good", "canary", "active", "best")


@dataclass(frozen=True)
class Point:
    """One threshold set on the curve: its predicted speed-up, its shadow disagreement and
    the upper (and, when known, lower) confidence bound on that disagreement."""

    speedup: float
    disagreement: float
    upper: float | None = None
    lower: float | None = None
    label: str = ""


@dataclass(frozen=True)
class Scale:
    x0: float
    x1: float
    y1: float

    def x(self, speedup: float) -> float:
        span = (self.x1 - self.x0) or 1.0
        return LEFT + (speedup - self.x0) / span * (WIDTH - LEFT - RIGHT)

    def y(self, disagreement: float) -> float:
        return HEIGHT - BOTTOM - disagreement / (self.y1 or 1.0) * (HEIGHT - TOP - BOTTOM)


def _scale(frontier: list[Point], points: list[Point], delta: float) -> Scale:
    """Axes that hold every marked point and δ with room above; the frontier beyond that
    height (sets far past δ) is clipped rather than squeezing the region that matters."""
    ys = [max(p.disagreement, p.upper or 0.0) for p in points]
    y1 = max([2.0 * delta, *ys]) * 1.15 or 0.1
    xs = [p.speedup for p in points]
    xs += [p.speedup for p in frontier if p.disagreement <= y1] or [1.0]
    low, high = min(1.0, min(xs)), max(xs)
    pad = max((high - low) * 0.08, 0.05)
    return Scale(x0=low, x1=high + pad, y1=y1)


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    step = (high - low) / count if high > low else 1.0
    for nice in (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.25, 0.5, 1.0, 2.0, 5.0):
        if nice >= step:
            step = nice
            break
    first = int(low / step + 0.999999) * step
    ticks, value = [], first
    while value <= high + 1e-9:
        ticks.append(round(value, 6))
        value += step
    return ticks


def _axes(scale: Scale) -> str:
    parts = []
    base = HEIGHT - BOTTOM
    for tick in _ticks(scale.x0, scale.x1):
        x = scale.x(tick)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{base}" '
                     f'stroke="#e6e8eb"/><text x="{x:.1f}" y="{base + 16}" '
                     f'text-anchor="middle" font-size="11" fill="{MUTED}">{tick:g}×</text>')
    for tick in _ticks(0.0, scale.y1):
        y = scale.y(tick)
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" '
                     f'stroke="#e6e8eb"/><text x="{LEFT - 6}" y="{y + 4:.1f}" '
                     f'text-anchor="end" font-size="11" fill="{MUTED}">{tick * 100:g}%</text>')
    parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{base}" y2="{base}" '
                 f'stroke="{MUTED}"/><line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{base}" '
                 f'stroke="{MUTED}"/>')
    parts.append(f'<text x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 8}" '
                 f'text-anchor="middle" font-size="12" fill="#1f2328">predicted speed-up '
                 f'(against full depth)</text>')
    parts.append(f'<text transform="translate(14 {(TOP + HEIGHT - BOTTOM) / 2}) rotate(-90)" '
                 f'text-anchor="middle" font-size="12" fill="#1f2328">shadow disagreement'
                 f'</text>')
    return "".join(parts)


def _band(scale: Scale, frontier: list[Point]) -> str:
    """The frontier's confidence band (lower to upper bound; the estimate when no lower bound
    is known) and the estimate as a line."""
    if not frontier:
        return ""
    ordered = sorted(frontier, key=lambda p: p.speedup)
    parts = []
    with_upper = [p for p in ordered if p.upper is not None]
    if with_upper:
        top = [f"{scale.x(p.speedup):.1f},{scale.y(p.upper):.1f}" for p in with_upper]
        bottom = [f"{scale.x(p.speedup):.1f},"
                  f"{scale.y(p.lower if p.lower is not None else p.disagreement):.1f}"
                  for p in reversed(with_upper)]
        parts.append(f'<polygon class="curve-band" points="{" ".join(top + bottom)}" '
                     f'fill="{BAND}" stroke="none"/>')
    line = " ".join(f"{scale.x(p.speedup):.1f},{scale.y(p.disagreement):.1f}" for p in ordered)
    parts.append(f'<polyline class="curve-frontier" points="{line}" fill="none" '
                 f'stroke="{FRONTIER}" stroke-width="2" stroke-linejoin="round"/>')
    return "".join(parts)


def _delta(scale: Scale, delta: float) -> str:
    y = scale.y(delta)
    return (f'<line class="curve-delta" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" '
            f'y2="{y:.1f}" stroke="{DANGER}" stroke-width="1.5" stroke-dasharray="6 4"/>'
            f'<text x="{WIDTH - RIGHT - 4}" y="{y - 5:.1f}" text-anchor="end" font-size="11" '
            f'fill="{DANGER}">δ {delta * 100:g}%</text>')


def _shape(kind: str, x: float, y: float, colour: str, size: float = 6.0) -> str:
    if kind == "square":
        return (f'<rect x="{x - size:.1f}" y="{y - size:.1f}" width="{2 * size:.1f}" '
                f'height="{2 * size:.1f}" fill="{colour}" stroke="#fff" stroke-width="1.5"/>')
    if kind == "diamond":
        s = size * 1.4
        return (f'<polygon points="{x:.1f},{y - s:.1f} {x + s:.1f},{y:.1f} {x:.1f},{y + s:.1f} '
                f'{x - s:.1f},{y:.1f}" fill="{colour}" stroke="#1f2328" stroke-width="1"/>')
    return (f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{size:.1f}" fill="{colour}" stroke="#fff" '
            f'stroke-width="1.5"/>')


def _mark(scale: Scale, name: str, point: Point) -> str:
    colour, kind, words = MARK_STYLE.get(name, (MUTED, "circle", name))
    x, y = scale.x(point.speedup), scale.y(point.disagreement)
    label = escape(f"{words}{' ' + point.label if point.label else ''}")
    whisker = ""
    if point.upper is not None:
        whisker = (f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y:.1f}" y2="{scale.y(point.upper):.1f}"'
                   f' stroke="{colour}" stroke-width="1.5"/>')
    return (f'<g class="curve-mark" data-mark="{escape(name)}" '
            f'data-speedup="{point.speedup:.4f}" data-disagreement="{point.disagreement:.6f}">'
            f'<title>{label}: {point.speedup:.2f}×, disagreement {point.disagreement:.2%}'
            f'{"" if point.upper is None else f" (bound {point.upper:.2%})"}</title>'
            f'{whisker}{_shape(kind, x, y, colour)}</g>')


def _gap(scale: Scale, active: Point, best: Point) -> str:
    """An arrow from the active set to the best certified one: what is left on the table."""
    if best.speedup <= active.speedup:
        return ""
    x0, y0 = scale.x(active.speedup), scale.y(active.disagreement)
    x1, y1 = scale.x(best.speedup), scale.y(best.disagreement)
    return (f'<g class="curve-gap"><line x1="{x0:.1f}" y1="{y0:.1f}" x2="{x1:.1f}" '
            f'y2="{y1:.1f}" stroke="{PALETTE[2]}" stroke-width="2" stroke-dasharray="4 3" '
            f'marker-end="url(#curve-arrow)"/></g>')


def _what_if(scale: Scale, point: Point, base: Point | None) -> str:
    x, y = scale.x(point.speedup), scale.y(point.disagreement)
    move = ""
    if base is not None:
        move = (f'<line x1="{scale.x(base.speedup):.1f}" y1="{scale.y(base.disagreement):.1f}" '
                f'x2="{x:.1f}" y2="{y:.1f}" stroke="{WHAT_IF}" stroke-width="1.5" '
                f'stroke-dasharray="2 3"/>')
    whisker = ""
    if point.upper is not None:
        whisker = (f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y:.1f}" y2="{scale.y(point.upper):.1f}"'
                   f' stroke="{WHAT_IF}" stroke-width="2"/>')
    return (f'<g id="what-if-point" class="curve-mark" data-mark="what_if" '
            f'data-speedup="{point.speedup:.4f}" data-disagreement="{point.disagreement:.6f}">'
            f'<title>what-if: {point.speedup:.2f}×, disagreement {point.disagreement:.2%}'
            f'{"" if point.upper is None else f" (bound {point.upper:.2%})"}</title>'
            f'{move}{whisker}<circle cx="{x:.1f}" cy="{y:.1f}" r="8" fill="none" '
            f'stroke="{WHAT_IF}" stroke-width="3"/></g>')


def _legend(marks: dict[str, Point], with_what_if: bool) -> str:
    """One row above the plot naming each marked set (its shape, colour and version)."""
    items = []
    for name in [*LEGEND_ORDER, *(n for n in marks if n not in LEGEND_ORDER)]:
        if name not in marks:
            continue
        colour, kind, words = MARK_STYLE.get(name, (MUTED, "circle", name))
        label = words + (f" {marks[name].label}" if marks[name].label else "")
        items.append((_shape(kind, 0, 0, colour, size=5), label))
    if with_what_if:
        items.append((f'<circle cx="0" cy="0" r="5" fill="none" stroke="{WHAT_IF}" '
                      f'stroke-width="2.5"/>', "what-if"))
    parts, x = [], LEFT
    for shape, label in items:
        parts.append(f'<g transform="translate({x + 6} 10)">{shape}<text x="10" y="4" '
                     f'font-size="11" fill="#1f2328">{escape(label)}</text></g>')
        x += 24 + 6.2 * len(label)
    return f'<g class="curve-legend">{"".join(parts)}</g>'


def operating_curve_svg(*, frontier: list[Point], marks: dict[str, Point], delta: float,
                        what_if: Point | None = None, what_if_base: Point | None = None,
                        label: str = "Operating curve") -> Markup:
    """The curve: band and frontier, δ, each marked set (active, canary, conservative,
    last_good, best), an arrow from active to best, and the what-if point when given."""
    placed = [*marks.values(), *([what_if] if what_if else []),
              *([what_if_base] if what_if_base else [])]
    scale = _scale(frontier, placed, delta)
    body = [_axes(scale), f'<g clip-path="url(#curve-plot)">{_band(scale, frontier)}</g>',
            _delta(scale, delta)]
    if "active" in marks and "best" in marks:
        body.append(_gap(scale, marks["active"], marks["best"]))
    named = sorted(marks, key=lambda n: LEGEND_ORDER.index(n) if n in LEGEND_ORDER
                   else len(LEGEND_ORDER))
    body.extend(_mark(scale, name, marks[name]) for name in named)
    if what_if is not None:
        body.append(_what_if(scale, what_if, what_if_base))
    defs = (f'<defs><marker id="curve-arrow" viewBox="0 0 10 10" refX="9" refY="5" '
            f'markerWidth="7" markerHeight="7" orient="auto-start-reverse">'
            f'<path d="M0,0 L10,5 L0,10 z" fill="{PALETTE[2]}"/></marker>'
            f'<clipPath id="curve-plot"><rect x="{LEFT}" y="{TOP}" '
            f'width="{WIDTH - LEFT - RIGHT}" height="{HEIGHT - TOP - BOTTOM}"/></clipPath>'
            f'</defs>')
    return Markup(f'<svg class="curve" role="img" aria-label="{escape(label)}" '
                  f'viewBox="0 0 {WIDTH} {HEIGHT}" width="100%" '
                  f'preserveAspectRatio="xMidYMid meet"><title>{escape(label)}</title>'
                  f'{defs}{"".join(body)}{_legend(marks, what_if is not None)}</svg>')
