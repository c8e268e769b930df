"""Per-segment traffic and calibration in the admin UI: the deployment page
shows each segment's exit rate, disagreement against δ, shadow tokens and the thresholds the
active version applies to it, with per-segment charts; a calibration job shows what each
segment got.

Segmented rollups are written through the ORM (until seg-ingest lands, ingestion stores every
token as 'default'); the seeded deployment's own traffic is the default segment's."""

from __future__ import annotations

import re

import pytest
from sqlalchemy.orm import Session

from controlplane.calibration.models import CalibrationJob
from controlplane.deployments import service as thresholds
from tests.support.dashboards import FULL, add_segment_traffic

pytestmark = pytest.mark.usefixtures("seeded")

@pytest.fixture
def segment_traffic(engine) -> None:
    add_segment_traffic(engine)


def _cells(page: str, segment: str) -> dict[str, str]:
    row = re.search(rf'<tr data-segment="{segment}">(.*?)</tr>', page, re.S)
    assert row, f"no row for segment {segment}"
    cells = dict(re.findall(r'<td data-segment-stat="(\w+)"[^>]*>([^<]*)</td>', row.group(1)))
    cells["thresholds"] = re.sub(r"<[^>]+>", "", re.search(
        r'<td class="thresholds">(.*?)</td>', row.group(1), re.S).group(1)).strip()
    cells["bad"] = str(bool(re.search(r'data-segment-stat="disagreement"[^>]*class="text-bad"',
                                      row.group(1))))
    return cells


def test_deployment_page_shows_a_row_per_segment(as_role, segment_traffic):
    page = as_role("viewer").get("/ui/deployments/chat?window=15m").text
    section = re.search(r'<section class="panel" aria-labelledby="segments-title".*?</section>',
                        page, re.S)
    assert section, "no segment section"
    rows = re.findall(r'<tr data-segment="([^"]+)">', section.group(0))
    assert rows == ["default", "chat", "code"]

    code = _cells(page, "code")
    assert (code["tokens"], code["exit_rate"], code["shadow_tokens"]) == ("200", "10.0%", "80")
    assert code["disagreement"] == "15.00%" and code["bad"] == "True"  # above δ 0.05
    assert code["thresholds"].split() == ["3:", "never", "6:", "0.970", "9:", "0.950"]

    chat = _cells(page, "chat")
    assert (chat["tokens"], chat["exit_rate"], chat["shadow_tokens"]) == ("400", "60.0%", "100")
    assert chat["disagreement"] == "2.00%" and chat["bad"] == "False"
    assert chat["thresholds"].endswith("(default map)")
    assert chat["thresholds"].split()[:6] == ["3:", "0.900", "6:", "0.850", "9:", "0.700"]

    default = _cells(page, "default")  # the seeded records (ingested as 'default')
    assert int(default["tokens"].replace(",", "")) > 0
    assert "(default map)" not in default["thresholds"]
    assert 'id="chart-segment_exit_rate"' in page and 'id="chart-segment_disagreement"' in page


def test_charts_json_draws_one_line_per_segment(as_role, segment_traffic):
    payload = as_role("viewer").get("/ui/deployments/chat/charts.json?window=15m").json()
    lines = payload["figures"]["segment_exit_rate"]["data"]
    assert [line["name"] for line in lines] == ["default", "chat", "code"]
    code = next(line for line in lines if line["name"] == "code")
    assert code["y"] == [pytest.approx(0.1), pytest.approx(0.1)]  # two minutes, 10% each
    quality = payload["figures"]["segment_disagreement"]["data"]
    assert [line["name"] for line in quality][-1] == "δ = 0.05"
    assert next(q for q in quality if q["name"] == "code")["y"] == [pytest.approx(0.15)] * 2
    totals = {row["segment"]: row for row in payload["segments"]}
    assert totals["chat"]["tokens"] == 400 and totals["chat"]["exit_rate"] == pytest.approx(0.6)
    assert totals["code"]["disagreement"] == pytest.approx(0.15)


def test_a_deployment_without_segments_shows_no_segment_table(as_role):
    viewer = as_role("viewer")
    page = viewer.get("/ui/deployments/chat").text
    assert 'id="segments-title"' not in page and "data-segment=" not in page
    payload = viewer.get("/ui/deployments/chat/charts.json").json()
    assert "segment_exit_rate" not in payload["figures"] and payload["segments"] == []


