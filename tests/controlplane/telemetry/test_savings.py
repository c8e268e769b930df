"""Savings measured from what runtimes report: token costs reach the rollups from record,
aggregate and interval batches once per batch id; the cost model fitted from them is the one
the runtimes' wall times follow; the net saving is full-depth time minus what was spent, a loss
reported as one; batches without costs count as served, not timed."""

import json
import random
import uuid

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.deployments.service import get_deployment
from controlplane.telemetry.models import Rollup
from exitplane.client.aggregate import Aggregator
from exitplane.wire import (
    AGGREGATE_MSGPACK,
    INTERVAL_MSGPACK,
    RECORDS_JSON,
    RECORDS_MSGPACK,
    IntervalBatch,
    RecordColumns,
    TokenRecord,
)
from tests.support.batches import aggregate_batch, post_telemetry, telemetry_batch
from tests.support.costs import KnownCost, checks_at, expected_savings, timed_records
from tests.support.deployments import FULL, LAYERS, deploy_for_telemetry
from tests.support.waiting import patient_get

COST = KnownCost()


def _costs(engine, name: str) -> list[tuple]:
    """Per (minute, layer): exits, timed tokens, wall time, exit checks, shadow tokens."""
    with Session(engine) as session:
        deployment_id = get_deployment(session=session, name=name).id
        rows = session.execute(
            select(Rollup.minute, Rollup.layer, Rollup.exits, Rollup.timed_tokens,
                   Rollup.latency_us, Rollup.exit_checks, Rollup.shadow_tokens)
            .where(Rollup.deployment_id == deployment_id)).all()
    return sorted(tuple(row) for row in rows if any(row[2:]))


def _savings(client, headers, name: str, **params) -> dict:
    answer = patient_get(client, f"/v1/deployments/{name}/savings", headers=headers,
                         params=params)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _interval(name: str, records: list[dict], cells, *, batch_id: str | None = None) -> dict:
    shadows = [TokenRecord.model_validate(r) for r in records if r.get("shadow")]
    return IntervalBatch(batch_id=batch_id or uuid.uuid4().hex, deployment=name,
                         runtime_id="rt-1", seq=0, num_layers=FULL, raw_sample_rate=0.0,
                         cells=cells, records=RecordColumns.of(shadows) if shadows else None
                         ).model_dump(mode="json")


@pytest.mark.parametrize("content_type", [RECORDS_MSGPACK, RECORDS_JSON])
def test_record_costs_are_counted_once_and_the_fit_finds_the_runtimes_model(
        client, tokens, engine, content_type):
    headers = deploy_for_telemetry(client, tokens, engine)
    records = timed_records(random.Random(5), 240, COST)
    batch = telemetry_batch(records)
    answers = [post_telemetry(client, headers, batch, content_type) for _ in range(2)]
    assert [a.status_code for a in answers] == [202, 202], answers[0].text
    assert [a.json()["duplicate"] for a in answers] == [False, True]

    costs = _costs(engine, "chat")
    assert sum(row[3] for row in costs) == len(records)
    assert sum(row[4] for row in costs) == sum(r["latency_us"] for r in records)
    assert sum(row[5] for row in costs) == sum(r["exit_checks"] for r in records)
    assert sum(row[6] for row in costs) == sum(1 for r in records if r.get("shadow")) > 0
    assert all(row[1] == FULL for row in costs if row[6])

    report = _savings(client, headers, "chat")
    model = report["cost_model"]
    assert model["overhead_us"] == pytest.approx(COST.overhead_us, rel=1e-6)
    assert model["layer_us"] == pytest.approx(COST.layer_us, rel=1e-6)
    assert model["check_us"] == pytest.approx(COST.check_us, rel=1e-6)
    assert model["tokens"] == len(records) and model["full_depth_us"] == pytest.approx(
        COST.full_depth_us)
    expected = expected_savings(records, COST)
    time = report["time"]
    for name in ("full_depth_s", "spent_s", "net_saved_s"):
        assert time[name] == pytest.approx(expected[name], rel=1e-9), name
    assert report["layers_saved"] == expected["layers_saved"] > 0
    assert report["tokens"] == report["timed_tokens"] == report["modelled_tokens"] == 240
    # The split makes up the net; with wall times exactly on the model nothing is unexplained.
    assert time["saved_by_exits_s"] - time["checks_s"] - time["shadow_s"] \
        + time["unexplained_s"] == pytest.approx(time["net_saved_s"])
    assert abs(time["unexplained_s"]) < 1e-9
    shadow = sum(1 for r in records if r.get("shadow"))
    assert time["shadow_s"] == pytest.approx(shadow * len(LAYERS) * COST.check_us / 1e6)
    assert report["pays"] is True
    assert report["speedup"] == pytest.approx(expected["full_depth_s"] / expected["spent_s"])
    assert report["cost"]["unit"] == "accelerator-hour"
    assert report["cost"]["net_saved"] == pytest.approx(expected["net_saved_s"] / 3600)


