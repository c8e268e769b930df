"""The telemetry read API per traffic segment: GET
/v1/deployments/{name}/segments gives each registered segment's and default's exit rate,
shadow tokens and disagreement from the rollups, bounded by the registry cap; the existing
reads take a `segment` filter.

Segmented rollups are written through the ORM (seg-ingest's write path stores the segment of
posted traffic; until it lands, ingestion stores every token as 'default'); the default
segment's traffic is posted as a real aggregate batch."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.orm import Session

from controlplane.deployments.segments import admit_segments
from controlplane.deployments.service import get_deployment
from controlplane.telemetry.models import Rollup
from tests.support.batches import aggregate_batch
from tests.support.deployments import FULL, deploy_for_telemetry
from tests.support.waiting import patient_get

CAP = 2


def _minute(ago: timedelta) -> datetime:
    return (datetime.now(UTC) - ago).replace(second=0, microsecond=0)


def write_rollups(session: Session, deployment_id: int, segment: str, minute: datetime,
                  layers: dict[int, tuple[int, int, int, int, int]],
                  runtime_id: str = "rt-1", version: int = 2) -> None:
    """layer -> (tokens, exits, shadow_total, policy_exits, policy_mismatches)."""
    for layer, (tokens, exits, shadow, policy_exits, mismatches) in layers.items():
        session.add(Rollup(deployment_id=deployment_id, version=version, runtime_id=runtime_id,
                           minute=minute, segment=segment, layer=layer, tokens=tokens,
                           exits=exits, shadow_total=shadow, shadow_matches=shadow,
                           policy_exits=policy_exits, policy_mismatches=mismatches))


CODE = {3: (100, 10, 20, 4, 1), 6: (90, 9, 20, 2, 1), 9: (81, 1, 20, 0, 0),
        FULL: (80, 80, 20, 0, 0)}
CHAT = {3: (200, 100, 40, 10, 0), 6: (100, 20, 40, 5, 1), 9: (80, 0, 40, 0, 0),
        FULL: (80, 80, 40, 0, 0)}


@pytest.fixture
def segmented(client, tokens, engine) -> dict[str, str]:
    """`chat` knows segments chat and code (the cap, 2); `spam` arrived past the cap. Rollups:
    code and chat in the window (two runtimes for chat), code an hour before it, rows under
    the unregistered `spam`, and default's traffic as a posted aggregate batch."""
    runtime = deploy_for_telemetry(client, tokens, engine)
    other = deploy_for_telemetry(client, tokens, engine, name="code")
    with Session(engine) as session:
        deployment = get_deployment(session=session, name="chat")
        admitted = admit_segments(session=session, deployment_id=deployment.id, auto=True,
                                  names=["chat", "code", "spam"], limit=CAP)
        assert admitted == {"chat": "chat", "code": "code", "spam": "default"}
        recent = _minute(timedelta(minutes=5))
        write_rollups(session, deployment.id, "code", recent, CODE)
        write_rollups(session, deployment.id, "chat", recent, CHAT, runtime_id="rt-1")
        write_rollups(session, deployment.id, "chat", recent - timedelta(minutes=1), CHAT,
                      runtime_id="rt-2")
        write_rollups(session, deployment.id, "code", _minute(timedelta(hours=2)), CODE)
        write_rollups(session, deployment.id, "spam", recent, CODE)
        session.commit()
    minute = int(_minute(timedelta(minutes=3)).timestamp())
    aggregate = aggregate_batch([
        {"minute": minute, "threshold_version": 2, "layer": 3, "exits": 30,
         "histogram": [0] * 20},
        {"minute": minute, "threshold_version": 2, "layer": FULL, "exits": 70,
         "histogram": [0] * 20}], seq=1, raw_sample_rate=0.05)
    response = client.post("/v1/telemetry", json=aggregate, headers={
        **runtime, "Content-Type": "application/vnd.exitplane.aggregate+json"})
    assert response.status_code == 202, response.text
    return {"runtime": runtime, "other": other}


