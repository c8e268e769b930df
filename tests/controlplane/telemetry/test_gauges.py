"""/metrics per traffic segment: the exit-behaviour gauges carry a `segment`
label. segment="" is the whole deployment (the series exported before segments); a deployment
that knows segments also gets one series per registered segment and `default`, and never one
for a name the registry's cap kept out.

Segmented rollups are written through the ORM: until seg-ingest lands, ingestion stores every
token as 'default'."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from sqlalchemy.orm import Session

from controlplane.db import utcnow
from controlplane.deployments.segments import admit_segments
from controlplane.telemetry.models import Rollup
from tests.support.alerts import FULL, LAYERS, Phase, make_deployment, send_traffic

CAP = 2
SEGMENTED = ("exitplane_exit_rate", "exitplane_tokens_checked", "exitplane_shadow_disagreement",
             "exitplane_shadow_tokens", "exitplane_mean_exit_depth",
             "exitplane_estimated_speedup", "exitplane_shadow_requests",
             "exitplane_answer_identical_share")
SAMPLE = re.compile(r"^(exitplane_[a-z_]+)\{([^}]*)\} (\S+)$")


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every exitplane_ sample with labels."""
    found = []
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
            found.append((match.group(1), labels, float(match.group(3))))
    return found


def value(found, name: str, **labels: str) -> float:
    hits = [v for n, have, v in found if n == name
            and all(have.get(k) == want for k, want in labels.items())]
    assert len(hits) == 1, f"{name}{labels}: {len(hits)} samples"
    return hits[0]


def write(session: Session, deployment_id: int, segment: str, minute,
          by_layer: dict[int, tuple[int, int, int, int]], version: int = 2) -> None:
    """layer -> (tokens, exits, shadow_total, policy_mismatches) under `segment`."""
    for layer, (tokens, exits, shadow, mismatches) in by_layer.items():
        session.add(Rollup(deployment_id=deployment_id, version=version, runtime_id="rt-1",
                           minute=minute, segment=segment, layer=layer, tokens=tokens,
                           exits=exits, shadow_total=shadow, shadow_matches=shadow - mismatches,
                           policy_exits=mismatches, policy_mismatches=mismatches))


CODE = {4: (100, 10, 50, 4), 8: (90, 9, 50, 1), 12: (81, 1, 50, 0), FULL: (80, 80, 50, 0)}
CHAT = {4: (300, 150, 100, 1), 8: (150, 50, 100, 0), 12: (100, 0, 100, 0),
        FULL: (100, 100, 100, 0)}


@pytest.fixture
def mixed(engine) -> None:
    """`mix` knows chat and code (the cap, 2); rows also exist under `spam`, kept out by the cap,
    and under an old version. `plain` knows no segment: all its traffic is in `default`."""
    now = utcnow()
    minute = (now - timedelta(minutes=2)).replace(second=0, microsecond=0)
    with Session(engine) as session:
        mix = make_deployment(session, "mix", delta=0.02)
        assert admit_segments(session=session, deployment_id=mix.id, limit=CAP, auto=True,
                              names=["chat", "code", "spam"])["spam"] == "default"
        write(session, mix.id, "code", minute, CODE)
        write(session, mix.id, "chat", minute, CHAT)
        write(session, mix.id, "default", minute, CODE)
        write(session, mix.id, "spam", minute, CODE)  # stored before the cap, say
        write(session, mix.id, "chat", minute, CHAT, version=1)  # not the active version
        plain = make_deployment(session, "plain", delta=0.02)
        send_traffic(session, plain, start=now - timedelta(minutes=3), seed=3,
                     phases=[Phase(3, (0.25, 0.4, 0.3), shadow_rate=0.2, mismatch_rate=0.1)])
        session.commit()