@pytest.mark.parametrize("shape", ["interval", "pair"])
def test_aggregates_carry_the_costs_records_would(client, tokens, engine, shape):
    """An aggregating runtime's cells (and its shadow records) give the cost columns a runtime
    shipping every record gives, once per batch id."""
    records = timed_records(random.Random(8), 200, COST)
    plain = deploy_for_telemetry(client, tokens, engine, name="plain")
    assert post_telemetry(client, plain, telemetry_batch(records, deployment="plain"),
                          RECORDS_MSGPACK).status_code == 202
    headers = deploy_for_telemetry(client, tokens, engine, name="edge")
    aggregator = Aggregator(exit_layers=LAYERS, num_layers=FULL)
    for record in records:
        assert aggregator.add(TokenRecord.model_validate(record))
    cells = [cell.model_dump(mode="json") for cell in aggregator.cut()]
    assert all(cell["latency_us"] is not None for cell in cells)
    if shape == "interval":
        interval = _interval("edge", records, cells)
        sent = [post_telemetry(client, headers, interval, INTERVAL_MSGPACK) for _ in range(2)]
    else:
        counts = aggregate_batch(cells, deployment="edge")
        shadows = telemetry_batch([r for r in records if r.get("shadow")], deployment="edge",
                                  aggregated=True)
        sent = [post_telemetry(client, headers, body, kind) for body, kind in (
            (counts, AGGREGATE_MSGPACK), (shadows, RECORDS_MSGPACK),
            (counts, AGGREGATE_MSGPACK), (shadows, RECORDS_MSGPACK))]
    assert all(answer.status_code == 202 for answer in sent), sent[0].text
    assert _costs(engine, "edge") == _costs(engine, "plain")
    mine, theirs = (_savings(client, h, name) for h, name in ((headers, "edge"),
                                                              (plain, "plain")))
    assert mine["time"] == pytest.approx(theirs["time"])
    assert mine["cost_model"]["layer_us"] == pytest.approx(COST.layer_us, rel=1e-6)


def test_batches_without_costs_count_as_served_not_timed(client, tokens, engine):
    headers = deploy_for_telemetry(client, tokens, engine)
    records = timed_records(random.Random(2), 120, COST, timed=False)
    assert post_telemetry(client, headers, telemetry_batch(records),
                          RECORDS_MSGPACK).status_code == 202
    cell = {"minute": int(records[0]["ts"]) // 60 * 60, "threshold_version": 2, "layer": 3,
            "exits": 30, "histogram": [0] * 20}
    assert post_telemetry(client, headers, aggregate_batch([cell]),
                          AGGREGATE_MSGPACK).status_code == 202

    report = _savings(client, headers, "chat")
    assert report["tokens"] == 150 and report["timed_tokens"] == 0
    assert report["cost_model"] is None and "no timed tokens" in report["cost_model_reason"]
    assert report["time"] is None and report["pays"] is None and report["cost"] is None
    assert report["layers_saved"] == expected_savings(records, COST)["layers_saved"] + 30 * 9
    assert report["layer_speedup"] > 1


def test_untimed_tokens_are_modelled_beside_timed_ones(client, tokens, engine):
    headers = deploy_for_telemetry(client, tokens, engine)
    timed = timed_records(random.Random(3), 150, COST)
    untimed = timed_records(random.Random(4), 60, COST, timed=False)
    for records in (timed, untimed):
        assert post_telemetry(client, headers, telemetry_batch(records),
                              RECORDS_MSGPACK).status_code == 202
    report = _savings(client, headers, "chat")
    assert report["tokens"] == report["modelled_tokens"] == 210
    assert report["timed_tokens"] == 150
    # Untimed tokens cost what the model says, which is their true cost here.
    assert report["time"]["spent_s"] == pytest.approx(
        expected_savings(timed + untimed, COST)["spent_s"], rel=1e-6)


