"""The answers panel's context (dashboards/templates/_answers.html): how often whole answers of
the active set equal the full-depth ones, on the page's window of shadow requests.

The window's complete shadow requests of the active version (`telemetry.shadow_requests`,
trust-filtered, each witness cut to its share: `ShadowRequests.capped`), each judged under
its segment's thresholds (`ShadowRequests.divergence_by_segment`); the figures and their
bound at 1-ε are `calibration.answers.consistency`. Beside them, the token disagreement of the
same requests' tokens under the same thresholds. Two server-rendered SVGs: the identical share
with its bound against 1-δ_answer, and where the differing answers first diverged.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import numpy as np
from markupsafe import Markup, escape
from sqlalchemy.orm import Session

from controlplane.calibration.answers import (
    HISTOGRAM_EDGES,
    AnswerConsistency,
    consistency,
)
from controlplane.db import utcnow
from controlplane.deployments.models import Deployment, ThresholdSet
from controlplane.deployments.segment_sets import thresholds_for
from controlplane.settings import Settings
from controlplane.stats.answers import exit_columns
from controlplane.stats.robust_evidence import EvidencePolicy, runtime_count
from controlplane.telemetry.shadow_requests import shadow_request_evidence
from dashboards.charts import DANGER, PALETTE

# The newest shadow requests a page reads (a bounded read whatever the window).
MAX_REQUESTS = 5000
WIDTH, HEIGHT = 480, 200
LEFT, RIGHT, TOP, BOTTOM = 40, 12, 16, 40
MUTED = "#57606a"


@dataclass
class AnswersPanel:
    """What the panel shows; `figures` None without shadow requests in the window."""

    minutes: int
    segment: str | None
    delta_answer: float | None
    shadow_request_rate: float | None
    epsilon: float
    figures: AnswerConsistency | None = None
    token_disagreement: float | None = None
    tokens: int = 0
    share_chart: Markup | None = None
    histogram_chart: Markup | None = None

    @property
    def identical_bound(self) -> float | None:
        """The (1-ε) lower bound on the share of identical answers."""
        return None if self.figures is None else 1.0 - self.figures.differing_bound

    @property
    def within_target(self) -> bool | None:
        """Whether the bound shows answers within δ_answer (None: no target, or no data)."""
        if self.delta_answer is None or self.figures is None:
            return None
        return self.figures.differing_bound <= self.delta_answer


def answers_panel(*, session: Session, deployment: Deployment, threshold_set: ThresholdSet,
                  minutes: int, settings: Settings, segment: str | None = None) -> AnswersPanel:
    """The panel of `threshold_set` (the active version's) over the last `minutes`."""
    panel = AnswersPanel(minutes=minutes, segment=segment,
                         delta_answer=deployment.delta_answer,
                         shadow_request_rate=deployment.shadow_request_rate,
                         epsilon=deployment.epsilon)
    layers = sorted(deployment.exit_layers)
    evidence = shadow_request_evidence(
        session=session, deployment_id=deployment.id, width=len(layers),
        since=utcnow() - timedelta(minutes=minutes), version=threshold_set.version,
        segment=segment, limit=MAX_REQUESTS)
    evidence = evidence.capped(EvidencePolicy.from_settings(settings))
    if not len(evidence):
        return panel
    segments = np.asarray(evidence.segments, dtype=object)
    divergence = np.full(len(evidence), -1, dtype=np.int64)
    wrong = tokens = 0
    for name in sorted(set(evidence.segments)):
        mine = segments == name
        part = evidence.take(mine)
        by_layer = thresholds_for(threshold_set, name)
        row = np.array([[by_layer[k] for k in layers]])
        divergence[mine] = part.divergence(row)[:, 0]
        column = exit_columns(part.signals, row)[0]  # (T,)
        hit = part.matched[np.arange(len(column)), np.maximum(column, 0)]
        wrong += int(((column >= 0) & ~hit).sum())
        tokens += len(column)
    panel.figures = consistency(divergence, epsilon=deployment.epsilon,
                                tokens=np.diff(evidence.offsets),
                                witnesses=runtime_count(evidence.witnesses))
    panel.tokens, panel.token_disagreement = tokens, wrong / tokens if tokens else None
    panel.share_chart = share_svg(panel)
    panel.histogram_chart = divergence_histogram_svg(panel.figures)
    return panel


def share_svg(panel: AnswersPanel) -> Markup:
    """A bar: the share of identical answers, its (1-ε) lower bound as a whisker, and
    1-δ_answer as a dashed line. Values are in `data-*` attributes."""
    figures = panel.figures
    share = figures.identical_share or 0.0
    bound = panel.identical_bound or 0.0
    width, height, left, right = WIDTH, 64, 12, 12
    span = width - left - right

    def x(value: float) -> float:
        return left + value * span

    parts = [f'<rect x="{left}" y="14" width="{span}" height="22" fill="#eef1f4"/>',
             f'<rect class="identical" x="{left}" y="14" width="{x(share) - left:.1f}" '
             f'height="22" fill="{PALETTE[0]}" data-share="{share:.6f}"/>',
             f'<line class="bound" x1="{x(bound):.1f}" x2="{x(bound):.1f}" y1="10" y2="40" '
             f'stroke="{MUTED}" stroke-width="2" data-bound="{bound:.6f}"/>']
    if panel.delta_answer is not None:
        target = 1.0 - panel.delta_answer
        parts.append(f'<line class="target" x1="{x(target):.1f}" x2="{x(target):.1f}" y1="6" '
                     f'y2="44" stroke="{DANGER}" stroke-width="1.5" stroke-dasharray="4 3" '
                     f'data-target="{target:.6f}"/>')
        parts.append(f'<text x="{x(target):.1f}" y="58" text-anchor="middle" font-size="11" '
                     f'fill="{DANGER}">1−δ_answer</text>')
    for tick in (0.0, 0.5, 1.0):
        anchor = {0.0: "start", 0.5: "middle", 1.0: "end"}[tick]
        parts.append(f'<text x="{x(tick):.1f}" y="58" text-anchor="{anchor}" font-size="11" '
                     f'fill="{MUTED}">{tick:.0%}</text>')
    label = (f"{share:.1%} of {figures.requests} answers identical to full depth; "
             f"{1 - panel.epsilon:.0%} lower bound {bound:.1%}")
    return Markup(f'<svg class="answers-share" role="img" aria-label="{escape(label)}" '
                  f'viewBox="0 0 {width} {height}" width="100%" '
                  f'preserveAspectRatio="xMidYMid meet"><title>{escape(label)}</title>'
                  f'{"".join(parts)}</svg>')


def divergence_histogram_svg(figures: AnswerConsistency) -> Markup:
    """Bars: how many differing answers first diverged in each position bin (tokens into the
    answer; bins of `calibration.answers.HISTOGRAM_EDGES`, the last one open)."""
    counts = {int(b["from"]): int(b["requests"]) for b in figures.divergence_histogram}
    bins = [(low, HISTOGRAM_EDGES[i + 1] if i + 1 < len(HISTOGRAM_EDGES) else None)
            for i, low in enumerate(HISTOGRAM_EDGES)]
    # up to the last bin that holds a request, at least 6 bins
    last = max([i for i, (low, _) in enumerate(bins) if counts.get(low)], default=0)
    bins = bins[:max(last + 1, 6)]
    top = max(counts.values(), default=0) or 1
    slot = (WIDTH - LEFT - RIGHT) / len(bins)
    plot = HEIGHT - TOP - BOTTOM
    parts = [f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{HEIGHT - BOTTOM}" '
             f'y2="{HEIGHT - BOTTOM}" stroke="{MUTED}"/>',
             f'<text x="{LEFT - 6}" y="{TOP + 4}" text-anchor="end" font-size="11" '
             f'fill="{MUTED}">{top}</text>',
             f'<text x="{LEFT - 6}" y="{HEIGHT - BOTTOM}" text-anchor="end" font-size="11" '
             f'fill="{MUTED}">0</text>']
    for i, (low, high) in enumerate(bins):
        n = counts.get(low, 0)
        h = n / top * plot
        x = LEFT + i * slot
        name = f"{low}" if high == low + 1 else (f"{low}–{high - 1}" if high else f"{low}+")
        parts.append(f'<rect class="bin" x="{x + 2:.1f}" y="{HEIGHT - BOTTOM - h:.1f}" '
                     f'width="{slot - 4:.1f}" height="{h:.1f}" fill="{PALETTE[1]}" '
                     f'data-from="{low}" data-requests="{n}"><title>position {name}: {n} '
                     f'request{"s" if n != 1 else ""}</title></rect>')
        parts.append(f'<text x="{x + slot / 2:.1f}" y="{HEIGHT - BOTTOM + 14}" '
                     f'text-anchor="middle" font-size="11" fill="{MUTED}">{name}</text>')
    parts.append(f'<text x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 8}" text-anchor="middle" '
                 f'font-size="11" fill="{MUTED}">first differing token (position in the answer)'
                 f'</text>')
    label = (f"First divergence positions of the {figures.differing} answers that differ "
             "from full depth")
    if not figures.differing:
        parts.append(f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle" '
                     f'font-size="12" fill="{MUTED}">no answer differs</text>')
    return Markup(f'<svg class="answers-histogram" role="img" aria-label="{escape(label)}" '
                  f'viewBox="0 0 {WIDTH} {HEIGHT}" width="100%" '
                  f'preserveAspectRatio="xMidYMid meet"><title>{escape(label)}</title>'
                  f'{"".join(parts)}</svg>')