def test_gauges_carry_a_bounded_segment_label(client, mixed):
    found = samples(client.get("/metrics").text)
    mix = [(n, labels) for n, labels, _ in found if labels.get("deployment") == "mix"]
    assert {labels.get("segment") for n, labels in mix if n in SEGMENTED} == {
        "", "default", "chat", "code"}  # at most the cap + default + the whole deployment
    assert not any("spam" in labels.values() for _, labels in mix)

    assert value(found, "exitplane_tokens_checked", deployment="mix", layer="4",
                 segment="code") == 100
    assert value(found, "exitplane_exit_rate", deployment="mix", layer="4",
                 segment="chat") == pytest.approx(0.5)
    assert value(found, "exitplane_exit_rate", deployment="mix", layer="8",
                 segment="code") == pytest.approx(0.1)
    assert value(found, "exitplane_shadow_tokens", deployment="mix", segment="chat") == 100
    assert value(found, "exitplane_shadow_disagreement", deployment="mix",
                 segment="code") == pytest.approx(5 / 50)
    depth = (10 * 4 + 9 * 8 + 1 * 12 + 80 * FULL) / 100
    assert value(found, "exitplane_mean_exit_depth", deployment="mix",
                 segment="code") == pytest.approx(depth)
    assert value(found, "exitplane_estimated_speedup", deployment="mix",
                 segment="default") == pytest.approx(FULL / depth)

    # The whole deployment sums every row of the active version, spam's included.
    assert value(found, "exitplane_tokens_checked", deployment="mix", layer="4",
                 segment="") == 100 + 300 + 100 + 100
    assert value(found, "exitplane_exit_rate", deployment="mix", layer="4",
                 segment="") == pytest.approx((10 + 150 + 10 + 10) / 600)
    assert value(found, "exitplane_shadow_disagreement", deployment="mix",
                 segment="") == pytest.approx((5 + 1 + 5 + 5) / (50 + 100 + 50 + 50))


def test_an_unsegmented_deployment_exports_the_series_it_did_before(client, mixed):
    found = samples(client.get("/metrics").text)
    plain = [(n, labels) for n, labels, _ in found
             if labels.get("deployment") == "plain" and n in SEGMENTED]
    assert plain and {labels["segment"] for _, labels in plain} == {""}
    # One series per (deployment, layer): the rules' max by still reads one value.
    layers = sorted(labels["layer"] for n, labels in plain if n == "exitplane_tokens_checked")
    assert layers == sorted(str(layer) for layer in LAYERS)
    assert value(found, "exitplane_tokens_checked", deployment="plain", layer="4") == 1500


def test_rules_and_dashboard_pick_the_whole_deployment_or_the_segments():
    """A selector of a segmented gauge without a segment matcher would mix the whole
    deployment's series with its segments' (a max over them pages on a thin segment)."""
    import json
    from pathlib import Path

    from controlplane.telemetry.gauges import _families

    labelled = {family.name for family in _families().values()
                if "segment" in family._labelnames}
    # Open alerts carry their segment too, but a sum over them never double counts: each alert
    # is one series, whatever its segment; only the exit-behaviour gauges repeat the whole.
    assert labelled == {*SEGMENTED, "exitplane_alerts_open"}
    segmented = set(SEGMENTED)
    root = Path(__file__).resolve().parents[3] / "dashboards"
    dashboard = json.loads((root / "grafana" / "exitplane.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"]
             for target in panel.get("targets", [])]
    exprs.append((root / "prometheus" / "alerts.yml").read_text())
    uses = [match for expr in exprs
            for match in re.finditer(r"\b(exitplane_[a-z_]+)(\{[^}]*\})?", expr)
            if match.group(1) in segmented]
    assert len(uses) >= 12
    for use in uses:
        assert use.group(2) and re.search(r'segment(=|!=)""', use.group(2)), use.group(0)


def test_open_alerts_are_counted_per_segment_and_a_default_alert_keeps_its_series(
        client, engine, mixed, outbox):
    from controlplane.alerts import service
    from controlplane.alerts.service import Condition
    from controlplane.deployments.models import Deployment

    with Session(engine) as session:
        mix = session.query(Deployment).filter_by(name="mix").one()
        for segment in ("code", "default"):
            service.fire(session=session, deployment=mix, condition=Condition(
                kind="quality_regression", severity="critical", segment=segment,
                summary=f"disagreement above δ on {segment}"))
        session.commit()
    scrape = client.get("/metrics").text
    found = samples(scrape)
    assert value(found, "exitplane_alerts_open", deployment="mix", kind="quality_regression",
                 severity="critical", segment="code") == 1
    # the default segment's alert is exported without a segment label
    assert ('exitplane_alerts_open{deployment="mix",kind="quality_regression",'
            'segment="",severity="critical"} 1.0') in scrape