def test_checks_and_shadow_tokens_that_outweigh_the_exits_are_a_loss(client, tokens, engine):
    headers = deploy_for_telemetry(client, tokens, engine)
    dear = KnownCost(overhead_us=200, layer_us=30, check_us=400)
    records = timed_records(random.Random(6), 200, dear, shadow_rate=0.4,
                            exits=(3, 9, FULL, FULL, FULL))
    assert post_telemetry(client, headers, telemetry_batch(records),
                          RECORDS_MSGPACK).status_code == 202
    report = _savings(client, headers, "chat")
    expected = expected_savings(records, dear)
    assert expected["net_saved_s"] < 0
    assert report["time"]["net_saved_s"] == pytest.approx(expected["net_saved_s"], rel=1e-9)
    assert report["pays"] is False and report["speedup"] < 1
    assert report["cost"]["net_saved"] < 0
    assert report["time"]["checks_s"] + report["time"]["shadow_s"] \
        > report["time"]["saved_by_exits_s"] > 0
    assert report["layers_saved"] > 0  # layers were saved; time was not


def test_fleet_and_filters(client, tokens, engine):
    chat = deploy_for_telemetry(client, tokens, engine)
    code = deploy_for_telemetry(client, tokens, engine, name="code")
    first = timed_records(random.Random(9), 100, COST)
    second = timed_records(random.Random(10), 80, COST)
    for headers, name, records, runtime in ((chat, "chat", first, "rt-1"),
                                            (chat, "chat", second, "rt-2"),
                                            (code, "code", first, "rt-1")):
        assert post_telemetry(client, headers, telemetry_batch(
            records, deployment=name, runtime_id=runtime), RECORDS_MSGPACK).status_code == 202

    one = _savings(client, chat, "chat", runtime_id="rt-2")
    assert one["tokens"] == 80 and one["runtime_id"] == "rt-2"
    assert one["time"]["spent_s"] == pytest.approx(expected_savings(second, COST)["spent_s"])
    assert one["cost_model"]["tokens"] == 180  # fitted on the whole deployment
    assert _savings(client, chat, "chat", segment="default")["tokens"] == 180
    assert _savings(client, chat, "chat", window_s=60,
                    until="2001-01-01T00:00:00Z")["tokens"] == 0

    operator = tokens.headers(tokens.operator)
    fleet = patient_get(client, "/v1/savings", headers=operator).json()
    assert [d["deployment"] for d in fleet["deployments"]] == ["chat", "code"]
    assert fleet["total"]["tokens"] == 280 and fleet["total"]["deployments"] == 2
    assert fleet["total"]["time"]["net_saved_s"] == pytest.approx(
        sum(d["time"]["net_saved_s"] for d in fleet["deployments"]))
    assert patient_get(client, "/v1/savings", headers=chat).status_code == 403
    assert patient_get(client, "/v1/deployments/code/savings", headers=chat).status_code == 403
    refused = patient_get(client, "/v1/deployments/chat/savings", headers=operator,
                          params={"since": "2026-01-02T00:00:00Z",
                                  "until": "2026-01-01T00:00:00Z"})
    assert refused.status_code == 422 and "before until" in refused.text
    assert patient_get(client, "/v1/deployments/chat/savings", headers=operator,
                       params={"window_s": 10}).status_code == 422


def test_checks_that_move_only_with_depth_leave_the_model_unidentified(client, tokens, engine):
    headers = deploy_for_telemetry(client, tokens, engine)
    records = timed_records(random.Random(12), 120, COST, shadow_rate=0.0, exits=(9, FULL))
    assert post_telemetry(client, headers, telemetry_batch(records),
                          RECORDS_MSGPACK).status_code == 202
    report = _savings(client, headers, "chat")
    assert report["cost_model"] is None and "time per check" in report["cost_model_reason"]
    assert report["time"] is None and report["tokens"] == 120


