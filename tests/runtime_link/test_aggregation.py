"""Edge aggregation is exact: the same token stream shipped as records (the record path) and
through the aggregating shipper (aggregates + shadow tokens + a 10% sample) leaves identical
rollups and histograms; a replayed or split aggregate batch never double-counts; the read API
says records are sampled."""

from __future__ import annotations

import time
import uuid

import httpx
import msgpack
import pytest
from sqlalchemy import text

from exitplane.app import create_app
from exitplane.client.aggregate import Aggregator
from exitplane.client.shipper import TelemetryShipper
from exitplane.wire import AGGREGATE_MSGPACK
from tests.support.network import free_port
from tests.support.runtime_link import (
    DEPLOYMENT,
    EXIT_LAYERS,
    NUM_LAYERS,
    ControlPlane,
    fast_shipper,
    publish,
    stored_rollups,
    token_stream,
)
from tests.support.waiting import patient_get


@pytest.mark.parametrize("bundle", [True, False], ids=["interval", "pair"])
def test_aggregates_give_the_rollups_records_give(control_plane, operator, runtime_token,
                                                  engine, tmp_path, bundle):
    """Interval batches (counts and records in one request, the default) and the pair of an
    aggregate batch and a sampled record batch store the same."""
    versions = [publish(operator, {2: 0.6, 4: 0.3}), publish(operator, {2: 0.9, 4: 0.5})]
    stream = token_stream(4000, versions=[0, *versions])
    plain = fast_shipper(control_plane.url, runtime_token, tmp_path / "a", "rt-records").start()
    edge = fast_shipper(control_plane.url, runtime_token, tmp_path / "b", "rt-edge",
                        raw_sample_rate=0.1, exit_layers=EXIT_LAYERS,
                        aggregate_interval_s=0.2, bundle=bundle).start()
    for record in stream:
        assert plain.submit(record)
        assert edge.submit(record)
    assert plain.flush(60) and edge.flush(60)
    assert plain.wait_replayed(60) and edge.wait_replayed(60)

    expected, aggregated = stored_rollups(engine, "rt-records"), stored_rollups(engine, "rt-edge")
    assert expected[0] and expected[1]  # something to compare
    assert sum(row[3] for row in expected[0] if row[2] == EXIT_LAYERS[0]) == len(stream)
    assert any(row[7] for row in expected[0])  # the policy exits some shadow tokens
    assert aggregated == expected

    shadow_tokens = sum(record.shadow is not None for record in stream)
    with engine.connect() as connection:
        stored = dict(connection.execute(text(
            "SELECT runtime_id, count(*) FROM token_records GROUP BY runtime_id")).all())
        kinds = dict(connection.execute(text(
            "SELECT kind, sum(tokens) FROM telemetry_batches WHERE runtime_id = 'rt-edge' "
            "GROUP BY kind")).all())
    assert stored["rt-records"] == len(stream)
    # Every shadow token and about 10% of the rest travel as records.
    assert shadow_tokens + 200 < stored["rt-edge"] < shadow_tokens + 600
    assert edge.counters["sent_records"] == stored["rt-edge"]
    if bundle:  # the records rode in the interval batches: no record batch was sent
        assert kinds == {"aggregate": len(stream)} and edge.counters["sent_batches"] == 0
    else:
        assert kinds == {"aggregate": len(stream), "sampled": 0}
        assert edge.counters["sent_batches"] > 0
    assert edge.counters["sent_aggregate_tokens"] == len(stream)
    counts = patient_get(operator, f"/v1/deployments/{DEPLOYMENT}/telemetry/count").json()
    assert counts["records_sampled"] is True and counts["raw_sample_rate"] == 0.1
    assert counts["tokens"] == 2 * len(stream)
    assert plain.close(10) and edge.close(10)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_replayed_aggregates_count_once(control_plane, operator, runtime_token, engine):
    publish(operator, {2: 0.5, 4: 0.5})
    aggregator = Aggregator(exit_layers=EXIT_LAYERS, num_layers=NUM_LAYERS)
    for record in token_stream(300, versions=[1]):
        aggregator.add(record)
    body = {"batch_id": uuid.uuid4().hex, "deployment": DEPLOYMENT, "runtime_id": "rt",
            "seq": 0, "num_layers": NUM_LAYERS, "raw_sample_rate": 0.0,
            "cells": [cell.model_dump() for cell in aggregator.cut()]}
    headers = {"Authorization": f"Bearer {runtime_token}", "Content-Type": AGGREGATE_MSGPACK}
    acks = [httpx.post(f"{control_plane.url}/v1/telemetry", headers=headers,
                       content=msgpack.packb(body)) for _ in range(2)]
    assert [ack.status_code for ack in acks] == [202, 202]
    assert [ack.json()["duplicate"] for ack in acks] == [False, True]
    assert acks[0].json()["accepted"] == 300
    counts = patient_get(operator, f"/v1/deployments/{DEPLOYMENT}/telemetry/count").json()
    assert counts["tokens"] == 300 and counts["records"] == 0

    # A cell at a layer the deployment lacks refuses the batch, naming the cell.
    bad = {**body, "batch_id": uuid.uuid4().hex,
           "cells": [*body["cells"], {**body["cells"][0], "layer": 3}]}
    refused = httpx.post(f"{control_plane.url}/v1/telemetry", headers=headers,
                         content=msgpack.packb(bad))
    assert refused.status_code == 422
    assert f"cell {len(body['cells'])}: layer 3 is neither an exit layer" in refused.text
    assert patient_get(operator, f"/v1/deployments/{DEPLOYMENT}/telemetry/count"
                       ).json()["tokens"] == 300

    # An exitplane content type this control plane does not know: 415 naming the known ones.
    future = httpx.post(f"{control_plane.url}/v1/telemetry", content=b"{}", headers={
        **headers, "Content-Type": "application/vnd.exitplane.sketch+json"})
    assert future.status_code == 415 and AGGREGATE_MSGPACK in future.json()["detail"]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_split_and_spooled_aggregates_count_once(settings, engine, operator, runtime_token,
                                                 tmp_path):
    publish(operator, {2: 0.5, 4: 0.5})
    small = settings.model_copy(update={"max_body_bytes": 600})
    plane = ControlPlane(make_app=lambda: create_app(small, engine=engine), port=free_port())
    plane.start()
    try:
        edge = fast_shipper(plane.url, runtime_token, tmp_path / "spool", "rt-edge",
                            raw_sample_rate=0.0, exit_layers=EXIT_LAYERS, aggregate_interval_s=60,
                            max_attempts=1).start()
        stream = token_stream(2000, versions=[1], start=(time.time() // 60 - 30) * 60)
        stream = [record.model_copy(update={"shadow": None, "exit_layer": EXIT_LAYERS[0]})
                  if record.shadow else record for record in stream]
        for record in stream[:1000]:
            edge.submit(record)
        assert edge.flush(30)
        assert edge.counters["splits"] >= 1
        plane.stop()  # the next cut goes to the spool, and is replayed (split) later
        for record in stream[1000:]:
            edge.submit(record)
        assert edge.flush(30) and edge.spooled_batches >= 1
        plane.start()
        assert edge.wait_replayed(60) and edge.close(10)
    finally:
        plane.close()
    with engine.connect() as connection:
        total = connection.execute(text(
            "SELECT sum(tokens) FROM rollups WHERE layer = :first"),
            {"first": EXIT_LAYERS[0]}).scalar()
    assert total == len(stream)
    assert edge.counters["sent_aggregate_tokens"] == len(stream)


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_engine_s_tokens_aggregate_exactly(control_plane, operator, runtime_token,
                                               make_engine, engine, tmp_path):
    """The real engine (tiny model, 30% shadow) feeding both shippers: same rollups."""
    version = publish(operator, {2: 0.2, 4: 0.1})
    plain = fast_shipper(control_plane.url, runtime_token, tmp_path / "a", "rt-records").start()
    edge = fast_shipper(control_plane.url, runtime_token, tmp_path / "b", "rt-edge",
                        raw_sample_rate=0.0, exit_layers=EXIT_LAYERS).start()

    def both(record) -> None:
        plain.submit(record)
        edge.submit(record)

    runtime = make_engine(runtime_id="rt", on_record=both, shadow_rate=0.3)
    runtime.set_thresholds(_wire(operator, version))
    for number in range(8):
        runtime.add_request([1, 7 + number, 9], request_id=f"req-{number}", max_new_tokens=12,
                            stop_token_ids=())
    produced = shadow = 0
    while runtime.has_work:
        for out in runtime.step():
            produced += 1
            shadow += out.record.shadow is not None
    assert plain.flush(30) and edge.flush(30)
    assert plain.wait_replayed(30) and edge.wait_replayed(30)
    expected = stored_rollups(engine, "rt-records")
    assert sum(row[3] for row in expected[0] if row[2] == EXIT_LAYERS[0]) == produced == 96
    assert 0 < shadow < produced and any(row[4] for row in expected[0] if row[2] < NUM_LAYERS)
    assert stored_rollups(engine, "rt-edge") == expected
    assert edge.counters["sent_records"] == shadow  # raw_sample_rate 0: shadow tokens only
    assert plain.close(10) and edge.close(10)


def _wire(operator, version: int):
    from exitplane.wire import ThresholdSetWire

    body = operator.get(f"/v1/deployments/{DEPLOYMENT}/threshold-sets/{version}").json()
    return ThresholdSetWire.build(deployment=DEPLOYMENT, version=version, signal=body["signal"],
                                  thresholds={int(k): v for k, v in body["thresholds"].items()})


def test_aggregating_records_ride_at_the_aggregates_pace(tmp_path):
    def interval(**options) -> float:
        shipper = TelemetryShipper(base_url="http://127.0.0.1:9", token="t", deployment="d",
                                   runtime_id="r", num_layers=NUM_LAYERS,
                                   spool_dir=tmp_path / str(len(options)), **options)
        try:
            return shipper.batch_interval_s
        finally:
            shipper.close()

    assert interval() == 1.0  # every token a record: a batch a second
    assert interval(raw_sample_rate=0.01, exit_layers=EXIT_LAYERS,
                    aggregate_interval_s=7.0) == 7.0
    assert interval(raw_sample_rate=0.01, exit_layers=EXIT_LAYERS, aggregate_interval_s=7.0,
                    batch_interval_s=0.5) == 0.5
