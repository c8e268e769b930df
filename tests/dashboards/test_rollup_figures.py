"""One reading of the rollups: the deployment page's minutes and totals, its
segment table and the read API's per-segment figures are all `reads.RollupFigures`, so over
one window they agree exactly, and the page's per-minute disagreement is the disagreement
endpoint's."""

from __future__ import annotations

from datetime import timedelta

import pytest

from controlplane.db import utcnow
from controlplane.deployments.segments import declare_segment
from controlplane.telemetry import reads
from controlplane.telemetry import service as telemetry
from dashboards import charts
from tests.support.alerts import Phase, make_deployment, send_traffic

SEGMENTS = ("default", "chat", "code")


@pytest.fixture
def traffic(session):
    """Deployment 'mix': 20 minutes of three segments' traffic through the real ingestion,
    exit rates and disagreement changing halfway."""
    deployment = make_deployment(session, name="mix")
    for segment in SEGMENTS[1:]:  # telemetry stores undeclared segment names as `default`
        declare_segment(session=session, deployment=deployment, name=segment, actor="test")
    start = utcnow().replace(second=0, microsecond=0) - timedelta(minutes=25)
    for seed, segment in enumerate(SEGMENTS):
        send_traffic(session, deployment, start=start, seed=seed, runtime_id=f"rt-{segment}",
                     segment=segment, tokens_per_minute=120,
                     phases=[Phase(10, (0.3, 0.4, 0.2), shadow_rate=0.2, mismatch_rate=0.05),
                             Phase(10, (0.1, 0.2, 0.5), shadow_rate=0.3,
                                   mismatch_rate=0.1 * (seed + 1))])
    session.commit()
    return deployment, charts.since_for(60)


def test_page_totals_segment_table_and_read_api_agree(session, traffic):
    deployment, since = traffic
    minutes = charts.per_minute(session=session, deployment=deployment, since=since)
    by_segment = reads.segment_summary(session=session, deployment=deployment, since=since)
    assert [f.segment for f in by_segment] == list(SEGMENTS)
    assert all(f.tokens == 20 * 120 and f.shadow_tokens for f in by_segment)

    page = charts.totals(deployment, minutes)
    api = reads.RollupFigures.total(by_segment)
    assert page["tokens"] == api.tokens == 3 * 20 * 120
    assert (page["early_exit_rate"], page["disagreement"], page["mean_depth"],
            page["shadow_tokens"]) == (api.exit_rate, api.disagreement, api.mean_depth,
                                       api.shadow_tokens)
    assert api.disagreement > deployment.delta  # code's second half breaks δ

    table = charts.segment_figures(session=session, deployment=deployment, since=since,
                                   markers=[])["totals"]
    assert table == [{"segment": f.segment, "tokens": f.tokens,
                      "shadow_tokens": f.shadow_tokens, "exit_rate": f.exit_rate,
                      "disagreement": f.disagreement} for f in by_segment]
    # one segment's page equals its row of the read API
    code = charts.totals(deployment, charts.per_minute(session=session, deployment=deployment,
                                                       since=since, segment="code"))
    assert (code["tokens"], code["early_exit_rate"], code["disagreement"]) == (
        by_segment[2].tokens, by_segment[2].exit_rate, by_segment[2].disagreement)


def test_page_minutes_carry_the_disagreement_endpoint_s_figures(session, traffic):
    deployment, since = traffic
    for segment in (None, "code"):
        minutes = charts.per_minute(session=session, deployment=deployment, since=since,
                                    segment=segment)
        endpoint = telemetry.disagreement(session=session, deployment=deployment, since=since,
                                          segment=segment)
        assert len(minutes) == len(endpoint) == 20
        assert [(m.minute, m.shadow_tokens, m.policy_mismatches, m.disagreement)
                for m in minutes] == [(row["minute"], row["shadow_tokens"], row["mismatches"],
                                       row["disagreement"]) for row in endpoint]
    # per layer, a window's figures are the sum of its minutes'
    window = reads.RollupFigures.total(minutes)
    assert window.layers[4]["tokens"] == sum(m.layers[4]["tokens"] for m in minutes) == 20 * 120