def test_segments_report_each_known_segment_and_default_over_the_window(client, segmented):
    response = patient_get(client, "/v1/deployments/chat/segments?window_s=3600",
                           headers=segmented["runtime"])
    assert response.status_code == 200, response.text
    report = response.json()
    rows = {row["segment"]: row for row in report["segments"]}
    assert [row["segment"] for row in report["segments"]] == ["default", "chat", "code"]
    assert "spam" not in rows  # past the cap: never a row of its own
    assert report["records_sampled"] is True and report["raw_sample_rate"] == 0.05

    code = rows["code"]  # one minute in the window; the one two hours ago is left out
    assert (code["tokens"], code["early_exits"], code["shadow_tokens"]) == (100, 20, 20)
    assert code["exit_rate"] == pytest.approx(0.2)
    assert (code["policy_exits"], code["policy_mismatches"]) == (6, 2)
    assert code["disagreement"] == pytest.approx(2 / 20)
    assert code["exit_disagreement"] == pytest.approx(2 / 6)
    assert code["mean_depth"] == pytest.approx((10 * 3 + 9 * 6 + 1 * 9 + 80 * FULL) / 100)
    assert [(r["layer"], r["tokens"], r["exits"]) for r in code["layers"]] == [
        (3, 100, 10), (6, 90, 9), (9, 81, 1)]

    chat = rows["chat"]  # two runtimes' minutes summed
    assert (chat["tokens"], chat["early_exits"], chat["shadow_tokens"]) == (400, 240, 80)
    assert chat["disagreement"] == pytest.approx(2 / 80)

    default = rows["default"]  # the posted aggregate: 30 of 100 tokens left at layer 3
    assert (default["tokens"], default["early_exits"], default["exit_rate"]) == (100, 30, 0.3)
    assert default["shadow_tokens"] == 0 and default["disagreement"] is None

    wide = patient_get(client, "/v1/deployments/chat/segments?window_s=86400",
                       headers=segmented["runtime"]).json()
    assert {r["segment"]: r["tokens"] for r in wide["segments"]}["code"] == 200


def test_segments_read_is_scoped_and_validated(client, segmented):
    assert client.get("/v1/deployments/chat/segments",
                      headers=segmented["other"]).status_code == 403
    assert client.get("/v1/deployments/chat/segments").status_code == 401
    short = patient_get(client, "/v1/deployments/chat/segments?window_s=5",
                        headers=segmented["runtime"])
    assert short.status_code == 422 and "window_s" in short.text
    only_rt2 = patient_get(client, "/v1/deployments/chat/segments?runtime_id=rt-2",
                           headers=segmented["runtime"]).json()
    assert [r["tokens"] for r in only_rt2["segments"]] == [0, 200, 0]


def test_existing_reads_take_a_segment_filter(client, segmented):
    runtime = segmented["runtime"]
    since = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
    rates = patient_get(client, "/v1/deployments/chat/telemetry/exit-rates",
                        params={"since": since, "segment": "code"}, headers=runtime).json()
    assert [(r["layer"], r["tokens"], r["exits"]) for r in rates] == [
        (3, 100, 10), (6, 90, 9), (9, 81, 1), (FULL, 80, 80)]
    everything = patient_get(client, "/v1/deployments/chat/telemetry/exit-rates",
                             params={"since": since}, headers=runtime).json()
    # Unfiltered reads still sum every segment's rows (spam's, stored before the cap, too).
    assert sum(r["tokens"] for r in everything if r["layer"] == 3) == 100 + 400 + 100 + 100

    quality = patient_get(client, "/v1/deployments/chat/telemetry/disagreement",
                          params={"since": since, "segment": "chat"}, headers=runtime).json()
    assert [(q["shadow_tokens"], q["mismatches"]) for q in quality] == [(40, 1), (40, 1)]
    default = patient_get(client, "/v1/deployments/chat/telemetry/signal-histogram",
                          params={"since": since, "segment": "default"}, headers=runtime)
    assert default.status_code == 200 and set(default.json()) <= {"3", str(FULL)}

    unknown = patient_get(client, "/v1/deployments/chat/telemetry/exit-rates",
                          params={"segment": "spam"}, headers=runtime)
    assert unknown.status_code == 404
    assert "knows no segment 'spam'" in unknown.json()["detail"]
    assert "default, chat, code" in unknown.json()["detail"]
    for malformed in ("x" * 65, "Code Path"):
        refused = patient_get(client, "/v1/deployments/chat/telemetry/exit-rates",
                              params={"segment": malformed}, headers=runtime)
        assert refused.status_code == 422 and "segment" in refused.text