SEGMENT_RESULTS = {
    "chat": {"outcome": "calibrated", "thresholds": {"3": 0.81, "6": 0.77, "9": 0.6},
             "reason": "own Learn-Then-Test at ε/3 certified 3 layers", "samples": 4210},
    "code": {"outcome": "conservative", "thresholds": {"3": 1.0, "6": 1.0, "9": 1.0},
             "reason": "120 shadow tokens, fewer than 400; the pooled set failed its check "
                       "(p 0.31 > 0.0033)", "samples": 120},
    # The shape `SegmentedCalibration.summary()` writes (seg-loop stores it): source / tokens.
    "tools": {"source": "pooled", "thresholds": {"3": 0.88, "6": 0.8, "9": 0.66},
              "reason": "too few for its own test; the pooled set passed on its check tokens",
              "tokens": 350, "requests": 40, "epsilon": 0.1 / 3, "exit_rate": None},
}
# What seg-loop stores beside them: the rest of `SegmentedCalibration.summary()`.
SEGMENTED = {"delta": 0.05, "epsilon": 0.1, "epsilon_per_segment": 0.1 / 3,
             "default_thresholds": {"3": 0.9, "6": 0.85, "9": 0.7}, "pooled_exit_rate": 0.2,
             "notes": ["default had no samples of its own: it applies the pooled set"]}


@pytest.fixture
def segmented_job(engine, queued_job) -> int:
    """The queued job, finished with per-segment results in its JSON result."""
    with Session(engine) as session:
        job = session.get(CalibrationJob, queued_job)
        job.status = "succeeded"
        job.summary = {"samples": 4680, "segments": SEGMENT_RESULTS, "segmented": SEGMENTED}
        session.commit()
    return queued_job


def test_calibration_job_shows_each_segments_outcome(as_role, segmented_job):
    page = as_role("viewer").get(f"/ui/deployments/chat/calibrations/{segmented_job}").text
    table = re.search(r'<table class="segment-results">.*?</table>', page, re.S)
    assert table, "no per-segment results"
    rows = {name: body for name, body in re.findall(
        r'<tr data-segment="([^"]+)">(.*?)</tr>', table.group(0), re.S)}
    assert list(rows) == ["chat", "code", "tools"]
    outcome = {name: re.search(r'class="outcome outcome-(\w+)">(\w+)<', body).groups()
               for name, body in rows.items()}
    assert outcome == {"chat": ("calibrated", "calibrated"),
                       "code": ("conservative", "conservative"),
                       "tools": ("pooled", "pooled")}
    assert "3: 0.81" in rows["chat"] and "<td>4210</td>" in rows["chat"]
    assert "3: never" in rows["code"] and "<td>120</td>" in rows["code"]
    assert "fewer than 400" in rows["code"]
    assert "<td>350</td>" in rows["tools"]  # `tokens` read as the sample count
    assert "at 0.03333 each (ε/3)" in page  # a job stored before the split was recorded
    assert "<li>default had no samples of its own: it applies the pooled set</li>" in page


def test_a_job_without_segments_shows_no_segment_table(as_role, queued_job):
    page = as_role("viewer").get(f"/ui/deployments/chat/calibrations/{queued_job}").text
    assert "segment-results" not in page


