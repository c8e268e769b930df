"""The deployment page's operating curve: the stored frontier with its band, the marked sets,
the best certified set and what is left on the table; and, before the workers drew one, when
the next is due."""

from __future__ import annotations

import re

from sqlalchemy.orm import Session

from controlplane.deployments import service as thresholds
from controlplane.flows.operating_curve import draw_curve, latest_curve
from dashboards.curve_panel import panel_from_curve


def _draw(engine, settings) -> dict:
    """The curve the workers would store now for the seeded deployment's default segment."""
    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name="chat")
        draw_curve(session=session, deployment=deployment, settings=settings)
        session.commit()
        return latest_curve(session, deployment)


def _marks(html: str) -> dict[str, tuple[float, float]]:
    return {name: (float(x), float(y)) for name, x, y in re.findall(
        r'<g class="curve-mark" data-mark="(\w+)" data-speedup="([\d.]+)" '
        r'data-disagreement="([\d.]+)"', html)}


def test_without_a_curve_the_page_says_when_one_is_due(as_role, seeded):
    page = as_role("viewer").get("/ui/deployments/chat").text
    assert "No operating curve is stored yet" in page
    assert "every 5 minutes" in page  # operating_curve_interval_s: 300
    assert '<svg class="curve"' not in page


def test_a_curve_short_of_evidence_says_why(as_role, engine, settings, seeded):
    stored = _draw(engine, settings)  # three minutes of seeded traffic: too few shadow tokens
    assert stored["points"] == []
    page = as_role("viewer").get("/ui/deployments/chat").text
    assert "No operating curve could be drawn" in page
    assert "not enough shadow samples" in page and "The next computation is due" in page


def test_the_stored_curve_is_drawn_with_its_marks_and_gap(as_role, engine, settings,
                                                         calibrated):
    stored = _draw(engine, settings)
    assert stored["points"] and stored["best"] and stored["gap"]
    page = as_role("viewer").get("/ui/deployments/chat").text
    drawn = _marks(page)
    # Every set the curve marks, and the best certified one, at its stored coordinates.
    for name, figures in {**stored["marks"], "best": stored["best"]}.items():
        assert drawn[name] == (round(figures["speedup"], 4),
                               round(figures["disagreement"], 6)), name
    assert {"active", "conservative", "best"} <= set(drawn)
    assert 'class="curve-band"' in page and 'class="curve-frontier"' in page
    assert 'class="curve-delta"' in page
    assert len(re.findall(r'<tr data-mark="', page)) == len(drawn)
    # The active v3 exits far less than the best set certified at δ on this traffic.
    gap = stored["gap"]["net_saving"]
    assert gap > 0.1
    assert f'<span data-gap="net_saving">{gap * 100:.1f}%</span>' in page
    assert '<g class="curve-gap">' in page


def test_the_gap_is_said_in_words_and_drawn_as_an_arrow():
    """A stored curve whose best set saves more than the active one: the panel says how much
    and draws an arrow from the active set to it."""
    point = {"disagreement": 0.01, "disagreement_bound": 0.02, "exit_rate": 0.2,
             "net_saving": 0.1}
    curve = {"computed_at": "2026-01-01T00:00:00+00:00", "evidence": {"delta": 0.05},
             "points": [{**point, "speedup": 1.0 + i / 10} for i in range(5)],
             "marks": {"active": {**point, "speedup": 1.1, "version": 3},
                       "conservative": {**point, "speedup": 1.0, "version": 1}},
             "best": {**point, "speedup": 1.4, "net_saving": 0.3},
             "gap": {"net_saving": 0.2, "speedup": 0.3}}
    panel = panel_from_curve(curve, delta=0.05, interval_s=300)
    assert [r["name"] for r in panel.rows] == ["active", "conservative", "best"]
    assert panel.next_due.isoformat() == "2026-01-01T00:05:00+00:00"
    assert '<g class="curve-gap">' in str(panel.chart)
    active, best = _marks(str(panel.chart))["active"], _marks(str(panel.chart))["best"]
    assert best[0] > active[0]
    curve["gap"] = {"net_saving": -0.05, "speedup": -0.1}
    curve["best"] = {**point, "speedup": 1.05}
    assert '<g class="curve-gap">' not in str(panel_from_curve(curve, delta=0.05).chart)
