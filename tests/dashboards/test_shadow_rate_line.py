"""The deployment page says which shadow rate the control plane asks runtimes for, within which
bounds, and why; before any decision, that runtimes apply their own."""

from __future__ import annotations

from sqlalchemy.orm import Session

from controlplane.deployments import service as thresholds
from controlplane.deployments.shadow_rate import ShadowDecision, record


def test_the_page_shows_the_rate_and_its_reason(as_role, engine, seeded):
    viewer = as_role("viewer")
    page = viewer.get("/ui/deployments/chat")
    assert page.status_code == 200
    assert "none decided yet; runtimes apply their own (bounds 1.0%–20.0%)" in page.text
    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name="chat")
        record(session=session, deployment=deployment, decision=ShadowDecision(
            0.034, "the quality drift test needs 2690 shadow tokens per 600 s"))
        session.commit()
    page = viewer.get("/ui/deployments/chat")
    assert 'id="shadow-rate"' in page.text
    assert "runtimes are asked for 3.4% of tokens (bounds 1.0%–20.0%): the quality drift test " \
        "needs 2690 shadow tokens per 600 s" in page.text