def test_calibration_job_shows_a_real_segmented_calibration(as_role, engine, queued_job):
    """The report `calibrate_segments` writes (what seg-loop stores in the job) renders as
    computed: each segment's outcome, thresholds and sample count."""
    import json

    import numpy as np

    from controlplane.calibration.segments import calibrate_segments

    rng = np.random.default_rng(5)
    n = {"chat": 6000, "code": 300}
    signals = rng.random((sum(n.values()), 3))
    # Confident tokens agree with full depth, the others mostly do not.
    matched = (signals > 0.5) & (rng.random(signals.shape) < 0.995)
    names = np.array(["chat"] * n["chat"] + ["code"] * n["code"])
    result = calibrate_segments(signals=signals, matched=matched, segments=names,
                                exit_layers=[3, 6, 9], num_layers=FULL, delta=0.05,
                                epsilon=0.1, min_samples_per_layer=1000)
    report = json.loads(json.dumps(result.summary()))  # as a JSON column stores it
    with Session(engine) as session:
        job = session.get(CalibrationJob, queued_job)
        job.status = "succeeded"
        job.summary = {"segments": report["segments"],
                       "segmented": {k: v for k, v in report.items() if k != "segments"}}
        session.commit()
    page = as_role("viewer").get(f"/ui/deployments/chat/calibrations/{queued_job}").text
    shown = dict(re.findall(r'<tr data-segment="([^"]+)">.*?class="outcome outcome-(\w+)"',
                            page, re.S))
    expected = {"segment": "calibrated", "pooled": "pooled", "conservative": "conservative"}
    assert shown == {name: expected[seg.source] for name, seg in result.segments.items()}
    assert shown["chat"] == "calibrated"  # 6000 tokens: its own Learn-Then-Test
    chat = re.search(r'<tr data-segment="chat">(.*?)</tr>', page, re.S).group(1)
    assert f"<td>{result.segments['chat'].tokens}</td>" in chat
    assert f"3: {result.segments['chat'].thresholds[3]:.4g}" in chat
    # The level each segment's own test ran at, and how ε was split to get it (Šidák).
    assert result.split == "sidak" and result.epsilon_per_segment > 0.1 / 2
    assert f"at {result.epsilon_per_segment:.4g} each (1−(1−ε)<sup>1/2</sup>, Šidák" in page


def test_the_deployment_charts_show_one_segment_on_request(as_role, segment_traffic):
    viewer = as_role("viewer")
    page = viewer.get("/ui/deployments/chat?window=15m&segment=code").text
    assert re.search(r'data-stat="tokens" data-format="int">200</span> tokens in window · '
                     r'segment code', page)
    assert re.search(r'data-stat="early_exit_rate" data-format="pct">10.0%<', page)
    assert 'charts.json?window=15m&amp;segment=code"' in page
    assert re.search(r'<a href="\?window=15m&amp;segment=code" aria-current="true">code</a>',
                     page)
    payload = viewer.get("/ui/deployments/chat/charts.json?window=15m&segment=code").json()
    assert payload["totals"]["tokens"] == 200
    assert payload["totals"]["disagreement"] == pytest.approx(0.15)
    layer3 = next(t for t in payload["figures"]["exit_rate"]["data"] if t["name"] == "layer 3")
    assert layer3["y"] == [pytest.approx(0.05)] * 2  # code's 5 of 100 at layer 3
    # The per-segment charts and table still show every segment.
    assert len(payload["segments"]) == 3
    whole = viewer.get("/ui/deployments/chat/charts.json?window=15m").json()
    assert whole["totals"]["tokens"] > 200 + 400

    unknown = viewer.get("/ui/deployments/chat?segment=spam")
    assert unknown.status_code == 404 and "knows no segment" in unknown.text
    assert viewer.get("/ui/deployments/chat/charts.json?segment=spam").status_code == 404


def test_alerts_name_their_segment_and_a_default_alert_reads_as_before(as_role, engine, outbox):
    from controlplane.alerts import service as alerts
    from controlplane.alerts.service import Condition

    with Session(engine) as session:
        deployment = thresholds.get_deployment(session=session, name="chat")
        fired = {segment: alerts.fire(session=session, deployment=deployment,
                                      condition=Condition(
                                          kind="quality_regression", severity="critical",
                                          segment=segment, summary=f"over δ on {segment}"))[0].id
                 for segment in ("code", "default")}
        session.commit()
    viewer = as_role("viewer")
    for page in (viewer.get("/ui/alerts").text, viewer.get("/ui/deployments/chat").text):
        code = re.search(rf'href="[^"]*/alerts/{fired["code"]}">([^<]*)</a>', page)
        default = re.search(rf'href="[^"]*/alerts/{fired["default"]}">([^<]*)</a>', page)
        assert code and code.group(1).strip() == "quality_regression · segment code"
        assert default and default.group(1).strip() == "quality_regression"
    detail = viewer.get(f"/ui/alerts/{fired['code']}").text
    assert '<span class="sub">segment code</span>' in detail
