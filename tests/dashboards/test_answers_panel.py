"""The answers panel on a deployment's page, server-rendered: the share of shadow requests whose
whole answer under the active set equals the full-depth one, its lower bound at 1-ε against
1-δ_answer, the token disagreement of the same requests beside it, and a histogram of where
the differing answers first diverged; a deployment without shadow requests says so."""

from __future__ import annotations

import re
from datetime import timedelta

import numpy as np
from scipy.stats import beta
from sqlalchemy.orm import Session

from controlplane.db import utcnow
from controlplane.telemetry.service import ingest
from exitplane.wire import TelemetryBatch
from tests.support.alerts import FULL, LAYERS, make_deployment
from tests.support.batches import telemetry_batch
from tests.support.shadow_requests import shadow_request_records

TOKENS = 12


def _requests(diverge_at: list[int | None], start: float) -> list[dict]:
    """One 12-token request per entry: None keeps the full-depth answer; a position p makes
    token p exit at layer 4 (0.95 > 0.9) with a prediction that does not match."""
    records = []
    for i, position in enumerate(diverge_at):
        signals = np.full((TOKENS, len(LAYERS)), 0.5, dtype=np.float32)
        matched = np.ones(signals.shape, dtype=bool)
        if position is not None:
            signals[position, 0], matched[position, 0] = 0.95, False
        records += shadow_request_records(signals, matched, request_id=f"q{i}",
                                          start=start + i, version=2, layers=LAYERS,
                                          num_layers=FULL)
    return records


def _value(page: str, key: str) -> str:
    return re.search(rf'data-answers="{key}">([^<]+)<', page).group(1)


def test_the_deployment_page_shows_answers_against_full_depth(as_role, engine):
    # 20 requests: 16 identical; 4 differ, first at positions 0, 1, 5 and 5
    outcomes = [None] * 16 + [0, 1, 5, 5]
    with Session(engine) as session:
        deployment = make_deployment(session, "chat")
        deployment.delta_answer = 0.1
        ingest(session=session, deployment=deployment, batches=[TelemetryBatch.model_validate(
            telemetry_batch(_requests(outcomes, (utcnow() - timedelta(minutes=5)).timestamp()),
                            deployment="chat", runtime_id="rt-1", num_layers=FULL))])
        make_deployment(session, "quiet")
        session.commit()
    viewer = as_role("viewer")
    page = viewer.get("/ui/deployments/chat").text
    assert 'id="answers"' in page and "δ_answer = 0.1" in page
    assert _value(page, "identical") == "80.0%"
    # one-sided Clopper-Pearson at 1-ε (ε = 0.05 by default) on 4 of 20
    bound = 1 - beta.ppf(0.95, 5, 16)
    assert _value(page, "bound") == f"{bound:.1%}"
    assert "16 of 20 requests" in page
    # the same requests' 240 tokens: 4 exit wrongly
    assert _value(page, "token_disagreement") == f"{4 / 240:.2%}"
    # the bar, its whisker and the target line carry their values
    assert 'data-share="0.800000"' in page and 'data-target="0.900000"' in page
    # the histogram: one request in bin 0, one in bin 1, two in 4-7
    bins = dict(re.findall(r'data-from="(\d+)" data-requests="(\d+)"', page))
    assert (bins["0"], bins["1"], bins["2"], bins["4"]) == ("1", "1", "0", "2")
    assert sum(map(int, bins.values())) == 4
    assert _value(page, "median_divergence") == "3"  # median of 0, 1, 5, 5
    # the bound (~63%) is below the target 90%: the share is marked
    assert re.search(r'stat-value text-bad" data-answers="identical"', page)

    quiet = viewer.get("/ui/deployments/quiet").text
    assert 'id="answers-none"' in quiet and "shadow_request_rate" in quiet
    assert "sets no answer target" in quiet