def test_one_depth_leaves_the_time_per_layer_unidentified(client, tokens, engine):
    headers = deploy_for_telemetry(client, tokens, engine)
    records = timed_records(random.Random(11), 80, COST, shadow_rate=0.0, exits=(6,))
    assert post_telemetry(client, headers, telemetry_batch(records),
                          RECORDS_MSGPACK).status_code == 202
    report = _savings(client, headers, "chat")
    assert report["cost_model"] is None and "one depth" in report["cost_model_reason"]
    assert report["layers_saved"] == 80 * (FULL - 6)
    assert checks_at(6) == 2


def test_cli_savings_over_the_api(client, tokens, engine, live_server, tmp_path):
    from click.testing import CliRunner

    from exitplane.cli import main

    headers = deploy_for_telemetry(client, tokens, engine)
    records = timed_records(random.Random(13), 150, COST)
    assert post_telemetry(client, headers, telemetry_batch(records),
                          RECORDS_MSGPACK).status_code == 202
    token_file = tmp_path / "token"
    token_file.write_text(tokens.operator)
    connection = ["--url", live_server.url, "--token-file", str(token_file)]
    run = CliRunner().invoke(main, ["savings", "chat", "--window", "2h", "-o", "json",
                                    *connection])
    assert run.exit_code == 0, run.output
    found = json.loads(run.stdout)
    assert found["tokens"] == 150
    assert found["time"]["net_saved_s"] == pytest.approx(
        expected_savings(records, COST)["net_saved_s"], rel=1e-9)
    people = CliRunner().invoke(main, ["savings", "chat", *connection])
    assert people.exit_code == 0, people.output
    assert "net saved" in people.stdout and "us/layer" in people.stdout
    fleet = CliRunner().invoke(main, ["savings", *connection])
    assert fleet.exit_code == 0 and "(fleet)" in fleet.stdout
    refused = CliRunner().invoke(main, ["savings", "chat", "--segment", "nope", *connection])
    assert refused.exit_code != 0 and "nope" in refused.output


def _scraped(client, deployment: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {sample.name: sample.value
            for family in text_string_to_metric_families(client.get("/metrics").text)
            for sample in family.samples if sample.labels.get("deployment") == deployment}


def test_ingestion_counts_costs_and_the_scrape_gives_the_last_hours_net(client, tokens,
                                                                       engine):
    name = f"priced-{uuid.uuid4().hex[:8]}"  # counters are the process's: a name of its own
    headers = deploy_for_telemetry(client, tokens, engine, name=name)
    records = timed_records(random.Random(14), 120, COST)
    batch = telemetry_batch(records, deployment=name)
    for _ in range(2):  # the replay counts nothing
        assert post_telemetry(client, headers, batch, RECORDS_MSGPACK).status_code == 202
    untimed = telemetry_batch(timed_records(random.Random(15), 30, COST, timed=False),
                              deployment=name)
    assert post_telemetry(client, headers, untimed, RECORDS_MSGPACK).status_code == 202
    found = _scraped(client, name)
    expected = expected_savings(records, COST)
    assert found["exitplane_tokens_timed_total"] == 120
    assert found["exitplane_token_wall_seconds_total"] == pytest.approx(expected["spent_s"])
    assert found["exitplane_layers_saved_total"] == expected["layers_saved"] + sum(
        FULL - r["exit_layer"] for r in untimed["records"] if not r.get("shadow"))
    report = _savings(client, headers, name)
    assert found["exitplane_net_seconds_saved_last_hour"] == pytest.approx(
        report["time"]["net_saved_s"])


def test_the_cost_is_in_the_configured_unit_and_rate(settings, engine, tokens):
    from fastapi.testclient import TestClient

    from exitplane.app import create_app

    priced = settings.model_copy(update={"accelerator_hour_cost": 2.5,
                                         "accelerator_cost_unit": "EUR"})
    with TestClient(create_app(priced, engine=engine)) as client:
        headers = deploy_for_telemetry(client, tokens, engine)
        records = timed_records(random.Random(16), 100, COST)
        assert post_telemetry(client, headers, telemetry_batch(records),
                              RECORDS_MSGPACK).status_code == 202
        cost = _savings(client, headers, "chat")["cost"]
    hours = expected_savings(records, COST)["net_saved_s"] / 3600
    assert cost["unit"] == "EUR" and cost["per_accelerator_hour"] == 2.5
    assert cost["net_saved_hours"] == pytest.approx(hours)
    assert cost["net_saved"] == pytest.approx(2.5 * hours)
